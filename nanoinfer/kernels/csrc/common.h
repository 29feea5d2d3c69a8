// What the kernels share: bf16 as torch stores it, and math written so that loops around it
// vectorise.
#pragma once
#include <algorithm>
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

// A KV cache row in q8_0 blocks (attention/kv_cache.py): per 32 values an fp16 scale d and 32
// int8 q, 34 bytes; value i is q * d, exactly. A pointer to Q8 is a head's row of blocks.
struct Q8 { uint8_t byte; };
constexpr int64_t kQ8Block = 32, kQ8Bytes = 34;

inline uint32_t f32_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float f32_from(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// IEEE half -> float, exactly.
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, em = h & 0x7fff;
    if (em >= 0x7c00) return f32_from(sign | 0x7f800000u | (uint32_t(em & 0x3ff) << 13));  // inf, NaN
    if (em >= 0x400) return f32_from(sign | ((em + ((127 - 15) << 10)) << 13));             // normal
    return f32_from(f32_bits(float(em) * 5.9604644775390625e-08f) | sign);                  // subnormal: em * 2^-24
}

// float -> IEEE half, rounded to nearest even (as torch's .half()).
inline uint16_t float_to_half(float f) {
    uint32_t x = f32_bits(f);
    const uint32_t sign = x & 0x80000000u;
    x ^= sign;
    uint16_t o;
    if (x >= (127u + 16) << 23) {  // past the largest half: inf (NaN stays NaN)
        o = x > 255u << 23 ? 0x7e00 : 0x7c00;
    } else if (x < 113u << 23) {  // a half subnormal or zero: let the float add round it
        const uint32_t magic = ((127u - 15) + (23 - 10) + 1) << 23;
        o = uint16_t(f32_bits(f32_from(x) + f32_from(magic)) - magic);
    } else {
        const uint32_t odd = (x >> 13) & 1;
        x += ((15u - 127) << 23) + 0xfff + odd;
        o = uint16_t(x >> 13);
    }
    return uint16_t(o | (sign >> 16));
}

inline float q8_scale(const Q8* row, int64_t block) {
    uint16_t h;
    std::memcpy(&h, row + block * kQ8Bytes, 2);
    return half_to_float(h);
}

// The q8_0 cache stores each head's k and v rotated by an orthonormal Walsh-Hadamard transform
// (as llama.cpp does for its quantised caches): an outlier channel's weight is spread over the
// block, so the block's scale no longer crushes its small values. q . k is unchanged when q is
// rotated the same way (the transform is orthonormal), and the attention's output, a sum of
// rotated values, is rotated back (the transform is its own inverse). k's blocks: the largest
// power of two from 64 that divides the head size; v's: 64; none when 64 does not divide it.
inline int64_t k_rotation(int64_t D) {
    if (D % 64) return 0;
    int64_t n = 64;
    while (D % (2 * n) == 0) n *= 2;
    return n;
}
inline int64_t v_rotation(int64_t D) { return D % 64 ? 0 : 64; }

// x's D values, each block of n (a power of two) transformed in place: butterflies, then 1/sqrt(n).
inline void hadamard_blocks(float* x, int64_t D, int64_t n) {
    const float scale = 1.f / std::sqrt(float(n));
    for (int64_t b = 0; b < D; b += n) {
        float* v = x + b;
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = v[j], c = v[j + h];
                    v[j] = a + c;
                    v[j + h] = a - c;
                }
        for (int64_t i = 0; i < n; i++) v[i] *= scale;
    }
}

// The q8_0 cache's candidate scales for a block (attention/kv_cache.py, Q8_SCALE_DIVISORS):
// d = max|x| / n for n = 127, 126.5, ..., 120, as fp32 factors 1 / n (rounded from double, as
// Python rounds them).
constexpr int kQ8Candidates = 15;
struct Q8Factors {
    float f[kQ8Candidates];
    constexpr Q8Factors() : f() {
        for (int j = 0; j < kQ8Candidates; j++) f[j] = float(1.0 / (127.0 - 0.5 * j));
    }
};
constexpr Q8Factors kQ8Factors{};

