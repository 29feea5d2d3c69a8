// What the kernels share: bf16 as torch stores it, and math written so that loops around it
// vectorise.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

struct BF16 { uint16_t bits; };

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const BF16* p, int64_t i) {
    uint32_t u = uint32_t(p[i].bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(BF16* p, int64_t i, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffff) > 0x7f800000) { p[i].bits = uint16_t((u >> 16) | 0x40); return; }  // NaN
    u += 0x7fff + ((u >> 16) & 1);
    p[i].bits = uint16_t(u >> 16);
}

// x rounded as if stored in T and loaded back (the rounding of each op on T in torch).
inline float round_as(float x, const float*) { return x; }
inline float round_as(float x, const BF16*) {
    BF16 b;
    store(&b, 0, x);
    return load(&b, 0);
}

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
