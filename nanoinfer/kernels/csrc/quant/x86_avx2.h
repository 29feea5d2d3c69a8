// The AVX2 path (+FMA, F16C): kernels for the types avx2_has lists, each computing its
// portable dot's integers and float operations in the same order (quant/portable.h), so the
// bits agree. Functions carry a target attribute, so the file builds for any x86 CPU; the
// driver (quant_gemm.cpp) runs this path only where have_avx2() says the CPU has it.
#pragma once
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel.h"
#include "types.h"

namespace {

#define QG_AVX2 __attribute__((target("avx2,fma,f16c")))

QG_AVX2 inline float hsum8_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a[j] + a[j + 4]
    asm("" : "+x"(s));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // s0 + s2, s1 + s3
    asm("" : "+x"(s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return opaque(_mm_cvtss_f32(s));
}

// hsum4's tree: (a0 + a2) + (a1 + a3).
QG_AVX2 inline float hsum4_avx2(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    asm("" : "+x"(s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return opaque(_mm_cvtss_f32(s));
}

QG_AVX2 inline float f16_avx2(const uint8_t* p) { return _cvtsh_ss(rd16(p)); }

// 32 nibbles: the low ones of qs[0..15] in bytes 0..15, the high ones in bytes 16..31.
QG_AVX2 inline __m256i nibbles(const uint8_t* qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

// Byte j = 0xff where bit j of the little-endian u32 at p is set, else 0.
QG_AVX2 inline __m256i bit_bytes(const uint8_t* p) {
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(rd32(p))),
                                          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                             0x0303030303030303));
    return _mm256_cmpeq_epi8(_mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

// A 32-block's values as int8 in element order (as decode32).
template <int T>
QG_AVX2 inline __m256i load32(const uint8_t* b) {
    if constexpr (T == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    if constexpr (T == Q4_0) return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    if constexpr (T == Q4_1) return nibbles(b + 4);
    if constexpr (T == Q5_0)  // no high bit: nibble | 0xf0 = nibble - 16 as int8; high bit: nibble
        return _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bit_bytes(b + 2), _mm256_set1_epi8(char(0xf0))));
    if constexpr (T == Q5_1) return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bit_bytes(b + 4), _mm256_set1_epi8(16)));
}

// Outputs y[m0 .. m0 + R - 1, n .. n + C - 1] of a 32-block type: each weight block is decoded
// once for the R rows; C weight rows at once give a single activation row C independent
// chains of fused multiply-adds (one chain waits on the FMA latency). maddubs (u8 x s8 pairs
// to int16) cannot saturate: |w| <= 128 and |x| <= 127. (Computing the scales of 8 blocks at
// once, with the fp16 gathered into one vector, measured 10-15% slower than this.)
// A 32-block's scale d (broadcast) and, for Q4_1 and Q5_1, its min m in lane 0 (d and m side
// by side: one conversion).
template <int T>
QG_AVX2 inline void block_scales(const uint8_t* blk, __m256& dw, __m128& mw) {
    if constexpr (T == Q4_1 || T == Q5_1) {
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(rd32(blk))));
        dw = _mm256_broadcastss_ps(dm);
        mw = _mm_movehdup_ps(dm);
    } else {
        dw = _mm256_set1_ps(f16_avx2(blk));
        mw = _mm_setzero_ps();
    }
}

// A 32-block tile's start (x rows' values, scales and sums; zeroed accumulators, the mins in
// lane 0 of a vector: a float array here went through general registers, slowly) and end (the
// lanes summed in hsum8's tree, plus the mins, plus the bias), shared by the AVX2 and AVX-512 tiles.
template <int T, int R, int C>
QG_AVX2 inline void tile32_start(const Ctx& c, int64_t m0, const int8_t** xq, const float** xd, const float** xs,
                                 __m256 (&acc)[C][R], __m128 (&mins)[C][R]) {
    for (int i = 0; i < R; i++) {
        xq[i] = c.q + (m0 + i) * c.K;
        xd[i] = c.d + (m0 + i) * c.nb;
        xs[i] = T == Q4_1 || T == Q5_1 ? c.s + (m0 + i) * c.nb : nullptr;
        for (int j = 0; j < C; j++) {
            acc[j][i] = _mm256_setzero_ps();
            mins[j][i] = _mm_setzero_ps();
        }
    }
}

