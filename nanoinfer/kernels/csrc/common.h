// What the kernels share: bf16 as torch stores it, and math written so that loops around it
// vectorise.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

struct BF16 { uint16_t bits; };

// Round to nearest even, as torch does (a NaN stays a quiet NaN): the bits of the rounded
// fp32 value, its low half zero. Branch-free, so that loops over bf16 vectorise.
inline uint32_t bf16_round_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    return (u & 0x7fffffff) > 0x7f800000 ? (u | 0x400000) & 0xffff0000u : rounded;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const BF16* p, int64_t i) {
    const uint32_t u = uint32_t(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(BF16* p, int64_t i, float x) { reinterpret_cast<uint16_t*>(p)[i] = uint16_t(bf16_round_bits(x) >> 16); }

// x rounded as if stored in T and loaded back (the rounding of each op on T in torch).
inline float round_as(float x, const float*) { return x; }
inline float round_as(float x, const BF16*) {
    const uint32_t u = bf16_round_bits(x);
    float f;
    std::memcpy(&f, &u, 4);
    return f;
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
