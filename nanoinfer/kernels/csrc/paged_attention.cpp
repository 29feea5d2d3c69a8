// Decode attention over a paged KV cache, for the CPU: one query token per sequence,
// keys and values read straight from their blocks (no gathered copy, no padding). A work
// item is the query heads of every kv head (or of one, where there are few) over one sequence,
// or over a run of a long one's blocks (merged after).
//
// Built at first use by nanoinfer/cpu_kernels.py (c++ -O3 -march=native -fopenmp) and
// called through ctypes; attention/paged.py's plain PyTorch path is the reference it
// is tested against, and what runs when no compiler is found.
//
// Layouts (all contiguous):
//   q, out    [T, H, D]             rows[b] is the row of sequence b's query
//   k, v      [blocks, block_size, Hkv, D]   one layer's cache (q8_0: D / 32 blocks of 34 bytes
//                                           per head, common.h's Q8)
//   tables    [B, width]            block ids of each sequence, in order
//   ctx       [B]                   keys each sequence attends over (its position + 1)
// Query head h reads kv head h / (H / Hkv) (grouped-query attention). window > 0 keeps
// only the last `window` keys (sliding window). Scores are q.k * scale, then, with softcap > 0,
// softcap * tanh(score / softcap) (Gemma 2's attention soft-capping).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "common.h"
#include "side_prefetch.h"
#include "team.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// The first token of [t, n) and how many follow it in the same block.
struct Run { int64_t slot, count; };
inline Run block_run(const int64_t* table, int64_t t, int64_t n, int64_t bs) {
    const int64_t blk = t / bs, end = (blk + 1) * bs < n ? (blk + 1) * bs : n;
    return {table[blk] * bs + t % bs, end - t};
}