template <int T, int R, int C>
QG_AVX2 inline void tile32_store(const Ctx& c, int64_t n, int64_t m0, __m256 (&acc)[C][R], __m128 (&mins)[C][R]) {
    for (int j = 0; j < C; j++)
        for (int i = 0; i < R; i++) {
            float v = hsum8_avx2(acc[j][i]);
            if constexpr (T == Q4_1 || T == Q5_1) v = opaque(v + _mm_cvtss_f32(mins[j][i]));
            c.y[(m0 + i) * c.ldy + n + j] = c.bias ? v + c.bias[n + j] : v;
        }
}

template <int T, int R, int C, bool PF>
QG_AVX2 void tile32_avx2(const Ctx& c, int64_t n, int64_t m0) {
    constexpr int64_t size = block_bytes(T);
    constexpr bool has_min = T == Q4_1 || T == Q5_1, is_signed = !has_min;
    const uint8_t* w = c.w + n * c.rb;
    const int8_t* xq[R];
    const float *xd[R], *xs[R];
    __m256 acc[C][R];
    __m128 mins[C][R];
    tile32_start<T, R, C>(c, m0, xq, xd, xs, acc, mins);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < c.nb; b++) {
        __m256i xv[R];  // this block of each x row, its scale and (Q4_1, Q5_1) its sum: loaded once for the C rows
        __m256 xdb[R];
        __m128 xsb[R];
        for (int i = 0; i < R; i++) {
            xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + b * 32));
            xdb[i] = _mm256_broadcast_ss(xd[i] + b);
            if constexpr (has_min) xsb[i] = _mm_load_ss(xs[i] + b);
        }
        for (int j = 0; j < C; j++) {
            const uint8_t* blk = w + j * c.rb + b * size;
            if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch), _MM_HINT_T0);
            __m256 dw;
            __m128 mw;
            block_scales<T>(blk, dw, mw);
            const __m256i wv = load32<T>(blk);
            const __m256i aw = is_signed ? _mm256_sign_epi8(wv, wv) : wv;
            for (int i = 0; i < R; i++) {
                const __m256i xs8 = is_signed ? _mm256_sign_epi8(xv[i], wv) : xv[i];
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs8), ones);
                const __m256 scale = _mm256_mul_ps(dw, xdb[i]);
                acc[j][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc[j][i]);
                if constexpr (has_min) mins[j][i] = _mm_fmadd_ss(mw, xsb[i], mins[j][i]);
            }
        }
    }
    tile32_store<T, R, C>(c, n, m0, acc, mins);
}

// vpshufb patterns: Q6_K's int8 scales g, g + 1 each 8 times (g even).
alignas(16) const uint8_t kPairShuffle[8][16] = {
#define QG_PAIR(g) g, g, g, g, g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1
    {QG_PAIR(0)}, {QG_PAIR(2)}, {QG_PAIR(4)}, {QG_PAIR(6)}, {QG_PAIR(8)}, {QG_PAIR(10)}, {QG_PAIR(12)}, {QG_PAIR(14)},
#undef QG_PAIR
};

