// Math shared by the kernels, written so that loops around it vectorise.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// e^x for x <= 0 in plain arithmetic, so that the softmax loop vectorises (a libm call
// does not): x = k ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7, 2^k
// through the exponent bits. Relative error below 1e-7 over [-87, 0].
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float k = std::floor(x * 1.44269504f + 0.5f);
    const float r = x - k * 0.693145752f - k * 1.42860677e-06f;  // ln2 in two parts
    float p = 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (int32_t(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

}  // namespace