template <typename T>
inline void prefetch_block(const T* cache, const int64_t* table, int64_t t, int64_t n, int64_t bs, int64_t row) {
    if (t >= n) return;
    const char* p = reinterpret_cast<const char*>(cache + table[t / bs] * bs * row);
    for (int64_t off = 0; off < bs * row * int64_t(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// fn(i, row) for each token t0 + i of [t0, t1) in cache order: row points at its [Hkv, D]
// keys (or values); the next block is prefetched while this one is read.
template <typename T, typename Fn>
inline void for_each_row(const T* cache, const int64_t* table, int64_t t0, int64_t t1, int64_t bs, int64_t row,
                         Fn fn) {
    for (int64_t t = t0; t < t1;) {
        const Run run = block_run(table, t, t1, bs);
        prefetch_block(cache, table, t + run.count, t1, bs, row);
        const T* p = cache + run.slot * row;
        for (int64_t j = 0; j < run.count; j++, p += row) fn(t - t0 + j, p);
        t += run.count;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// Values i .. i + 15 of a head's row (i a multiple of 16) as two vectors (half16 gives a with high
// 0, b with high 1): a float row as it is (a: 0-7, b: 8-15); a bf16 row through unpacking with
// zeros, one shuffle a vector and no shift (a: 0-3 and 8-11, b: 4-7 and 12-15). Each lane's sums
// are the same either way; only where a value sits differs, and the other operand (the query, the
// accumulators) is laid out alike (`lanes`).
inline __m256 half16(const float* r, int64_t i, int high) { return _mm256_loadu_ps(r + i + 8 * high); }
inline __m256 half16(const BF16* r, int64_t i, int high) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)), z = _mm256_setzero_si256();
    return _mm256_castsi256_ps(high ? _mm256_unpackhi_epi16(z, x) : _mm256_unpacklo_epi16(z, x));
}
// Scores and weighted values on 512-bit vectors, a head's values 32 at a time (half32, below),
// where the build has AVX-512 BW and VL and cpu_kernels.py asks for them (PA_WIDE_VECTORS: on
// Intel and AMD's Zen 5, where they were measured; elsewhere, Zen 4's halved 512-bit units
// included, the 256-bit code below). Against that code on a 2-vCPU Emerald Rapids Xeon (28
// layers' calls, bf16 cache at position 512, one row / four rows of one sequence): 12 query
// heads over 2 kv heads at D = 128 1.11x / 1.23x faster, 14 over 2 at D = 64 1.14x / 1.15x, 4 over
// 1 at D = 256 1.16x / 1.24x, 9 over 3 at D = 64 1.10x / 1.11x; decode at 2048 tokens, batch 4,
// Qwen2.5 1.5B 1.11-1.16x, Gemma 3 270M 1.06-1.10x (docs/benchmarks.md, the eighth Xeon section).
// On a 2-vCPU Zen 5 (family 26), builds alternating in one process, rows of one sequence at
// position 4096, bf16 cache, 1 / 4 / 8 rows: SmolLM2-135M 8.89 / 14.19 / 21.68 -> 7.62 / 11.41 /
// 16.85 ms, Gemma 3 270M 4.81 / 6.74 / 9.59 -> 4.51 / 6.28 / 8.44.
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(PA_WIDE_VECTORS)
#define PA_ZMM 1
// Values i .. i + 31 of a head's row (i a multiple of 32) as two vectors: a float row as it is (a:
// 0-15, b: 16-31); a bf16 row through unpacking with zeros (a: 0-3, 8-11, 16-19, 24-27; b: the
// other four of each eight), the 512-bit form of half16's order.
inline __m512 half32(const float* r, int64_t i, int high) { return _mm512_loadu_ps(r + i + 16 * high); }
inline __m512 half32(const BF16* r, int64_t i, int high) {
    const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(r + i)), z = _mm512_setzero_si512();
    return _mm512_castsi512_ps(high ? _mm512_unpackhi_epi16(z, x) : _mm512_unpacklo_epi16(z, x));
}
#else
#define PA_ZMM 0
#endif

// q8_0 rows: 8 int8 values of a block as floats, and a block's scale.
inline __m256 int8x8(const Q8* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float scale_of(const Q8* r, int64_t block) {
#if defined(__F16C__)
    uint16_t h;
    std::memcpy(&h, r + block * kQ8Bytes, 2);
    return _cvtsh_ss(h);  // (exact, as half_to_float)
#else
    return q8_scale(r, block);
#endif
}

// The 8 lane sums of a[0..7], as one vector (lane j: the sum of a[j]'s lanes).
inline __m256 hsum8x8(const __m256* a) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// q . one q8_0 row, as 8 lanes (summed by the caller): per block, the 32 products summed (4
// lanes of fused multiply-adds), then times the block's scale into the row's sum; the same order
// for every row and path.
template <int D>
inline __m256 row_dot(const __m256* q, const Q8* r) {
    __m256 x = _mm256_setzero_ps();
    for (int b = 0; b < D / kQ8Block; b++) {
        const Q8* qb = r + b * kQ8Bytes + 2;
        __m256 xb = _mm256_mul_ps(q[4 * b], int8x8(qb));
        for (int c = 1; c < 4; c++) xb = _mm256_fmadd_ps(q[4 * b + c], int8x8(qb + 8 * c), xb);
        x = _mm256_fmadd_ps(xb, _mm256_set1_ps(scale_of(r, b)), x);
    }
    return x;
}

// out[i] = q . q8_0 row i, for n rows `stride` values apart: eight rows at a time, reduced
// together (bf16 and fp32 rows: dots_heads).
template <int D>
inline void dots(const float* qh, const Q8* rows, int64_t stride, int64_t n, float* out) {
    __m256 q[D / 8];
    for (int c = 0; c < D / 8; c++) q[c] = _mm256_loadu_ps(qh + 8 * c);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = row_dot<D>(q, rows + (i + j) * stride);
        _mm256_storeu_ps(out + i, hsum8x8(a));
    }
    for (; i < n; i++) out[i] = hsum(row_dot<D>(q, rows + i * stride));
}

// The sums of four vectors' lanes, as `hsum8x8` adds them (((0+1)+(2+3))+((4+5)+(6+7))), so a
// row's score is the same in a group of four or eight.
inline __m128 hsum4x8(const __m256* a) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// A kv head's query heads go six, four or three at a time (for_head_groups). With 32 vector
// registers (AVX-512 VL; 256-bit vectors, or 512-bit ones with PA_ZMM) a group's scores take 4 keys
// and its weighted values 4 vectors at a time: 6 heads x 4 keys of sums, 4 keys' vectors and a query vector fit
// them (dots_heads). Against three heads at a time, on a 2-vCPU Zen 4 (bf16 cache, the calls of one
// layer): 12 query heads over 2 kv heads at D = 128 (Qwen2.5 1.5B) one row at position 513
// 1.05-1.09x, 4 rows 1.09-1.14x, a 512-row chunk ending at 2048 1.12x; 8 over 2 1.15-1.18x; 14 over
// 2 at D = 64 (six and one) 1.02-1.10x. With 16 (AVX2), groups of four or six take 2 keys and 16
// values at a time instead (12 sums, 2 keys' vectors and a query vector). Three heads keep 4 and 32
// (16 values at a time, 4 over 1 at D = 256 took 1.24x the time at 4 rows). Against groups of three
// there, on a 2-vCPU Xeon built with -mno-avx512f (28 layers' calls, bf16 cache, position 512): 12
// over 2 at D = 128 one row 1.19x, 4 rows 1.21-1.24x; 8 over 2 at D = 128 4 rows 1.15-1.16x; 4 over
// 1 at D = 256 (Gemma 3) one row 1.13-1.14x, 4 rows 1.17-1.21x.
#if defined(__AVX512VL__)
constexpr bool kWideHeads = true;
#else
constexpr bool kWideHeads = false;
#endif

// Whether a group of NG heads takes 2 keys and 16 values at a time (16 registers, four or six
// heads), not 4 and 32.
template <int NG>
constexpr bool kTightGroup = !kWideHeads && NG > 3;

// The vectors the scores and weighted values run on: 8 floats (a head's values 16 at a time,
// half16's two vectors) or, with PA_ZMM, 16 (32 at a time, half32's); fold: a score's lanes onto
// the 8 that hsum8x8 and its kin sum (the upper 8 added onto the lower 8).
#if PA_ZMM
struct Vec {
    using F = __m512;
    static constexpr int kLanes = 16;
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static F set1(const float* p) { return _mm512_set1_ps(*p); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    template <typename T>
    static F half(const T* r, int64_t i, int high) { return half32(r, i, high); }
    static __m256 fold(F v) {
        return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
};
#else
struct Vec {
    using F = __m256;
    static constexpr int kLanes = 8;
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static F set1(const float* p) { return _mm256_broadcast_ss(p); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    template <typename T>
    static F half(const T* r, int64_t i, int high) { return half16(r, i, high); }
    static __m256 fold(F v) { return v; }
};
#endif

// D values in natural order -> the order the scores and weighted values load T's rows in (Vec::half's;
// to: true) or back (false), in place. A bf16 chunk of 2L values (L = Vec::kLanes) unpacked with zeros
// puts value 8k + j (j < 4) in lane 4k + j of its first vector and 8k + 4 + j in lane 4k + j of its
// second; a float row is loaded as it lies.
template <typename T>
inline void lanes(float* x, int64_t D, bool to) {
    if constexpr (std::is_same_v<T, BF16>) {
        constexpr int L = Vec::kLanes;
        for (int64_t i = 0; i < D; i += 2 * L) {
            float v[2 * L];
            for (int k = 0; k < L / 4; k++)
                for (int j = 0; j < 4; j++) {
                    const int natural = 8 * k + j, loaded = 4 * k + j;
                    if (to) v[loaded] = x[i + natural], v[L + loaded] = x[i + natural + 4];
                    else v[natural] = x[i + loaded], v[natural + 4] = x[i + L + loaded];
                }
            std::memcpy(x + i, v, sizeof v);
        }
    } else {
        (void)x, (void)D, (void)to;
    }
}

// The sums of two vectors' lanes, in hsum8x8's order.
inline __m128 hsum2x8(const __m256* a) {
    const __m256 h = _mm256_hadd_ps(a[0], a[1]);
    const __m256 s = _mm256_hadd_ps(h, h);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of NG query heads (q, q + D, ..., in `lanes` order) over n rows of one kv head's keys,
// `stride` elements apart: out[g * out_step + i] = q_g . row i. R rows at a time (kGroupKeys) keep
// NG * R sums in flight; they are taken P rows a pass (all R where the registers hold NG * R sums,
// P rows' key vectors and a query vector), and in a pass each query vector is loaded once for its P
// products and each key vector once for the NG heads. (Keys one at a time, the compiler made the
// query a memory operand of every multiply-add, and the loads outnumbered them: this way, 12 query
// heads over 2 kv heads at D = 128 and 512 keys, a bf16 cache, 28 calls on a 2-vCPU Zen 4 took
// 0.85-0.87x the time for one row, 0.87-0.90x for four; built for AVX2, three heads and two keys a
// pass, 0.97-0.99x.) A score is one chain of multiply-adds per lane, in the order of its values,
// (Vec::fold) and hsum8x8's lane sum, whatever NG, R and P (a short last group recomputes its first
// row and drops it).
template <int NG>
constexpr int kGroupKeys = NG == 1 ? 8 : kTightGroup<NG> ? 2 : 4;
template <int NG, int R>
constexpr int kPassRows = kWideHeads || NG * R + R + 1 <= 16 ? R : NG * R + R / 2 + 1 <= 16 ? R / 2 : 1;

template <int D, int NG, typename T>
inline void dots_heads(const float* q, const T* rows, int64_t stride, int64_t n, float* out, int64_t out_step) {
    constexpr int R = kGroupKeys<NG>, P = kPassRows<NG, R>;
    for (int64_t i = 0; i < n; i += R) {
        const int64_t rn = std::min<int64_t>(R, n - i);
        __m256 a[NG][R];
        const T* r[R];
        for (int j = 0; j < R; j++) r[j] = rows + (i + (j < rn ? j : 0)) * stride;
        for (int j0 = 0; j0 < R; j0 += P) {
            typename Vec::F w[NG][P];
#pragma GCC unroll 16
            for (int c = 0; c < D; c += 2 * Vec::kLanes) {
                for (int half = 0; half < 2; half++) {  // the chunk's two vectors (half16's or half32's)
                    typename Vec::F k[P];
                    for (int j = 0; j < P; j++) k[j] = Vec::half(r[j0 + j], c, half);
                    for (int g = 0; g < NG; g++) {
                        typename Vec::F qv = Vec::load(q + g * D + c + Vec::kLanes * half);
                        asm("" : "+v"(qv));  // in a register: one load for the P products
                        for (int j = 0; j < P; j++)
                            w[g][j] = c + half == 0 ? Vec::mul(qv, k[j]) : Vec::fma(qv, k[j], w[g][j]);
                    }
                }
            }
            for (int g = 0; g < NG; g++)
                for (int j = 0; j < P; j++) a[g][j0 + j] = Vec::fold(w[g][j]);
        }
        for (int g = 0; g < NG; g++) {
            float* o = out + g * out_step + i;
            if (rn == R) {  // a full group: its R scores stored at once
                if constexpr (R == 8) _mm256_storeu_ps(o, hsum8x8(a[g]));
                else if constexpr (R == 4) _mm_storeu_ps(o, hsum4x8(a[g]));
                else _mm_storel_pi(reinterpret_cast<__m64*>(o), hsum2x8(a[g]));
                continue;
            }
            alignas(32) float sums[8];
            if constexpr (R == 8) _mm256_store_ps(sums, hsum8x8(a[g]));
            else if constexpr (R == 4) _mm_store_ps(sums, hsum4x8(a[g]));
            else _mm_store_ps(sums, hsum2x8(a[g]));
            for (int64_t j = 0; j < rn; j++) o[j] = sums[j];
        }
    }
}

// acc_g[d] += sum_i p_g[i] * row i's value d for NG heads (p_g = p + g * p_step, acc_g = acc + g *
// acc_step, both in `lanes` order), over n rows `stride` elements apart: C vectors of values at a
// time, each row's chunk loaded (and widened) once for the NG heads, the sums in registers.
template <int D, int NG, typename T>
inline void weighted_heads(const float* p, int64_t p_step, const T* rows, int64_t stride, int64_t n, float* acc,
                           int64_t acc_step) {
    // C vectors a pass: fewer where the registers are tight, or where 4 do not divide D (96 on 512 bits)
    constexpr int C = kTightGroup<NG> || D % (4 * Vec::kLanes) != 0 ? 2 : 4;
    for (int c = 0; c < D; c += Vec::kLanes * C) {
        typename Vec::F a[NG][C];
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < C; j++) a[g][j] = Vec::load(acc + g * acc_step + c + Vec::kLanes * j);
        for (int64_t i = 0; i < n; i++) {
            const T* r = rows + i * stride;
            typename Vec::F v[C];
            for (int j = 0; j < C; j += 2) v[j] = Vec::half(r, c + Vec::kLanes * j, 0), v[j + 1] = Vec::half(r, c + Vec::kLanes * j, 1);
            for (int g = 0; g < NG; g++) {
                const typename Vec::F w = Vec::set1(p + g * p_step + i);
                for (int j = 0; j < C; j++) a[g][j] = Vec::fma(w, v[j], a[g][j]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < C; j++) Vec::store(acc + g * acc_step + c + Vec::kLanes * j, a[g][j]);
    }
}

// Query heads [h0, h1), G to a kv head, in the groups that dots_heads and weighted_heads take:
// each kv head's heads six or four at a time, else three, then the rest.
// fn(std::integral_constant<int, NG>, h, hk) for each group of NG heads from h, of kv head hk.
template <typename Fn>
inline void for_head_groups(int64_t h0, int64_t h1, int64_t G, Fn fn) {
    for (int64_t h = h0; h < h1;) {
        const int64_t hk = h / G, left = std::min<int64_t>((hk + 1) * G, h1) - h;
        if (left >= 6) fn(std::integral_constant<int, 6>{}, h, hk), h += 6;
        else if (left >= 4) fn(std::integral_constant<int, 4>{}, h, hk), h += 4;
        else if (left >= 3) fn(std::integral_constant<int, 3>{}, h, hk), h += 3;
        else if (left == 2) fn(std::integral_constant<int, 2>{}, h, hk), h += 2;
        else fn(std::integral_constant<int, 1>{}, h, hk), h += 1;
    }
}

// The weighted values of query heads [h0, h1) (G to a kv head, kv head hk0 first) over n rows.
template <int D, typename T>
inline void weighted_all(const float* s, int64_t S, const T* rows, int64_t stride, int64_t step, int64_t n, int64_t h0,
                         int64_t h1, int64_t G, int64_t hk0, float* acc) {
    for_head_groups(h0, h1, G, [&](auto ng, int64_t h, int64_t hk) {
        weighted_heads<D, decltype(ng)::value>(s + h * S, S, rows + (hk - hk0) * step, stride, n, acc + h * D, D);
    });
}

// The scores of query heads [h0, h1), G to a kv head (kv head hk0 first), over n rows of keys.
template <int D, typename T>
inline void dots_all(const float* qf, const T* rows, int64_t stride, int64_t step, int64_t n, int64_t h0, int64_t h1,
                     int64_t G, int64_t hk0, float* s, int64_t S) {
    for_head_groups(h0, h1, G, [&](auto ng, int64_t h, int64_t hk) {
        dots_heads<D, decltype(ng)::value>(qf + h * D, rows + (hk - hk0) * step, stride, n, s + h * S, S);
    });
}

// acc[0..32 NB - 1] += sum_i p[i] * (values d0 .. d0 + 32 NB - 1 of q8_0 row i), NB blocks (1 or 2),
// in registers: each block's values times p[i] * d, the weight and scale in one factor (bf16 and
// fp32 rows: weighted_heads). Each value's sum is its own chain, whatever NB.
template <int NB>
inline void weighted_q8(const float* p, const Q8* rows, int64_t d0, int64_t stride, int64_t n, float* acc) {
    __m256 a[4 * NB];
    for (int c = 0; c < 4 * NB; c++) a[c] = _mm256_loadu_ps(acc + 8 * c);
    const int64_t b0 = d0 / kQ8Block;
    for (int64_t i = 0; i < n; i++) {
        const Q8* r = rows + i * stride;
        for (int b = 0; b < NB; b++) {
            const __m256 w = _mm256_set1_ps(p[i] * scale_of(r, b0 + b));
            const Q8* qb = r + (b0 + b) * kQ8Bytes + 2;
            for (int c = 0; c < 4; c++) a[4 * b + c] = _mm256_fmadd_ps(w, int8x8(qb + 8 * c), a[4 * b + c]);
        }
    }
    for (int c = 0; c < 4 * NB; c++) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// The next block's rows of the heads read (`span` elements from `head` in each token's row): only
// the lines that will be read, contiguous when every head is.
template <typename T>
inline void prefetch_heads(const T* cache, const int64_t* table, int64_t t, int64_t n, int64_t bs, int64_t row,
                           int64_t head, int64_t span) {
    if (t >= n) return;
    const char* p = reinterpret_cast<const char*>(cache + table[t / bs] * bs * row + head);
    const int64_t bytes = span * int64_t(sizeof(T)), step = row * int64_t(sizeof(T));
    if (span == row) {
        for (int64_t off = 0; off < bs * bytes; off += 64) __builtin_prefetch(p + off);
        return;
    }
    for (int64_t j = 0; j < bs; j++, p += step)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// fn(i, rows, count) for each run of consecutive tokens [t0 + i, t0 + i + count) in one block:
// rows points at the first one's [Hkv, D]; the next block's rows of the heads read are prefetched.
template <typename T, typename Fn>
inline void for_each_run(const T* cache, const int64_t* table, int64_t t0, int64_t t1, int64_t bs, int64_t row,
                         int64_t head, int64_t span, Fn fn) {
    for (int64_t t = t0; t < t1;) {
        const Run run = block_run(table, t, t1, bs);
        prefetch_heads(cache, table, t + run.count, t1, bs, row, head, span);
        fn(t - t0, cache + run.slot * row, run.count);
        t += run.count;
    }
}

// The largest of x[0..n), exactly (any order gives the same maximum).
inline float max_of(const float* x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float top = -INFINITY;
    for (float v : lanes) top = v > top ? v : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}
#endif

// One sequence's tokens [t0, t1), the query heads of kv heads [hk0, hk1). qf: [H, D] fp32,
// already scaled (the fast path reorders its heads in place). s: [H, t1 - t0] scratch. Out, per
// head h: m[h] the largest score, l[h] = sum of e^(score - m[h]), and acc[h * D ...] = sum of
// e^(score - m[h]) * value (not yet divided by l: the parts of a sequence split over threads are
// merged first). D_ > 0 fixes the head size at compile time. With AVX2 and D_ a multiple of 32,
// the sums stay in registers and each key and value chunk is loaded (and a bf16 one widened) once
// for all the query heads of its kv head (the portable loops kept the sums in memory: 1.5x slower
// at a 1000-token context). A head's sums are the same whichever range of kv heads it is
// computed with.
template <typename T, int D_>
void attend_part(float* qf, const T* k, const T* v, const int64_t* table, int64_t t0, int64_t t1,
                 int64_t bs, int64_t Hkv, int64_t hk0, int64_t hk1, int64_t G, int64_t D, float softcap, float* s,
                 float* acc, float* m, float* l) {
    if (D_ > 0) D = D_;
    const int64_t S = t1 - t0, hs = head_stride<T>(D), row = Hkv * hs;
    const int64_t h0 = hk0 * G, h1 = hk1 * G;
#if defined(__AVX2__) && defined(__FMA__)
    constexpr bool fast = D_ > 0 && D_ % 32 == 0;
    constexpr int DF = D_ > 0 ? D_ : 64;
#else
    constexpr bool fast = false;
#endif
    if constexpr (fast) {
#if defined(__AVX2__) && defined(__FMA__)
        for (int64_t h = h0; h < h1; h++) lanes<T>(qf + h * D, D, true);
        for_each_run(k, table, t0, t1, bs, row, hk0 * hs, (hk1 - hk0) * hs, [&](int64_t i, const T* rows, int64_t n) {
            if constexpr (std::is_same_v<T, Q8>) {
                for (int64_t h = h0; h < h1; h++) dots<DF>(qf + h * D, rows + h / G * hs, row, n, s + h * S + i);
            } else {
                dots_all<DF>(qf, rows + hk0 * hs, row, hs, n, h0, h1, G, hk0, s + i, S);
            }
        });
#endif
    } else {
        for_each_row(k, table, t0, t1, bs, row, [&](int64_t i, const T* kp) {  // scores
            for (int64_t h = h0; h < h1; h++) {
                const float* qh = qf + h * D;
                const T* kh = kp + h / G * hs;
                float a = 0.f;
                for (int64_t d = 0; d < D; d++) a += qh[d] * load(kh, d);
                s[h * S + i] = a;
            }
        });
    }
    for (int64_t h = h0; h < h1; h++) {
        float* sh = s + h * S;
        float mh = -INFINITY, lh = 0.f;
        if (softcap > 0.f)
            for (int64_t i = 0; i < S; i++) sh[i] = soft_cap(sh[i], softcap);
#if defined(__AVX2__) && defined(__FMA__)
        mh = max_of(sh, S);
#else
        for (int64_t i = 0; i < S; i++) mh = sh[i] > mh ? sh[i] : mh;
#endif
        for (int64_t i = 0; i < S; i++) sh[i] = exp_nonpositive(sh[i] - mh);
        for (int64_t i = 0; i < S; i++) lh += sh[i];
        m[h] = mh;
        l[h] = lh;
        for (int64_t d = 0; d < D; d++) acc[h * D + d] = 0.f;
    }
    if constexpr (fast) {
#if defined(__AVX2__) && defined(__FMA__)
        for_each_run(v, table, t0, t1, bs, row, hk0 * hs, (hk1 - hk0) * hs, [&](int64_t i, const T* rows, int64_t n) {
            if constexpr (std::is_same_v<T, Q8>) {
                for (int64_t h = h0; h < h1; h++) {
                    int64_t d0 = 0;
                    const float* p = s + h * S + i;
                    const Q8* r = rows + h / G * hs;
                    for (; d0 + 64 <= D; d0 += 64) weighted_q8<2>(p, r, d0, row, n, acc + h * D + d0);
                    if (d0 < D) weighted_q8<1>(p, r, d0, row, n, acc + h * D + d0);  // head size 96, ...: the last 32
                }
            } else {
                weighted_all<DF>(s + i, S, rows + hk0 * hs, row, hs, n, h0, h1, G, hk0, acc);
            }
        });
        for (int64_t h = h0; h < h1; h++) lanes<T>(acc + h * D, D, false);
#endif
    } else {
        for_each_row(v, table, t0, t1, bs, row, [&](int64_t i, const T* vp) {  // weighted values
            for (int64_t h = h0; h < h1; h++) {
                const float p = s[h * S + i];
                const T* vh = vp + h / G * hs;
                float* ah = acc + h * D;
                for (int64_t d = 0; d < D; d++) ah[d] += p * load(vh, d);
            }
        });
    }
}

// The first key sequence b attends to (the last `window` of its ctx[b] with a sliding window).
inline int64_t first_key(const int64_t* ctx, int64_t window, int64_t b) {
    return window > 0 && ctx[b] > window ? ctx[b] - window : 0;
}

constexpr int64_t kMaxParts = 64;
constexpr int64_t kPartTokens = 256;  // a sequence is split into runs of about this many keys

// Work units are runs of a sequence's blocks (flash-decoding's split), so that a long
// batch-1 decode uses every core. How a sequence is split depends on its own length only,
// never on the batch or the thread count, and every sequence goes through the same merge:
// a row's output is bit-identical alone and in any batch.
int64_t paged_attention_plan(const int64_t* ctx, int64_t B, int64_t window, int64_t* offset) {
    offset[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = ctx[b], start = first_key(ctx, window, b);
        const int64_t parts = std::min<int64_t>(kMaxParts, std::max<int64_t>(1, (n - start + kPartTokens - 1) / kPartTokens));
        offset[b + 1] = offset[b] + parts;
    }
    return offset[B];
}

// Sequence b of work unit u (units from paged_attention_plan's `offset`) and the tokens
// [t0, t1) it covers (empty where a short sequence has more parts than blocks).
inline void unit_tokens(const int64_t* offset, int64_t B, const int64_t* ctx, int64_t window, int64_t bs, int64_t u,
                        int64_t& b, int64_t& t0, int64_t& t1) {
    b = std::upper_bound(offset, offset + B + 1, u) - offset - 1;
    const int64_t part = u - offset[b], parts = offset[b + 1] - offset[b];
    const int64_t n = ctx[b], start = first_key(ctx, window, b);
    const int64_t first = start / bs, blocks = (n + bs - 1) / bs - first, per = (blocks + parts - 1) / parts;
    t0 = std::max(start, (first + part * per) * bs);
    t1 = std::min(n, (first + (part + 1) * per) * bs);
}

// The calling thread's number in its team, and the team's size.
struct TeamPosition { int64_t tid, threads; };
inline TeamPosition team_position() {
#ifdef _OPENMP
    return {omp_get_thread_num(), omp_get_num_threads()};
#else
    return {0, 1};
#endif
}

// Work items per unit: 1 (all kv heads), or one per kv head where there are too few units to
// keep every thread busy (a short batch-1 decode).
inline int64_t items_per_unit(int64_t units, int64_t Hkv, int64_t threads) { return units >= 2 * threads ? 1 : Hkv; }

// Whether row b reads the blocks row b - 1 reads, from its first on, in as many parts: the rows of
// one sequence in one step (speculation's guesses), or sequences that share a prompt's blocks.
inline bool shares_blocks(const int64_t* offset, const int64_t* tables, int64_t width, const int64_t* ctx,
                          int64_t window, int64_t bs, int64_t b) {
    if (b == 0 || offset[b + 1] - offset[b] != offset[b] - offset[b - 1]) return false;
    return tables[b * width + first_key(ctx, window, b) / bs] ==
           tables[(b - 1) * width + first_key(ctx, window, b - 1) / bs];
}

// fn(item) for each work item (of total * split; item i is unit i / split) that thread `tid` of
// `threads` computes. Which thread computes an item never changes a bit of it. Runs of rows that
// share blocks have their units taken part by part across the rows, and each thread takes a
// contiguous stretch of them: a part's keys and values come from memory once, and from the
// thread's caches for the run's other rows. (Round robin, the 4 rows of one sequence at 2048
// keys read them from memory 4 times: 12 query heads over 2 kv heads at D = 128 on a 2-vCPU Zen 4,
// a 4-row call took 0.82-0.83x the time this way.) Other units go round the threads one by one
// (a long single row's parts alternately: contiguous halves of it ran 1.11x slower there).
template <typename Fn>
void for_thread_items(const int64_t* offset, const int64_t* tables, int64_t width, const int64_t* ctx, int64_t B,
                      int64_t window, int64_t bs, int64_t split, int64_t tid, int64_t threads, Fn fn) {
    if (split > 1) {
        for (int64_t item = tid; item < offset[B] * split; item += threads) fn(item);
        return;
    }
    const auto run_end = [&](int64_t b0) {
        int64_t b1 = b0 + 1;
        while (b1 < B && shares_blocks(offset, tables, width, ctx, window, bs, b1)) b1++;
        return b1;
    };
    int64_t shared = 0;  // units in runs of two or more rows
    for (int64_t b0 = 0, b1; b0 < B; b0 = b1)
        if ((b1 = run_end(b0)) - b0 > 1) shared += offset[b1] - offset[b0];
    const int64_t lo = shared * tid / threads, hi = shared * (tid + 1) / threads;
    int64_t pos = 0, single = 0;
    for (int64_t b0 = 0, b1; b0 < B; b0 = b1) {
        b1 = run_end(b0);
        const int64_t parts = offset[b0 + 1] - offset[b0];
        if (b1 - b0 > 1) {
            for (int64_t p = 0; p < parts; p++)
                for (int64_t b = b0; b < b1; b++, pos++)
                    if (pos >= lo && pos < hi) fn(offset[b] + p);
        } else {
            for (int64_t p = 0; p < parts; p++, single++)
                if (single % threads == tid) fn(offset[b0] + p);
        }
    }
}

// The body of paged_decode, run by every thread of a team: units from paged_attention_plan
// (`offset`), `units` room for offset[B] * H * (D + 2) floats, `s` this thread's room for
// H * (max_ctx + D) floats. Ends with the team's barrier. Never inlined: the C entry points
// and the decoder stack run this one body, so they compute the same bits.
template <typename TQ, typename TKV>
__attribute__((noinline)) void paged_decode_team(const TQ* q, const int64_t* rows, const TKV* k, const TKV* v, const int64_t* tables,
                       int64_t width, const int64_t* ctx, TQ* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                       int64_t bs, int64_t window, int64_t max_ctx, float scale, float softcap,
                       const int64_t* offset, float* units, float* s) {
    const int64_t G = H / Hkv;
    const int64_t unit_size = H * (D + 2);  // a part's acc [H, D], m [H], l [H], kept for the merge
    const int64_t total = offset[B];
    float* qf = s + H * max_ctx;
    // A work item: one unit's query heads of all the kv heads, reading each token's keys and values
    // whole (a kv head's alone is a third of a row's lines or less, and the lines between are
    // fetched all the same); of one kv head where there are too few units (items_per_unit). Each
    // head's sums are the same whichever item computes them. Items go to the threads as
    // for_thread_items says, so the decoder stack knows which thread reads which rows (side_prefetch.h).
    const auto [tid, threads] = team_position();
    const int64_t split = items_per_unit(total, Hkv, threads), per_item = Hkv / split;
    for_thread_items(offset, tables, width, ctx, B, window, bs, split, tid, threads, [&](int64_t item) {
        const int64_t u = item / split, hk0 = item % split * per_item, hk1 = hk0 + per_item;
        int64_t b, t0, t1;
        unit_tokens(offset, B, ctx, window, bs, u, b, t0, t1);
        float* acc = units + u * unit_size;
        float *m = acc + H * D, *l = m + H;
        if (t0 >= t1) {  // more parts than blocks: this one is empty
            for (int64_t i = hk0 * G * D; i < hk1 * G * D; i++) acc[i] = 0.f;
            for (int64_t h = hk0 * G; h < hk1 * G; h++) m[h] = -INFINITY, l[h] = 0.f;
            return;
        }
        const TQ* qb = q + rows[b] * H * D;
        for (int64_t i = hk0 * G * D; i < hk1 * G * D; i++) qf[i] = load(qb, i) * scale;
        const int64_t* table = tables + b * width;
        if (D == 64)
            attend_part<TKV, 64>(qf, k, v, table, t0, t1, bs, Hkv, hk0, hk1, G, D, softcap, s, acc, m, l);
        else if (D == 96)  // Phi-3 mini
            attend_part<TKV, 96>(qf, k, v, table, t0, t1, bs, Hkv, hk0, hk1, G, D, softcap, s, acc, m, l);
        else if (D == 128)
            attend_part<TKV, 128>(qf, k, v, table, t0, t1, bs, Hkv, hk0, hk1, G, D, softcap, s, acc, m, l);
        else if (D == 256)
            attend_part<TKV, 256>(qf, k, v, table, t0, t1, bs, Hkv, hk0, hk1, G, D, softcap, s, acc, m, l);
        else
            attend_part<TKV, 0>(qf, k, v, table, t0, t1, bs, Hkv, hk0, hk1, G, D, softcap, s, acc, m, l);
    });
#pragma omp barrier
    // merge each sequence's parts: rescale to the largest max, then divide by the total
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        TQ* ob = out + rows[b] * H * D;
        const float* first_unit = units + offset[b] * unit_size;
        const int64_t parts = offset[b + 1] - offset[b];
        for (int64_t h = 0; h < H; h++) {
            float top = -INFINITY, total_l = 0.f, w[kMaxParts];
            for (int64_t p = 0; p < parts; p++) top = std::max(top, first_unit[p * unit_size + H * D + h]);
            for (int64_t p = 0; p < parts; p++) {
                const float* unit = first_unit + p * unit_size;
                const float lp = unit[H * D + H + h];
                w[p] = lp > 0.f ? exp_nonpositive(unit[H * D + h] - top) : 0.f;
                total_l += lp * w[p];
            }
            for (int64_t d = 0; d < D; d++) {
                float o = 0.f;
                for (int64_t p = 0; p < parts; p++) o += w[p] * first_unit[p * unit_size + h * D + d];
                store(ob, h * D + d, o / total_l);
            }
        }
    }
}

// Returns 0, or 1 if the scratch could not be allocated (nothing is then written).
template <typename TQ, typename TKV>
int paged_decode(const TQ* q, const int64_t* rows, const TKV* k, const TKV* v, const int64_t* tables, int64_t width,
                 const int64_t* ctx, TQ* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                 int64_t window, int64_t max_ctx, float scale, float softcap) {
    int64_t* offset = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (B + 1)));
    if (offset == nullptr) return 1;
    const int64_t total = paged_attention_plan(ctx, B, window, offset);
    float* units = static_cast<float*>(std::malloc(sizeof(float) * total * H * (D + 2)));
    if (units == nullptr) {
        std::free(offset);
        return 1;
    }
    int failed = 0;
#pragma omp parallel
    {
        float* s = static_cast<float*>(std::malloc(sizeof(float) * H * (max_ctx + D)));
        if (s == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed)
            paged_decode_team(q, rows, k, v, tables, width, ctx, out, B, H, Hkv, D, bs, window, max_ctx, scale,
                              softcap, offset, units, s);
        std::free(s);
    }
    std::free(offset), std::free(units);
    return failed;
}

}  // namespace

namespace nanoinfer {

int64_t attention_plan(const int64_t* ctx, int64_t B, int64_t window, int64_t* offset) {
    return paged_attention_plan(ctx, B, window, offset);
}

void attention_side_prefetch(const void* k, const void* v, int kv_format, const int64_t* tables, int64_t width,
                             const int64_t* ctx, int64_t B, int64_t Hkv, int64_t D, int64_t bs, int64_t window,
                             const int64_t* offset) {
    SidePrefetch& side = side_prefetch();
    side.clear();
    const auto [tid, threads] = team_position();
    const int64_t split = items_per_unit(offset[B], Hkv, threads);
    const int64_t row = kv_format == KV_Q8_0 ? Hkv * head_stride<Q8>(D) * int64_t(sizeof(Q8))
                                             : Hkv * D * (kv_format == KV_BF16 ? 2 : 4);
    int64_t last = -1;  // the unit before
    for_thread_items(offset, tables, width, ctx, B, window, bs, split, tid, threads, [&](int64_t item) {
        if (item % split) return;  // a unit split by kv head: its first item's thread fetches its rows
        const int64_t u = item / split, before = last;
        last = u;
        int64_t b, t0, t1;
        unit_tokens(offset, B, ctx, window, bs, u, b, t0, t1);
        const int64_t* table = tables + b * width;
        // the same part of the row before fetched these blocks already, if they are the same ones
        if (before >= 0 && t0 < t1 && shares_blocks(offset, tables, width, ctx, window, bs, b) &&
            u - before == offset[b] - offset[b - 1] &&
            std::equal(table + t0 / bs, table + (t1 - 1) / bs + 1, table - width + t0 / bs))
            return;
        for (const void* cache : {k, v})  // the order the item reads them
            for (int64_t t = t0; t < t1;) {
                const int64_t end = std::min(t1, (t / bs + 1) * bs);
                side.add(static_cast<const char*>(cache) + (table[t / bs] * bs + t % bs) * row, (end - t) * row);
                t = end;
            }
    });
}

void attention_team_f32(const float* q, const int64_t* rows, const void* k, const void* v, int kv_format,
                              const int64_t* tables, int64_t width, const int64_t* ctx, float* out, int64_t B,
                              int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t window, int64_t max_ctx,
                              float scale, float softcap, const int64_t* offset, float* units, float* s) {
    if (kv_format == KV_Q8_0)
        paged_decode_team(q, rows, static_cast<const Q8*>(k), static_cast<const Q8*>(v), tables, width, ctx, out, B,
                          H, Hkv, D, bs, window, max_ctx, scale, softcap, offset, units, s);
    else if (kv_format == KV_BF16)
        paged_decode_team(q, rows, static_cast<const BF16*>(k), static_cast<const BF16*>(v), tables, width, ctx, out, B,
                          H, Hkv, D, bs, window, max_ctx, scale, softcap, offset, units, s);
    else
        paged_decode_team(q, rows, static_cast<const float*>(k), static_cast<const float*>(v), tables, width, ctx, out,
                          B, H, Hkv, D, bs, window, max_ctx, scale, softcap, offset, units, s);
}

}  // namespace nanoinfer

#define ENTRY(NAME, TQ, TKV)                                                                                \
    extern "C" int NAME(const TQ* q, const int64_t* rows, const TKV* k, const TKV* v, const int64_t* tables, \
                        int64_t width, const int64_t* ctx, TQ* out, int64_t B, int64_t H, int64_t Hkv,      \
                        int64_t D, int64_t bs, int64_t window, int64_t max_ctx, float scale,               \
                        float softcap) {                                                                   \
        return paged_decode<TQ, TKV>(q, rows, k, v, tables, width, ctx, out, B, H, Hkv, D, bs, window,      \
                                     max_ctx, scale, softcap);                                             \
    }
ENTRY(paged_decode_f32, float, float)
ENTRY(paged_decode_bf16, BF16, BF16)
ENTRY(paged_decode_f32_bf16kv, float, BF16)  // fp32 activations over a bf16 cache (the quantised path)
ENTRY(paged_decode_f32_q8kv, float, Q8)      // fp32 activations over a q8_0 cache

// rows [n, D] fp32 -> their q8_0 blocks [n, D / 32 * 34] (attention/kv_cache.py's format), each
// rotated first by blocks of `rot` values (0: not rotated).
extern "C" void kv_quantize_q8(const float* x, int64_t n, int64_t D, uint8_t* out, int64_t rot) {
    for (int64_t r = 0; r < n; r++)
        q8_store_head(x + r * D, D, reinterpret_cast<Q8*>(out) + r * head_stride<Q8>(D), rot);
}

// rows [n, D] fp32 rotated in place by blocks of `rot` values (common.h's hadamard_blocks).
extern "C" void kv_rotate(float* x, int64_t n, int64_t D, int64_t rot) {
    for (int64_t r = 0; r < n; r++) hadamard_blocks(x + r * D, D, rot);
}