// vpshufb patterns: Q4_K's and Q5_K's int16 scale j (bytes 2j, 2j + 1) in every lane.
alignas(32) const uint8_t kScaleShuffle[8][32] = {
#define QG_SCALE(j) 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, \
    2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1
    {QG_SCALE(0), QG_SCALE(0)}, {QG_SCALE(1), QG_SCALE(1)}, {QG_SCALE(2), QG_SCALE(2)}, {QG_SCALE(3), QG_SCALE(3)},
    {QG_SCALE(4), QG_SCALE(4)}, {QG_SCALE(5), QG_SCALE(5)}, {QG_SCALE(6), QG_SCALE(6)}, {QG_SCALE(7), QG_SCALE(7)},
#undef QG_SCALE
};

// K-quants: per 256-block the exact integer sums of each lane (scales applied in integers),
// then one fused multiply-add per lane (and one for the 4 min lanes), as dotk_portable.
template <int T, int R, bool PF>
QG_AVX2 void tilek_avx2(const Ctx& c, int64_t n, int64_t m0) {
    constexpr int64_t S = block_bytes(T);
    const uint8_t* w = c.w + n * c.rb;
    const int8_t* xq[R];
    const float* xd[R];
    const int16_t* xb[R];
    __m256 acc[R];
    __m128 accm[R];
    for (int i = 0; i < R; i++) {
        xq[i] = c.q + (m0 + i) * c.K;
        xd[i] = c.d + (m0 + i) * c.nb;
        xb[i] = c.bs + (m0 + i) * c.nb * 16;
        acc[i] = _mm256_setzero_ps();
        accm[i] = _mm_setzero_ps();
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* blk = w + b * S;
        if constexpr (PF)  // a K-quant block spans 3-4 cache lines
            for (int64_t o = 0; o < S; o += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + o), _MM_HINT_T0);
        __m256i isum[R];
        for (int i = 0; i < R; i++) isum[i] = _mm256_setzero_si256();
        if constexpr (T == Q6_K) {
            const uint8_t *ql = blk, *qh = blk + 128;
            const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
            for (int h = 0; h < 2; h++) {
                const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
                const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
                const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
                __m256i q[4];
                q[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(hv, _mm256_set1_epi8(3)), 4));
                q[1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(hv, _mm256_set1_epi8(12)), 2));
                q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hv, _mm256_set1_epi8(48)));
                q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                       _mm256_srli_epi16(_mm256_and_si256(hv, _mm256_set1_epi8(char(192))), 2));
                for (int t = 0; t < 4; t++) {  // values 128h + 32t .. +31: scales 8h + 2t (first 16), 8h + 2t + 1
                    const __m256i scv = _mm256_cvtepi8_epi16(
                        _mm_shuffle_epi8(sc8, _mm_load_si128(reinterpret_cast<const __m128i*>(kPairShuffle[4 * h + t]))));
                    for (int i = 0; i < R; i++) {
                        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + b * QK + 128 * h + 32 * t));
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], xv), scv));
                    }
                }
            }
            // the -32 offset: - 32 * sum_g sc[g] * (sum of x over group g)
            const __m256i sc32 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_set1_epi16(-32));
            const float d = f16_avx2(blk + 208);
            for (int i = 0; i < R; i++) {
                const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[i] + b * 16));
                const __m256i t = _mm256_add_epi32(isum[i], _mm256_madd_epi16(sums, sc32));
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[i][b]), _mm256_cvtepi32_ps(t), acc[i]);
            }
        } else {
            // the 8 scales and 8 mins as int16 in one vector (kscales' unpacking on 32-bit
            // words); sub-block j's scale is picked out of it with one vpshufb
            uint32_t u[3];
            std::memcpy(u, blk + 4, 12);
            const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
            const __m256i sm16 = _mm256_cvtepu8_epi16(
                _mm_setr_epi32(int32_t(u[0] & m6), int32_t((u[2] & m4) | (((u[0] >> 6) & m2) << 4)), int32_t(u[1] & m6),
                               int32_t(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4))));
            const __m256i sc16 = _mm256_permute2x128_si256(sm16, sm16, 0x00);
            const __m128i mn16 = _mm256_extracti128_si256(sm16, 1);
            const uint8_t* qs = blk + (T == Q5_K ? 48 : 16);
            __m256i hb = _mm256_setzero_si256();
            if constexpr (T == Q5_K) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * c + h;
                    __m256i wv = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
                    if constexpr (T == Q5_K) {  // bit j of each qh byte: bit 0 after j shifts, moved to bit 4
                        wv = _mm256_or_si256(wv, _mm256_and_si256(_mm256_slli_epi16(hb, 4), _mm256_set1_epi8(16)));
                        hb = _mm256_srli_epi16(hb, 1);
                    }
                    const __m256i scv = _mm256_shuffle_epi8(
                        sc16, _mm256_load_si256(reinterpret_cast<const __m256i*>(kScaleShuffle[j])));
                    for (int i = 0; i < R; i++) {
                        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + b * QK + 32 * j));
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), scv));
                    }
                }
            }
            // d and dmin converted together; -(dmin * dx) is (-dmin) * dx exactly
            const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(rd32(blk))));
            const __m256 dv = _mm256_broadcastss_ps(dd);
            const __m128 ndmin = _mm_xor_ps(_mm_permute_ps(dd, 0x55), _mm_set1_ps(-0.0f));
            for (int i = 0; i < R; i++) {
                const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[i] + b * 16));
                const __m128 dx = _mm_broadcast_ss(xd[i] + b);
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set_m128(dx, dx)), _mm256_cvtepi32_ps(isum[i]), acc[i]);
                accm[i] = _mm_fmadd_ps(_mm_mul_ps(ndmin, dx), _mm_cvtepi32_ps(_mm_madd_epi16(mn16, sums)), accm[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        float v = hsum8_avx2(acc[i]);
        if constexpr (T != Q6_K) v = opaque(v + hsum4_avx2(accm[i]));
        c.y[(m0 + i) * c.ldy + n] = c.bias ? v + c.bias[n] : v;
    }
}

