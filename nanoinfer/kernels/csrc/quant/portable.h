// The portable kernels: each type's block layout, its dequantisation and its dot product in
// plain C++ (types.def names them). They are the definition: a SIMD path computes the same
// integers and the same float operations in the same order, so every path gives these bits.
// They also run wherever a path has no kernel of its own for a type.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernel.h"
#include "packed.h"
#include "types.h"

namespace {

// ---- block layouts (portable decoders; also the reference for the SIMD loaders) ----------

// A 32-block's values as integers: w = d * q (Q4_0, Q5_0, Q8_0; q signed) or w = d * q + m
// (Q4_1, Q5_1; q in 0..31). d, m: fp16 at the block's start.
//   Q4_0 [d][qs 16]: q[j] = (qs[j] & 15) - 8, q[j + 16] = (qs[j] >> 4) - 8
//   Q4_1 [d][m][qs 16]: the same without - 8
//   Q5_0 [d][qh: u32][qs 16]: the nibble as Q4_0 | bit j of qh << 4, then - 16
//   Q5_1 [d][m][qh: u32][qs 16]: the same without - 16
//   Q8_0 [d][qs: int8 x 32]
template <int T>
void decode32(const uint8_t* b, int8_t* q) {
    if constexpr (T == Q8_0) {
        std::memcpy(q, b + 2, 32);
    } else {
        constexpr int off = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
        constexpr int bias = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
        const uint8_t* qs = b + off;
        uint32_t qh = 0;
        if constexpr (T == Q5_0) qh = rd32(b + 2);
        if constexpr (T == Q5_1) qh = rd32(b + 4);
        for (int j = 0; j < 16; j++) {
            q[j] = int8_t(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
            q[j + 16] = int8_t(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
        }
    }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min packed in 12 bytes:
// j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,
// m = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
inline void kscales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = uint8_t((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = uint8_t((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

// A 256-block's values as unsigned integers:
//   Q4_K [d][dmin][scales 12][qs 128]: sub-block 2c is qs[32c..32c+31] & 15, 2c+1 the high
//        nibbles; w = d * sc_j * q - dmin * m_j
//   Q5_K [d][dmin][scales 12][qh 32][qs 128]: as Q4_K, plus bit j of qh[l] << 4 for value l of
//        sub-block j
//   Q6_K [ql 128][qh 64][scales: int8 x 16][d]: value 128h + 32t + l (h < 2, t < 4, l < 32) is
//        (ql[64h + 32(t & 1) + l] >> 4(t >> 1)) & 15 | ((qh[32h + l] >> 2t) & 3) << 4;
//        w = d * scales[i / 16] * (q - 32)
template <int T>
void decode256(const uint8_t* b, uint8_t* q) {
    if constexpr (T == Q6_K) {
        q6_values(b, q);
    } else {
        const uint8_t* qs = b + (T == Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                uint8_t lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                if constexpr (T == Q5_K) {
                    lo |= ((b[16 + l] >> (2 * c)) & 1) << 4;
                    hi |= ((b[16 + l] >> (2 * c + 1)) & 1) << 4;
                }
                q[64 * c + l] = lo;
                q[64 * c + 32 + l] = hi;
            }
    }
}

// ---- dequantisation: one block to floats, exactly as gguf.quants.dequantize -------------

// One value of a float type's row (F32, F16, BF16) as fp32.
template <int T>
inline float float_at(const uint8_t* w, int64_t k) {
    if constexpr (T == F32) {
        float v;
        std::memcpy(&v, w + 4 * k, 4);
        return v;
    } else {
        return T == BF16 ? bf16(rd16(w + 2 * k)) : f16(rd16(w + 2 * k));
    }
}

template <int T>
void dequantize16(const uint8_t* b, float* out) { out[0] = float_at<T>(b, 0); }

template <int T>
void dequantize32(const uint8_t* b, float* out) {
    int8_t q[32];
    decode32<T>(b, q);
    const float d = f16(rd16(b));
    if constexpr (T == Q4_1 || T == Q5_1) {
        // d * q is exact (11 x 8 bits): one rounding, in the add, as numpy's d * q + m
        const float m = f16(rd16(b + 2));
        for (int i = 0; i < 32; i++) out[i] = d * float(q[i]) + m;
    } else {
        for (int i = 0; i < 32; i++) out[i] = d * float(q[i]);
    }
}

template <int T>
void dequantizek(const uint8_t* b, float* out) {
    uint8_t q[QK];
    decode256<T>(b, q);
    if constexpr (T == Q6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const float d = f16(rd16(b + 208));
        for (int g = 0; g < 16; g++) {
            const float ds = opaque(d * float(sc[g]));  // exact; then one rounding, in ds * q as numpy
            for (int l = 0; l < 16; l++) out[16 * g + l] = ds * float(int(q[16 * g + l]) - 32);
        }
    } else {
        uint8_t sc[8], mn[8];
        kscales(b + 4, sc, mn);
        const float d = f16(rd16(b)), dmin = f16(rd16(b + 2));
        for (int j = 0; j < 8; j++) {
            // d * sc and dmin * m exact, (d * sc) * q exact (<= 22 bits): one rounding
            const float ds = d * float(sc[j]), dm = dmin * float(mn[j]);
            for (int l = 0; l < 32; l++) out[32 * j + l] = ds * float(q[32 * j + l]) - dm;
        }
    }
}

// ---- dot products: one weight row of nb blocks times one activation row ------------------

// 32-blocks, per output: one chain of fused multiply-adds over the blocks, block b adding
// (d_w * d_x) times its exact integer dot (then, Q4_1 and Q5_1, m_w times s_x). One chain per
// output is what lets the repacked kernels keep 8 outputs in the 8 lanes of one vector.
template <int T>
inline float block32_step(const uint8_t* blk, const int8_t* xb, float dx, float sx, float acc) {
    int8_t q[32];
    decode32<T>(blk, q);
    int32_t p = 0;
    for (int i = 0; i < 32; i++) p += int32_t(q[i]) * xb[i];
    acc = madd(f16(rd16(blk)) * dx, float(p), acc);
    if constexpr (T == Q4_1 || T == Q5_1) acc = madd(f16(rd16(blk + 2)), sx, acc);
    return acc;
}

template <int T>
float dot32(const uint8_t* w, int64_t nb, const ActsRow& a) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++)
        acc = block32_step<T>(w + b * block_bytes(T), a.q + b * 32, a.d[b], a.s ? a.s[b] : 0.f, acc);
    return acc;
}

// K-quants, per output: one chain of fused multiply-adds over the 256-blocks. Per block b the
// exact integers: isum, each sub-block's integer dot times its scale (Q6_K: its -32 taken off
// through qo, -32 times the sums of x per 16 values), and (Q4_K, Q5_K) msum, the mins times the
// sums of x per 32 values; the chain adds -(dmin_w * d_x) * msum, then (d_w * d_x) * isum.
template <int T>
inline float blockk_step(const uint8_t* blk, const ActsRow& a, int64_t b, float acc) {
    const int8_t* xb = a.q + b * QK;
    const float dx = a.d[b];
    uint8_t q[QK];
    decode256<T>(blk, q);
    int32_t isum = 0;
    if constexpr (T == Q6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int g = 0; g < 16; g++) {
            int32_t p = 0;
            for (int l = 0; l < 16; l++) p += int32_t(q[16 * g + l]) * xb[16 * g + l];
            isum += sc[g] * (p + a.qo[b * kSums16 + g]);
        }
        return madd(f16(rd16(blk + 208)) * dx, float(isum), acc);
    } else {
        uint8_t sc[8], mn[8];
        kscales(blk + 4, sc, mn);
        int32_t msum = 0;
        for (int j = 0; j < 8; j++) {
            int32_t p = 0;
            for (int l = 0; l < 32; l++) p += int32_t(q[32 * j + l]) * xb[32 * j + l];
            isum += sc[j] * p;
            msum += mn[j] * a.bs[b * kSums32 + j];
        }
        acc = madd(-(f16(rd16(blk + 2)) * dx), float(msum), acc);
        return madd(f16(rd16(blk)) * dx, float(isum), acc);
    }
}

template <int T>
float dotk(const uint8_t* w, int64_t nb, const ActsRow& a) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) acc = blockk_step<T>(w + b * block_bytes(T), a, b, acc);
    return acc;
}

// F32 / F16 / BF16, per output: 16 lanes (k mod 16) of fused multiply-adds over k, then a fixed
// tree. A block is one value, so nb is K.
template <int T>
float dot16(const uint8_t* w, int64_t K, const ActsRow& a) {
    const float* x = a.x;
    float acc[16] = {};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; l++) acc[l] = madd(x[k + l], float_at<T>(w, k + l), acc[l]);
    for (int l = 0; k + l < K; l++) acc[l] = madd(x[k + l], float_at<T>(w, k + l), acc[l]);
    float v[8];
    for (int j = 0; j < 8; j++) v[j] = opaque(acc[j] + acc[j + 8]);
    return hsum8(v);
}

// ---- the portable path ------------------------------------------------------------------

// Outputs y[m0 .. m0 + mt - 1, n .. n + cols - 1] with a type's dot (types.def's `dot`).
template <auto Dot>
void rows_portable(const Ctx& c, int64_t n0, int cols, int64_t m0, int mt) {
    for (int64_t n = n0; n < n0 + cols; n++)
    for (int64_t m = m0; m < m0 + mt; m++) {
        const float v = Dot(c.w + n * c.rb, c.nb, acts_row(c, m));
        c.y[m * c.ldy + n] = c.bias ? v + c.bias[n] : v;
    }
}

// The outputs of a type with a repacked layout, its first c.grouped rows repacked (quant/packed.h):
// each block taken back to its stored form, then the type's dot arithmetic.
template <int T>
void rows_portable_grouped(const Ctx& c, int64_t n0, int cols, int64_t m0, int mt) {
    for (int64_t n = n0; n < n0 + cols; n++)
        for (int64_t m = m0; m < m0 + mt; m++) {
            const ActsRow a = acts_row(c, m);
            float acc = 0.f;
            uint8_t blk[block_bytes(T)];
            for (int64_t b = 0; b < c.nb; b++) {
                stored_block<T>(c.w, c.rb, c.grouped, n, b, blk);
                if constexpr (block_values(T) == 32) acc = block32_step<T>(blk, a.q + b * 32, a.d[b], a.s ? a.s[b] : 0.f, acc);
                else acc = blockk_step<T>(blk, a, b, acc);
            }
            c.y[m * c.ldy + n] = c.bias ? acc + c.bias[n] : acc;
        }
}

}  // namespace