// One head's n values (a multiple of 32) as q8_0 blocks, as kv_cache.quantize_q8 computes them.
// Per block, each candidate scale d16 = fp16(max|x| * (1 / n)) quantises q = round-half-even(x *
// (1 / d16)), clamped to +-127, and is scored by its squared error d16^2 * sum(f^2), f = q - x *
// (1 / d16), the step's fraction (exact in fp32), rounded to 1/4096: whole numbers in doubles, so the
// sum and the products are exact whatever order the compiler adds them in (-ffast-math), and
// PyTorch's sum gives the same bits. The smallest error wins, the first of equals.
inline void q8_quantize_row(const float* x, int64_t n, Q8* out) {
    for (int64_t b = 0; b < n / kQ8Block; b++) {
        const float* xb = x + b * kQ8Block;
        uint8_t* ob = reinterpret_cast<uint8_t*>(out + b * kQ8Bytes);
        uint32_t abits = 0;
        for (int64_t i = 0; i < kQ8Block; i++) abits = std::max(abits, f32_bits(xb[i]) & 0x7fffffffu);
        const float amax = f32_from(abits);
        uint16_t best = float_to_half(amax * kQ8Factors.f[0]);
        double best_err = INFINITY;  // (a NaN error, from an infinite scale, never wins)
        for (int j = 0; j < kQ8Candidates; j++) {
            const uint16_t h = float_to_half(amax * kQ8Factors.f[j]);
            const float d = half_to_float(h), id = d > 0.f ? 1.f / d : 0.f;
            double sum = 0.;
            for (int64_t i = 0; i < kQ8Block; i++) {
                const float r = xb[i] * id, q = std::max(-127.f, std::min(127.f, std::nearbyint(r)));
                const double f = std::nearbyint((q - r) * 4096.f);
                sum += f * f;
            }
            const double err = double(d) * double(d) * sum;
            if (err < best_err) {
                best_err = err;
                best = h;
            }
        }
        std::memcpy(ob, &best, 2);
        const float d = half_to_float(best), id = d > 0.f ? 1.f / d : 0.f;
        for (int64_t i = 0; i < kQ8Block; i++) {
            const float v = std::nearbyint(xb[i] * id);
            ob[2 + i] = uint8_t(int8_t(std::max(-127.f, std::min(127.f, v))));
        }
    }
}

// A head's D values into its q8_0 row, rotated first by blocks of `rot` values (0: not rotated).
inline void q8_store_head(const float* x, int64_t D, Q8* out, int64_t rot) {
    if (!rot) {
        q8_quantize_row(x, D, out);
        return;
    }
    float tmp[1024];
    float* buf = D <= 1024 ? tmp : new float[size_t(D)];
    std::memcpy(buf, x, sizeof(float) * D);
    hadamard_blocks(buf, D, rot);
    q8_quantize_row(buf, D, out);
    if (buf != tmp) delete[] buf;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const Q8* p, int64_t i) {
    const int64_t b = i / kQ8Block;
    return float(int8_t((p + b * kQ8Bytes + 2 + i % kQ8Block)->byte)) * q8_scale(p, b);
}
// Where a head's value i lies in its row: an element for float types, within the blocks for q8_0.
template <typename T>
inline const T* value_ptr(const T* row, int64_t i) { return row + i; }
inline const Q8* value_ptr(const Q8* row, int64_t i) { return row + i / kQ8Block * kQ8Bytes + i % kQ8Block; }
// Elements of a head's row in the cache: head_dim, or its q8_0 blocks' bytes.
template <typename T>
constexpr int64_t head_stride(int64_t D) { return D; }
template <>
constexpr int64_t head_stride<Q8>(int64_t D) { return D / kQ8Block * kQ8Bytes; }
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

// tanh(v) in plain arithmetic, so that a loop of it vectorises (std::tanh does not): for |v| <
// 0.625 Cephes' odd polynomial for tanhf, else sign(v) (1 - e) / (1 + e) with e = e^-2|v| < 0.29 (no
// cancellation, and the exponential never overflows). Relative error ~2e-7 (float std::tanh's 2.6e-7
// against a double reference).
inline float tanh_poly_exp(float v) {
    const float a = std::fabs(v), z = a * a;
    const float e = exp_nonpositive(-2.f * a);
    const float far = (1.f - e) / (1.f + e);
    const float near =
        ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
         3.33332819422e-1f) * z * a + a;
    return std::copysign(a < 0.625f ? near : far, v);
}

// cap * tanh(s / cap): Gemma 2's soft-capping.
inline float soft_cap(float s, float cap) { return cap * tanh_poly_exp(s / cap); }

}  // namespace