template <bool BF>
QG_AVX2 inline __m256 load8_16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

// F16 / BF16: 16 lanes (k mod 16) of fused multiply-adds per output, as dot16_portable.
template <bool BF, int R, bool PF>
QG_AVX2 void tile16_avx2(const Ctx& c, int64_t n, int64_t m0) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(c.w + n * c.rb);
    const int64_t K = c.K;
    const float* x[R];
    __m256 a0[R], a1[R];
    for (int i = 0; i < R; i++) {
        x[i] = c.x + (m0 + i) * K;
        a0[i] = a1[i] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (PF && k % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetch, _MM_HINT_T0);
        const __m256 w0 = load8_16<BF>(w + k), w1 = load8_16<BF>(w + k + 8);
        for (int i = 0; i < R; i++) {
            a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k), w0, a0[i]);
            a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k + 8), w1, a1[i]);
        }
    }
    if (k < K) {  // the tail, zero-padded to 16
        alignas(32) uint16_t wt[16] = {};
        alignas(32) float xt[16] = {};
        std::memcpy(wt, w + k, (K - k) * 2);
        const __m256 w0 = load8_16<BF>(wt), w1 = load8_16<BF>(wt + 8);
        for (int i = 0; i < R; i++) {
            std::memcpy(xt, x[i] + k, (K - k) * 4);
            a0[i] = _mm256_fmadd_ps(_mm256_load_ps(xt), w0, a0[i]);
            a1[i] = _mm256_fmadd_ps(_mm256_load_ps(xt + 8), w1, a1[i]);
        }
    }
    for (int i = 0; i < R; i++) {
        __m256 v = _mm256_add_ps(a0[i], a1[i]);
        asm("" : "+x"(v));
        const float r = hsum8_avx2(v);
        c.y[(m0 + i) * c.ldy + n] = c.bias ? r + c.bias[n] : r;
    }
}

template <int T, int R, bool PF>
QG_AVX2 void tile_avx2(const Ctx& c, int64_t n, int64_t m0) {
    if constexpr (T == F16 || T == BF16) tile16_avx2<T == BF16, R, PF>(c, n, m0);
    else if constexpr (T == Q4_K || T == Q5_K || T == Q6_K) tilek_avx2<T, R, PF>(c, n, m0);
    else tile32_avx2<T, R, 1, PF>(c, n, m0);
}

template <int T, bool PF>
QG_AVX2 void tiles_avx2(const Ctx& c, int64_t n, int64_t m0, int mt) {
    switch (mt) {
        case 4: tile_avx2<T, 4, PF>(c, n, m0); break;
        case 3: tile_avx2<T, 3, PF>(c, n, m0); break;
        case 2: tile_avx2<T, 2, PF>(c, n, m0); break;
        default: tile_avx2<T, 1, PF>(c, n, m0); break;
    }
}

// Outputs y[m0 .. m0 + mt - 1, n .. n + cols - 1] (cols 1 to 8). A single row of x takes 4
// weight rows at once (8 for Q8_0; measured best, streaming a model's weights from memory).
// Decode sizes prefetch (a template flag: the branch alone slowed the prefill tiles by 25%).
template <int T>
QG_AVX2 void rows_avx2(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if (!c.stream) {
        for (int j = 0; j < cols; j++) tiles_avx2<T, false>(c, n + j, m0, mt);
        return;
    }
    if constexpr (!(T == F16 || T == BF16 || T == Q4_K || T == Q5_K || T == Q6_K))
        if (mt == 1) {
            if (T == Q8_0 && cols == 8) return tile32_avx2<T, 1, 8, true>(c, n, m0);
            for (; cols >= 4; cols -= 4, n += 4) tile32_avx2<T, 1, 4, true>(c, n, m0);
            for (; cols >= 2; cols -= 2, n += 2) tile32_avx2<T, 1, 2, true>(c, n, m0);
        }
    for (int j = 0; j < cols; j++) tiles_avx2<T, true>(c, n + j, m0, mt);
}

// The 8-bit dot peak of one thread on this path (the roofline's denominator for block
// formats): `reps` rounds of 8 independent u8 x s8 multiply-add chains, as the kernels issue
// them (maddubs, madd to int32, add). Returns the integer operations done, 2 per product.
QG_AVX2 __attribute__((noinline)) int64_t dot_peak_avx2(int64_t reps) {
    __m256i a = _mm256_set1_epi8(1), acc[8], b[8];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 8; j++) {
        acc[j] = _mm256_setzero_si256();
        b[j] = _mm256_set1_epi8(char(j + 1));
    }
    for (int64_t r = 0; r < reps; r++) {
        asm("" : "+x"(a));  // a new operand each round: nothing is hoisted out of the loop
        for (int j = 0; j < 8; j++) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[j]), ones));
    }
    __m256i s = acc[0];
    for (int j = 1; j < 8; j++) s = _mm256_add_epi32(s, acc[j]);
    volatile int32_t sink = _mm256_extract_epi32(s, 0);
    (void)sink;
    return reps * 8 * 32 * 2;
}

// The types this path has kernels for; on this path any other type runs its portable dot.
constexpr bool avx2_has(int t) {
    return t == F16 || t == BF16 || t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K ||
           t == Q5_K || t == Q6_K;
}

// AVX2, FMA and F16C on the CPU, and the AVX state enabled by the OS (cpuid and xgetbv
// directly: compilers differ in the feature names __builtin_cpu_supports accepts).
bool have_avx2() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
        const unsigned need = bit_FMA | bit_OSXSAVE | bit_AVX | bit_F16C;
        if ((c & need) != need) return false;
        unsigned lo, hi;
        asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & 6) != 6) return false;  // SSE and AVX registers saved by the OS
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        return (b & bit_AVX2) != 0;
    }();
    return ok;
}

}  // namespace
