// The AVX-512 path (F, BW, VL and VNNI): kernels for the types avx512_has lists; on this path
// the driver runs the AVX2 kernel of any other type that has one (quant/x86_avx2.h, which this
// file builds on), else its portable dot. Target attributes again, so it builds anywhere x86.
#pragma once
#include <cstdint>
#include <type_traits>

#include "kernel.h"
#include "types.h"
#include "x86_avx2.h"

#if defined(QG_EMULATE_AVX512)  // the AVX-512 path through SIMDe's portable intrinsics (tests)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
// Debian 12's SIMDe (0.7.4~rc2) defines this alias with the masked form's four arguments, and
// has no _mm512_cvtepi32_ps: it is made of two 256-bit conversions (each lane rounded alike).
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#define _mm512_cvtepi32_ps(i) qg_emulated_cvtepi32_ps(i)
inline __m512 qg_emulated_cvtepi32_ps(__m512i i) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm512_castsi512_si256(i)), hi = _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(i, 1));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
#define _mm512_srai_epi32(a, k) qg_emulated_srai_epi32(a, k)
inline __m512i qg_emulated_srai_epi32(__m512i a, int k) {
    const __m256i lo = _mm256_srai_epi32(_mm512_castsi512_si256(a), k), hi = _mm256_srai_epi32(_mm512_extracti64x4_epi64(a, 1), k);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#endif

namespace {

// Built with -DQG_EMULATE_AVX512 (and SIMDe's headers) the same code runs on any x86 CPU
// through SIMDe's portable intrinsics: how the tests check it on CPUs without AVX-512.
#if defined(QG_EMULATE_AVX512)
#define QG_AVX512 QG_AVX2
#else
#define QG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

// v kept in a register from here on (an optimiser barrier: its sum is not regrouped or moved).
// Emulated, a 512-bit vector is SIMDe's 64-byte struct, which no register holds: kept in memory.
template <typename V>
QG_AVX512 inline void pin(V& v) {
#if defined(QG_EMULATE_AVX512)
    if constexpr (sizeof(V) == 64) {
        asm("" : "+m"(v));
        return;
    }
#endif
    asm("" : "+v"(v));
}

// G repacked groups side by side, a 32-bit lane an output: 8 outputs on 256-bit vectors (G = 1),
// 16 on 512-bit ones (G = 2: the group at row n in the low half, n + 8 in the high half), and
// the few operations the kernels below need on either.
template <int G>
using VecI = std::conditional_t<G == 1, __m256i, __m512i>;
template <int G>
using VecF = std::conditional_t<G == 1, __m256, __m512>;

template <int G>
QG_AVX512 inline VecI<G> join(const __m256i* p) {
    if constexpr (G == 1) return p[0];
    else return _mm512_inserti64x4(_mm512_castsi256_si512(p[0]), p[1], 1);
}
template <int G>
QG_AVX512 inline VecF<G> join(const __m256* p) {
    if constexpr (G == 1) return p[0];
    else return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(p[0])), _mm256_castps_si256(p[1]), 1));
}
// the 32 bytes at offset `at` of each group's block
template <int G>
QG_AVX512 inline VecI<G> load_groups(const uint8_t* const* gb, int at) {
    __m256i p[G];
    for (int k = 0; k < G; k++) p[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb[k] + at));
    return join<G>(p);
}
template <int G>
QG_AVX512 inline VecI<G> bytes_of(char v) {
    if constexpr (G == 1) return _mm256_set1_epi8(v);
    else return _mm512_set1_epi8(v);
}
QG_AVX512 inline __m256i v_and(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
QG_AVX512 inline __m512i v_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
QG_AVX512 inline __m256i v_or(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
QG_AVX512 inline __m512i v_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
QG_AVX512 inline __m256i v_srli16(__m256i a, int k) { return _mm256_srli_epi16(a, k); }
QG_AVX512 inline __m512i v_srli16(__m512i a, int k) { return _mm512_srli_epi16(a, k); }
QG_AVX512 inline __m256i v_slli16(__m256i a, int k) { return _mm256_slli_epi16(a, k); }
QG_AVX512 inline __m512i v_slli16(__m512i a, int k) { return _mm512_slli_epi16(a, k); }
QG_AVX512 inline __m256i v_add(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
QG_AVX512 inline __m512i v_add(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
QG_AVX512 inline __m256i v_sub(__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }
QG_AVX512 inline __m512i v_sub(__m512i a, __m512i b) { return _mm512_sub_epi32(a, b); }
QG_AVX512 inline __m256i v_mullo(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
QG_AVX512 inline __m512i v_mullo(__m512i a, __m512i b) { return _mm512_mullo_epi32(a, b); }
// The int16 pairs of w times the int16 pair at x (broadcast), each lane's two products summed.
QG_AVX512 inline __m256i v_madd16(__m256i w, const int16_t* x) { return _mm256_madd_epi16(w, bcast4(reinterpret_cast<const int8_t*>(x))); }
QG_AVX512 inline __m512i v_madd16(__m512i w, const int16_t* x) {
    return _mm512_madd_epi16(w, _mm512_set1_epi32(int32_t(rd32(reinterpret_cast<const uint8_t*>(x)))));
}
// acc + the 4 products u8 x s8 of each 32-bit lane, 4 activation values at x in every lane.
// Natively one instruction, the 4 values broadcast from memory inside vpdpbusd ({1to8}): GCC 12
// emits a separate broadcast for the intrinsics, a quarter of a K-quant tile's instructions
// (a 4-row Q4_K tile 15% faster on a Zen 4 without them).
#if !defined(QG_EMULATE_AVX512)
QG_AVX512 inline __m256i v_dot4(__m256i acc, __m256i w, const int8_t* x) {
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
}
QG_AVX512 inline __m512i v_dot4(__m512i acc, __m512i w, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
}
#else
QG_AVX512 inline __m256i v_dot4(__m256i acc, __m256i w, const int8_t* x) { return _mm256_dpbusd_epi32(acc, w, bcast4(x)); }
QG_AVX512 inline __m512i v_dot4(__m512i acc, __m512i w, const int8_t* x) {
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(int32_t(rd32(reinterpret_cast<const uint8_t*>(x)))));
}
#endif
// acc + (a * the float at s) * the lanes of i as floats; acc - ... (fnmadd)
QG_AVX512 inline __m256 v_fma(__m256 acc, __m256 a, const float* s, __m256i i) {
    return _mm256_fmadd_ps(_mm256_mul_ps(a, _mm256_broadcast_ss(s)), _mm256_cvtepi32_ps(i), acc);
}
QG_AVX512 inline __m512 v_fma(__m512 acc, __m512 a, const float* s, __m512i i) {
    return _mm512_fmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(*s)), _mm512_cvtepi32_ps(i), acc);
}
QG_AVX512 inline __m256 v_fnma(__m256 acc, __m256 a, const float* s, __m256i i) {
    return _mm256_fnmadd_ps(_mm256_mul_ps(a, _mm256_broadcast_ss(s)), _mm256_cvtepi32_ps(i), acc);
}
QG_AVX512 inline __m512 v_fnma(__m512 acc, __m512 a, const float* s, __m512i i) {
    return _mm512_fnmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(*s)), _mm512_cvtepi32_ps(i), acc);
}
QG_AVX512 inline __m256i v_xor(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
QG_AVX512 inline __m512i v_xor(__m512i a, __m512i b) { return _mm512_xor_si512(a, b); }
// v in every lane, as the type of `like`
QG_AVX512 inline __m256i v_set1(int32_t v, __m256i) { return _mm256_set1_epi32(v); }
QG_AVX512 inline __m512i v_set1(int32_t v, __m512i) { return _mm512_set1_epi32(v); }
// acc + a * the float at s
QG_AVX512 inline __m256 v_fma_s(__m256 acc, __m256 a, const float* s) { return _mm256_fmadd_ps(a, _mm256_broadcast_ss(s), acc); }
QG_AVX512 inline __m512 v_fma_s(__m512 acc, __m512 a, const float* s) { return _mm512_fmadd_ps(a, _mm512_set1_ps(*s), acc); }
// the 8 fp16 at offset `at` of each group's block, as fp32
template <int G>
QG_AVX512 inline VecF<G> halves_of(const uint8_t* const* gb, int at) {
    __m256 p[G];
    for (int k = 0; k < G; k++) p[k] = load8_half(gb[k] + at);
    return join<G>(p);
}

// k_weights and q6_weights for G groups at once.
// Q4_K's and Q5_K's 4 low bits of sub-block j's values from their bytes q (j odd: the high
// nibbles), and Q5_K's fifth bit (bit j of its qh bytes h) at bit 4.
template <int G>
QG_AVX512 inline VecI<G> k_nibbles(VecI<G> q, int j) { return v_and(j & 1 ? v_srli16(q, 4) : q, bytes_of<G>(15)); }
template <int G>
QG_AVX512 inline VecI<G> q5_fifth_bits(VecI<G> h, int j) {
    return v_and(j < 4 ? v_slli16(h, 4 - j) : v_srli16(h, j - 4), bytes_of<G>(16));
}
template <int T, int G>
QG_AVX512 inline VecI<G> k_weights_of(const uint8_t* const* gb, int j, int v) {
    using L = PackedK<T>;
    const VecI<G> wv = k_nibbles<G>(load_groups<G>(gb, L::qs + 32 * (8 * (j / 2) + v)), j);
    if constexpr (T == Q5_K) return v_or(wv, q5_fifth_bits<G>(load_groups<G>(gb, L::qh + 32 * v), j));
    return wv;
}
// Q6_K's 6-bit values from a vector's bytes c = t < 3 (their low 6 bits: values t), and the fourth
// values (t = 3) from the top 2 bits of the three (q6_group_byte's layout).
template <int G>
QG_AVX512 inline VecI<G> q6_low_values(VecI<G> c) { return v_and(c, bytes_of<G>(63)); }
template <int G>
QG_AVX512 inline VecI<G> q6_fourth_values(VecI<G> c0, VecI<G> c1, VecI<G> c2) {
    const VecI<G> b01 = v_and(v_srli16(c0, 6), bytes_of<G>(3));
    const VecI<G> b23 = v_and(v_srli16(c1, 4), bytes_of<G>(12));
    const VecI<G> b45 = v_and(v_srli16(c2, 2), bytes_of<G>(48));
    return v_or(v_or(b01, b23), b45);
}
template <int G>
QG_AVX512 inline VecI<G> q6_weights_of(const uint8_t* const* gb, int h, int t, int v) {
    if (t < 3) return q6_low_values<G>(load_groups<G>(gb, q6_vector(h, v, t)));
    return q6_fourth_values<G>(load_groups<G>(gb, q6_vector(h, v, 0)), load_groups<G>(gb, q6_vector(h, v, 1)),
                               load_groups<G>(gb, q6_vector(h, v, 2)));
}

// Q6_K's offsets of groups g and g + 1 (at p), each in every lane of a 256-bit vector, from one
// load: the pair broadcast, then a shuffle each. On a Zen 4 the 8-row tiles of 2-4 rows are
// bound by their loads (two a cycle: the 4-row tile's ~470 loads a block took ~235 cycles), and
// a broadcast per chain was 64 of them at 4 rows. One thread, a block of 8 rows in L1, with the
// prefetch, ns a block at 2 / 3 / 4 rows: 50.0 / 61.4 / 74.9 -> 48.0 / 59.5 / 68.5. End to end
// it is within the noise: the 1.5B's 4-row forward in the host's fast state came out 1.025x and
// 1.002x shorter (paired medians of two runs, 12-17 rounds each). The 1-row tile (decode, bound
// by memory) and the 16-row tiles (4 rows 56.1 against 57.7 this way) keep a broadcast per
// chain (docs/benchmarks.md, the twenty-third Zen 4 section).
QG_AVX512 inline void q6_offsets(const int32_t* p, __m256i& first, __m256i& second) {
    int64_t pair;
    std::memcpy(&pair, p, sizeof pair);
    const __m256i both = _mm256_set1_epi64x(pair);
    first = _mm256_shuffle_epi32(both, 0x00);
    second = _mm256_shuffle_epi32(both, 0x55);
}

// Block b of each of the G groups from row n on (group_bytes each), prefetching ahead when PF
// (where kSpreads, the tile's steps issue those lines instead: prefetch_part below).
// One group streams its rows' bytes in memory order, prefetched as prefetch_group says.
// Two groups lie side by side and are read in step, so a fixed distance ahead of the first one's
// block lands in the second group, a block or so before that group reads it: half the stream
// arrived late (2-vCPU Zen 4, one thread, a 256 MiB Q4_K weight of K = 1536: 16 rows 1.2-1.3x
// slower than 8 at one to four activation rows, where with the weights in L2 they ran alike or
// faster). Each of the two takes the same block of the next call's groups, 2 * kGroup rows on:
// one call ahead (see kNarrowTileRows for the figures).
template <int T, int G, bool PF>
QG_AVX512 inline void group_blocks(const Ctx& c, int64_t n, int64_t b, int group_bytes, const uint8_t** gb) {
    for (int k = 0; k < G; k++) {
        gb[k] = c.w + (n + kGroup * k) * c.rb + b * group_bytes;
        if constexpr (kSpreads<T, G, PF>) {
            step_side(c);
        } else {
            if constexpr (PF && G == 1) prefetch_group<T>(c, gb[k], group_bytes);
            if constexpr (PF && G == 2) prefetch_lines(c, gb[k] + stream_ahead<G>(c), group_bytes);
        }
    }
}

// Where the tile's steps prefetch block b's lines (spread_bases), if it spreads them (kSpreads).
template <int T, int G, bool PF>
QG_AVX512 inline void spread_bases_of(const Ctx& c, const uint8_t* const* gb, const uint8_t** at) {
    if constexpr (kSpreads<T, G, PF>) spread_bases<G>(c, gb, at);
}
// Part `part` of `Parts` of the lines group_blocks would prefetch for block b (from `at`:
// spread_bases_of), where the tile spreads them.
template <int T, int G, bool PF, int Parts>
QG_AVX512 inline void prefetch_part(const uint8_t* const* at, int part) {
    if constexpr (kSpreads<T, G, PF>) prefetch_share<PackedK<T>::group_bytes, G, Parts>(at, part);
}

// Rows m0 .. m0 + R - 1 of the tile's outputs n .. n + 8G - 1, plus the bias.
template <int G, int R>
QG_AVX512 inline void store_groups(const Ctx& c, int64_t n, int64_t m0, const VecF<G>* acc) {
    if constexpr (G == 1) {
        group_store(c, n, m0, R, acc);
    } else {
        for (int i = 0; i < R; i++) {
            __m512 v = acc[i];
            if (c.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(c.bias + n));
            _mm512_storeu_ps(c.y + (m0 + i) * c.ldy + n, v);
        }
    }
}

// group_nibbles for G groups at once.
template <int T, int G>
QG_AVX512 inline void nibbles_of(const uint8_t* const* gb, int v, VecI<G>& lo, VecI<G>& hi) {
    using L = Packed32<T>;
    const VecI<G> qv = load_groups<G>(gb, L::qs + 32 * v);
    lo = v_and(qv, bytes_of<G>(15));
    hi = v_and(v_srli16(qv, 4), bytes_of<G>(15));
    if constexpr (L::has_qh) {
        __m256i l[G], h[G];
        for (int k = 0; k < G; k++) {
            l[k] = _mm256_and_si256(bit_bytes(gb[k] + L::qh + 4 * v), _mm256_set1_epi8(16));
            h[k] = _mm256_and_si256(bit_bytes(gb[k] + L::qh + 16 + 4 * v), _mm256_set1_epi8(16));
        }
        lo = v_or(lo, join<G>(l));
        hi = v_or(hi, join<G>(h));
    }
}

// The 32-value block types in the repacked layout with vpdpbusd (u8 x s8, four products summed
// into an int32 lane, no saturation), for G groups (rows n .. n + 8G - 1): group32_avx2's
// outputs, lanes and integers, without its int16 steps. A weight is made unsigned by an
// offset (u = w + 8 for Q4_0, 16 for Q5_0, 128 for Q8_0; Q4_1 and Q5_1 are unsigned already)
// and offset * (the block's sum of x) is taken off, so each lane's integer is the same sum of
// w * x; the float operations are group_add_block's, lane by lane, in the same order. So the
// paths agree bit for bit.
template <int T, int R, bool PF, int G>
QG_AVX512 void group32_avx512(const Ctx& c, int64_t n, int64_t m0) {
    using L = Packed32<T>;
    using I = VecI<G>;
    using F = VecF<G>;
    const GroupRows<T, R> r(c, m0);
    F acc[R];
    for (int i = 0; i < R; i++) acc[i] = F{};
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb[G];
        group_blocks<T, G, PF>(c, n, b, L::group_bytes, gb);
        I p[R];
        for (int i = 0; i < R; i++) p[i] = I{};
        if constexpr (T == Q8_0) {
            for (int v = 0; v < 8; v++) {
                const I u = v_xor(load_groups<G>(gb, L::qs + 32 * v), bytes_of<G>(char(0x80)));
                for (int i = 0; i < R; i++) p[i] = v_dot4(p[i], u, r.xq[i] + b * 32 + 4 * v);
            }
        } else {
            for (int v = 0; v < 4; v++) {
                I lo, hi;
                nibbles_of<T, G>(gb, v, lo, hi);
                for (int i = 0; i < R; i++) {
                    const int8_t* x = r.xq[i] + b * 32;
                    p[i] = v_dot4(p[i], lo, x + 4 * v);
                    p[i] = v_dot4(p[i], hi, x + 16 + 4 * v);
                }
            }
        }
        constexpr int shift = kVnniShift<T>;
        if constexpr (shift >= 0)
            for (int i = 0; i < R; i++) p[i] = v_sub(p[i], v_set1(r.xo[i][b] * (1 << shift), p[i]));
        const F dw = halves_of<G>(gb, 0);
        for (int i = 0; i < R; i++) acc[i] = v_fma(acc[i], dw, r.xd[i] + b, p[i]);
        if constexpr (L::has_min) {
            const F mw = halves_of<G>(gb, L::m);
            for (int i = 0; i < R; i++) acc[i] = v_fma_s(acc[i], mw, r.xs[i] + b);
        }
    }
    store_groups<G, R>(c, n, m0, acc);
}

// isum[i] += p0[i] * scale j + p1[i] * scale j + 1, each group's (KScales' or Q6Scales'
// scale32), summed as it goes: the optimiser's tree of the products spilled registers.
template <int G, int R, class Scales>
QG_AVX512 inline void add_scaled_pair(VecI<G>* isum, const VecI<G>* p0, const VecI<G>* p1, const Scales* sc, int j) {
    __m256i part[G];
    for (int k = 0; k < G; k++) part[k] = sc[k].scale32(j);
    const VecI<G> s0 = join<G>(part);
    for (int k = 0; k < G; k++) part[k] = sc[k].scale32(j + 1);
    const VecI<G> s1 = join<G>(part);
    for (int i = 0; i < R; i++) {
        isum[i] = v_add(isum[i], v_add(v_mullo(p0[i], s0), v_mullo(p1[i], s1)));
        pin(isum[i]);
    }
}

// The G groups' mins 2p and 2p + 1 as int16 pairs, p = 0 .. 3 (sub_k_mins' operands).
template <int G>
QG_AVX512 inline void k_min_pairs(const KScales* ks, VecI<G>* mp) {
    for (int p = 0; p < 4; p++) {
        __m256i part[G];
        for (int k = 0; k < G; k++) part[k] = ks[k].min_pair16(p);
        mp[p] = join<G>(part);
    }
}
// sub_k_mins from its operands: the mins' pairs (k_min_pairs) and dmin (dmv) of block b.
template <int G, int R>
QG_AVX512 inline void sub_k_mins_of(VecF<G>* acc, const VecI<G>* mp, VecF<G> dmv, const KActs<R>& x, int64_t b) {
    for (int i = 0; i < R; i++) {
        VecI<G> ms = v_madd16(mp[0], x.xb[i] + b * kSums32);
        for (int p = 1; p < 4; p++) ms = v_add(ms, v_madd16(mp[p], x.xb[i] + b * kSums32 + 2 * p));
        acc[i] = v_fnma(acc[i], dmv, x.xd[i] + b, ms);
    }
}
// Q4_K, Q5_K: acc[i] minus dmin * d_x * row i's sum_j m_j * (the sum of x over sub-block j),
// for G groups: k_min_sums' integers (exact, so the same whatever the order), a row at a time
// into its accumulator on the G groups' lanes at once. (k_min_sums for each group, then joined,
// kept R * G sums alive and the 16-row 4-row tile spilled a hundred of its registers a block.)
template <int G, int R>
QG_AVX512 inline void sub_k_mins(VecF<G>* acc, const KScales* ks, const KActs<R>& x, int64_t b, const uint8_t* const* gb) {
    VecI<G> mp[4];
    k_min_pairs<G>(ks, mp);
    sub_k_mins_of<G, R>(acc, mp, halves_of<G>(gb, 16), x, b);
}

// isum[i] += p[i] * scale j (each group's KScales scale32).
template <int G, int R, class Scales>
QG_AVX512 inline void add_scaled_one(VecI<G>* isum, const VecI<G>* p, const Scales* sc, int j) {
    __m256i part[G];
    for (int k = 0; k < G; k++) part[k] = sc[k].scale32(j);
    const VecI<G> s = join<G>(part);
    for (int i = 0; i < R; i++) {
        isum[i] = v_add(isum[i], v_mullo(p[i], s));
        pin(isum[i]);
    }
}

// Which K-quant tiles take 5 to 8 rows in one pass with one chain of sums a row: Q4_K's on
// 512-bit vectors. On a 2-vCPU Zen 4, a forward of 5 rows of one sequence of Qwen2.5-Coder 1.5B
// Q4_K_M (speculation checking 4 guesses) cost 1.36-1.40x a 4-row one with a 4-row tile and a
// 1-row tile, 1.28-1.29x with one 5-row pass; 8 rows 1.78-1.83x, 1.64-1.73x (docs/benchmarks.md,
// the seventh Zen 4 section). On 256-bit vectors the one-pass tile made the step slower (6 rows:
// 1.3-1.5x), and a one-pass Q6_K tile did on either; Q5_K's gained 4% at 8 rows (weights in L2).
template <int T, int G>
constexpr bool kTallTile = T == Q4_K && G == 2;

// A kTallTile tile's sub-block j: the low (j even) or high nibbles of 32 bytes a row, times each
// row's activations, into isum by the sub-block's scale.
template <int T, int G, int R, bool PF>
QG_AVX512 inline void tall_sub_block(const uint8_t* const* gb, int j, const uint8_t* const* lines_at,
                                     const int8_t* const* xb, const KScales* ks, VecI<G>* isum) {
    VecI<G> p[R];
    for (int i = 0; i < R; i++) p[i] = VecI<G>{};
#pragma GCC unroll 8
    for (int v = 0; v < 8; v++) {
        prefetch_part<T, G, PF, 64>(lines_at, 8 * j + v);
        const VecI<G> w = k_weights_of<T, G>(gb, j, v);
        for (int i = 0; i < R; i++) p[i] = v_dot4(p[i], w, xb[i] + 32 * j + 4 * v);
    }
    add_scaled_one<G, R>(isum, p, ks, j);
}

// K-quants in the repacked layout with vpdpbusd: groupk_avx2's outputs for G groups (rows n ..
// n + 8G - 1). Each lane sums a sub-block's 32 (Q6_K: a group's 16) products u8 x s8 straight
// into int32, with no int16 partial sums, and vpmulld by the row's scale makes the integer that
// vpmaddwd makes there; the mins (their integers from groupk_avx2's helpers) and the float steps
// are groupk_avx2's, lane by lane, and Q6_K's group sums start from its -32 (Ctx::qo, as the
// AVX2 tile's start from po). So the paths agree bit for bit (the integer sums in any order). A
// row keeps two chains of sums, the two sub-blocks (Q6_K: groups) that one pass over a stretch of
// the weights' bytes meets, so each weight vector is unpacked once and vpdpbusd's latency never
// leaves a one-row tile waiting on one chain; a kTallTile tile of 5 to 8 rows keeps one (a
// sub-block at a time) so that all its rows' sums fit the registers, and unpacks each weight
// vector once for every row where a 4-row tile and one for the rest would unpack it twice. The
// integers are the same sums either way.
template <int T, int R, bool PF, int G>
QG_AVX512 void groupk_avx512(const Ctx& c, int64_t n, int64_t m0) {
    using L = PackedK<T>;
    using I = VecI<G>;
    using F = VecF<G>;
    const KActs<R> x(c, m0);
    F acc[R];
    for (int i = 0; i < R; i++) acc[i] = F{};
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb[G];
        group_blocks<T, G, PF>(c, n, b, L::group_bytes, gb);
        const uint8_t* lines_at[G];
        spread_bases_of<T, G, PF>(c, gb, lines_at);
        const int8_t* xb[R];
        for (int i = 0; i < R; i++) xb[i] = x.xq[i] + b * QK;
        I isum[R];
        for (int i = 0; i < R; i++) isum[i] = I{};
        if constexpr (T == Q6_K) {
            Q6Scales sc[G];
            for (int k = 0; k < G; k++) sc[k] = Q6Scales(gb[k]);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {  // values 128h + 32t + (0..31): groups g and g + 1
                    const int g = 8 * h + 2 * t;
                    I p0[R], p1[R];
                    for (int i = 0; i < R; i++) {  // each chain from its group's -32 x sum(x) on
                        if constexpr (G == 1 && R > 1) {  // (both groups' offsets in one load: see q6_offsets)
                            q6_offsets(x.xqo[i] + kSums16 * b + g, p0[i], p1[i]);
                        } else {
                            p0[i] = v_set1(x.xqo[i][kSums16 * b + g], I{});
                            p1[i] = v_set1(x.xqo[i][kSums16 * b + g + 1], I{});
                        }
                    }
#pragma GCC unroll 4
                    for (int v = 0; v < 4; v++) {
                        prefetch_part<T, G, PF, 32>(lines_at, 16 * h + 4 * t + v);
                        const I w0 = q6_weights_of<G>(gb, h, t, v), w1 = q6_weights_of<G>(gb, h, t, v + 4);
                        for (int i = 0; i < R; i++) {
                            const int8_t* xv = xb[i] + 128 * h + 32 * t + 4 * v;
                            p0[i] = v_dot4(p0[i], w0, xv);
                            p1[i] = v_dot4(p1[i], w1, xv + 16);
                        }
                    }
                    add_scaled_pair<G, R>(isum, p0, p1, sc, g);
                }
            const F dv = halves_of<G>(gb, L::q6_d);
            for (int i = 0; i < R; i++) acc[i] = v_fma(acc[i], dv, x.xd[i] + b, isum[i]);
        } else {
            KScales ks[G];
            for (int k = 0; k < G; k++) ks[k] = KScales(gb[k] + L::sc);
            sub_k_mins<G, R>(acc, ks, x, b, gb);  // the mins first
            if constexpr (kTallTile<T, G> && R > 4) {
                // Unrolled where the steps spread the block's prefetches (kSpreads):
                // as a loop (GCC's choice) each step worked out its prefetch's line at run time, ~300
                // scalar instructions beside a sub-block's 64 vpdpbusd (8 rows). On a 2-vCPU Zen 5,
                // one thread, in L2, cycles per 16 rows x 256 at 5 / 6 / 8 rows: 333-356 / 388-422 /
                // 492-522 -> 263-290 / 307-336 / 408-438; the 1.5B's 8-row forward 31.2-32.5 ->
                // 29.6-30.8 ms. Elsewhere it stays a loop: without the spread, unrolled, 8 rows took
                // 477 against 445; unstreamed, 16 and 64 rows ran 3-4% faster but prefill's 512 and
                // 1,024 4-7% slower. The same operations in the same order either way: the same bits.
                if constexpr (kSpreads<T, G, PF>) {
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++) tall_sub_block<T, G, R, PF>(gb, j, lines_at, xb, ks, isum);
                } else {
                    for (int j = 0; j < 8; j++) tall_sub_block<T, G, R, PF>(gb, j, lines_at, xb, ks, isum);
                }
            } else {
#pragma GCC unroll 4
                for (int j = 0; j < 8; j += 2) {  // sub-block j: the low nibbles of 32 bytes a row, j + 1: their high ones
                    I p0[R], p1[R];
                    for (int i = 0; i < R; i++) p0[i] = p1[i] = I{};
#pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        prefetch_part<T, G, PF, 32>(lines_at, 4 * j + v);
                        const I w0 = k_weights_of<T, G>(gb, j, v), w1 = k_weights_of<T, G>(gb, j + 1, v);
                        for (int i = 0; i < R; i++) {
                            const int8_t* xv = xb[i] + 32 * j + 4 * v;
                            p0[i] = v_dot4(p0[i], w0, xv);
                            p1[i] = v_dot4(p1[i], w1, xv + 32);
                        }
                    }
                    add_scaled_pair<G, R>(isum, p0, p1, ks, j);
                }
            }
            const F dv = halves_of<G>(gb, 0);
            for (int i = 0; i < R; i++) acc[i] = v_fma(acc[i], dv, x.xd[i] + b, isum[i]);
        }
    }
    store_groups<G, R>(c, n, m0, acc);
}

// Where cpu_kernels.py sets QG_PAIRED_LANES (AMD's Zen 5), the K-quants' one-group tiles (Q4_K,
// Q5_K, Q6_K) run on 512-bit vectors with each row's sums in a pair of lanes
// (groupk_paired_avx512), and calls of up to 4 rows take them (kNarrowRows) instead of the 16-row
// tiles.
#ifndef QG_PAIRED_LANES
#define QG_PAIRED_LANES 0
#endif
template <int T, int G>
constexpr bool kPairedTile = QG_PAIRED_LANES && G == 1 && block_values(T) == 256;

// A one-group block's vectors as stored hold 4 values of each of its 8 rows (lane j: row j). Two
// vectors of the same 8 rows side by side, v and the one of the next 4 values, are one 512-bit
// vector whose lanes are interleaved (lanes 2j and 2j + 1: row j's 8 values), and they meet the
// 8 activation values there as one broadcast 64-bit pair (v_dot8).
alignas(64) const int32_t kInterleaveOne[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
alignas(64) const int32_t kInterleaveTwo[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
alignas(64) const int32_t kEachLaneTwice[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
// The 64 bytes at p, interleaved: two neighbouring vectors (Q4_K's and Q5_K's)
QG_AVX512 inline __m512i interleaved(const uint8_t* p) {
    return _mm512_permutexvar_epi32(_mm512_load_si512(kInterleaveOne), _mm512_loadu_si512(p));
}
// ... and two vectors apart from each other (Q6_K's vectors v and v + 1 of a byte c)
QG_AVX512 inline __m512i interleaved(const uint8_t* a, const uint8_t* b) {
    return _mm512_permutex2var_epi32(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                     _mm512_load_si512(kInterleaveTwo),
                                     _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
}
// acc + the 4 products u8 x s8 of each 32-bit lane, the 8 activation values at x as a 64-bit pair
// in every pair of lanes (vpdpbusd broadcasts 32 bits at most: a broadcast of its own).
QG_AVX512 inline __m512i v_dot8(__m512i acc, __m512i w, const int8_t* x) {
    int64_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi64(pair));
}
// pick_bytes on 512-bit vectors: its 32-byte pattern's first 16 in every 128-bit lane.
QG_AVX512 inline __m512i pick_bytes(__m512i v, const uint8_t* pattern) {
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(pattern))));
}
// Each row's lanes 2j and 2j + 1 added, as 8 lanes (lane j: row j).
QG_AVX512 inline __m256i row_sums(__m512i pairs) {
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(pairs, _mm512_srli_epi64(pairs, 32)));
}

// groupk_avx512 for one group (G = 1) with each row's sums in a pair of lanes: the block's
// vectors two at a time (interleaved), so 512-bit vectors do the work of a 256-bit tile's two.
// A sub-block's (Q6_K: a group's) products go into a chain a row in both lanes (Q6_K's from its
// -32 x sum(x), Ctx::qo, in the even lane), times the row's scale in both lanes (its scales read
// once a block with each lane twice), into the row's int32 pair; the pair's two lanes are added
// at the block's end and the float steps are groupk_avx512's. The integers are the same sums, so
// the same bits. Against groupk_avx512 on a 2-vCPU Zen 5 (one thread, a slice of Qwen2.5-Coder
// 1.5B's weights in L2, cycles per 16 rows x 256 at 1 / 2 / 3 / 4 rows, three runs): Q6_K 258-266 /
// 346-364 / 457-471 / 497-543 -> 168-174 / 256-271 / 355-382 / 365-425, Q4_K at one row 177-193 ->
// 125-131, Q5_K (SmolLM2-135M's) 230 -> 153 (at 2-4 rows the 16-row tiles compute in 152-170 /
// 201-211 / 244-276 against these 191-199 / 251-264 / 294-310, Q5_K's in 209 / 232 / 275 against
// 209 / 275 / 343, but read two streams: the 1.5B's 4-row forward took 0.96x the time in the slow
// state this way and the same in the fast one, and in Q5_K_M its 2- and 3-row ones 0.91x and
// 0.93x; docs/benchmarks.md, the fifth Zen 5 section).
template <int T, int R, bool PF>
QG_AVX512 void groupk_paired_avx512(const Ctx& c, int64_t n, int64_t m0) {
    using L = PackedK<T>;
    const KActs<R> x(c, m0);
    const __m512i twice = _mm512_load_si512(kEachLaneTwice);
    __m256 acc[R];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb[1];
        group_blocks<T, 1, PF>(c, n, b, L::group_bytes, gb);
        const uint8_t* lines_at[1];
        spread_bases_of<T, 1, PF>(c, gb, lines_at);
        const int8_t* xb[R];
        for (int i = 0; i < R; i++) xb[i] = x.xq[i] + b * QK;
        __m512i isum[R];
        for (int i = 0; i < R; i++) isum[i] = _mm512_setzero_si512();
        if constexpr (T == Q6_K) {
            __m512i sc[4];  // lanes 2j, 2j + 1: row j's scales 4w .. 4w + 3
            for (int w = 0; w < 4; w++)
                sc[w] = _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb[0] + L::q6_sc + 32 * w))));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
                for (int u = 0; u < 2; u++) {  // the groups of values 32t + 16u + (0..15): 8h + 2t + u
                    __m512i raw[2][3];  // bytes c of vectors v and v + 1, v = 4u + 2k
                    for (int k = 0; k < 2; k++)
                        for (int cc = 0; cc < 3; cc++)
                            raw[k][cc] = interleaved(gb[0] + q6_vector(h, 4 * u + 2 * k, cc), gb[0] + q6_vector(h, 4 * u + 2 * k + 1, cc));
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++) {
                        const int g = 8 * h + 2 * t + u;
                        __m512i p[R];
                        for (int i = 0; i < R; i++) p[i] = _mm512_maskz_set1_epi32(0x5555, x.xqo[i][kSums16 * b + g]);
#pragma GCC unroll 2
                        for (int k = 0; k < 2; k++) {
                            prefetch_part<T, 1, PF, 32>(lines_at, 16 * h + 8 * u + 4 * k + t);
                            const __m512i w = t < 3 ? q6_low_values<2>(raw[k][t])
                                                    : q6_fourth_values<2>(raw[k][0], raw[k][1], raw[k][2]);
                            for (int i = 0; i < R; i++) p[i] = v_dot8(p[i], w, xb[i] + 128 * h + 32 * t + 4 * (4 * u + 2 * k));
                        }
                        const __m512i s = _mm512_srai_epi32(pick_bytes(sc[g / 4], kByteHi32[g % 4]), 24);  // Q6Scales::scale32
                        for (int i = 0; i < R; i++) {
                            isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p[i], s));
                            pin(isum[i]);
                        }
                    }
                }
        } else {
            KScales ks[1] = {KScales(gb[0] + L::sc)};
            sub_k_mins<1, R>(acc, ks, x, b, gb);  // the mins first
            const __m512i lo = _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(ks[0].sc_lo));
            const __m512i hi = _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(ks[0].sc_hi));
            __m512i qh[4];  // Q5_K: its high bits' vectors 2k and 2k + 1, interleaved
            if constexpr (T == Q5_K)
                for (int k = 0; k < 4; k++) qh[k] = interleaved(gb[0] + L::qh + 64 * k);
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {  // sub-block j: the low nibbles, j + 1: the high ones
                __m512i p0[R], p1[R];
                for (int i = 0; i < R; i++) p0[i] = p1[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {  // vectors 2k and 2k + 1
                    prefetch_part<T, 1, PF, 16>(lines_at, 2 * j + k);
                    const __m512i q = interleaved(gb[0] + L::qs + 32 * (8 * (j / 2) + 2 * k));
                    __m512i w0 = k_nibbles<2>(q, j), w1 = k_nibbles<2>(q, j + 1);
                    if constexpr (T == Q5_K) w0 = v_or(w0, q5_fifth_bits<2>(qh[k], j)), w1 = v_or(w1, q5_fifth_bits<2>(qh[k], j + 1));
                    for (int i = 0; i < R; i++) {
                        p0[i] = v_dot8(p0[i], w0, xb[i] + 32 * j + 8 * k);
                        p1[i] = v_dot8(p1[i], w1, xb[i] + 32 * j + 32 + 8 * k);
                    }
                }
                const __m512i s0 = pick_bytes(j < 4 ? lo : hi, kByte32[j & 3]);  // KScales::scale32
                const __m512i s1 = pick_bytes(j + 1 < 4 ? lo : hi, kByte32[(j + 1) & 3]);
                for (int i = 0; i < R; i++) {
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(p0[i], s0), _mm512_mullo_epi32(p1[i], s1)));
                    pin(isum[i]);
                }
            }
        }
        const __m256 dv = halves_of<1>(gb, T == Q6_K ? L::q6_d : 0);
        for (int i = 0; i < R; i++) acc[i] = v_fma(acc[i], dv, x.xd[i] + b, row_sums(isum[i]));
    }
    store_groups<1, R>(c, n, m0, acc);
}

template <int T, int R, bool PF, int G>
QG_AVX512 void group_avx512(const Ctx& c, int64_t n, int64_t m0) {
    if constexpr (block_values(T) == 32) group32_avx512<T, R, PF, G>(c, n, m0);
    else if constexpr (kPairedTile<T, G>) groupk_paired_avx512<T, R, PF>(c, n, m0);
    else groupk_avx512<T, R, PF, G>(c, n, m0);
}

// Which K-quant tiles take more than 4 rows in one tile of two chains a row: those on 512-bit
// vectors that kTallTile leaves, Q5_K's and Q6_K's; up to kWideTileRows (6 rows: 24 registers of
// sums and accumulators). One thread, weights in L2, ns per 8 weight rows x 256 values on a Zen 4,
// 5 rows against 4 + 1: Q5_K 66 / 90, Q6_K 99-100 / 112; 6 rows against 4 + 2: Q5_K 78-79 / 97-98,
// Q6_K 112-113 / 123 (one pass of 8 rows against 4 + 4, Q5_K: 115.5 / 120). On 256-bit vectors
// Q6_K's ran slower that way (5 rows 101-103 against 96-98).
template <int T, int G>
constexpr bool kWideTile = block_values(T) == 256 && G == 2 && !kTallTile<T, G>;
// cpu_kernels.py sets QG_WIDE_TILE_ROWS=8 on Intel, where one pass of 7 or 8 rows beats two even
// though sums spill: a 2-vCPU Xeon (Emerald Rapids), one thread, prefetched, cycles per 8 weight
// rows x 256 values x row, in L2 (512 rows of 1536) / streamed (65536), against 4 + 4 and 4 + 3:
// Q6_K 8 rows 47-48 / 54 against 55 / 65, 7 rows 48-50 / 56-70 against 59 / 67-71; Q5_K 8 rows 40-41
// / 44-46 against 51-52 / 54-55, 7 rows 41 / 49-51 against 52-54 / 58-67. (6 rows in one tile there:
// Q6_K 51-53 / 60, Q5_K 43-46 / 50-52.)
#ifndef QG_WIDE_TILE_ROWS
#define QG_WIDE_TILE_ROWS 6
#endif
constexpr int kWideTileRows = QG_WIDE_TILE_ROWS;
static_assert(kWideTileRows >= 4 && kWideTileRows <= kTileRows, "QG_WIDE_TILE_ROWS: 4 to 8 rows a tile");
// The same for calls that sweep their weights from cache (more than kStreamRows rows: prefill,
// large batches) where it differs: cpu_kernels.py sets QG_SWEPT_WIDE_TILE_ROWS=8 on AMD's Zen 5.
// There a one-pass tile of 8 rows made streamed 8-row forwards slower (the 1.5B's 38.0 -> 40.0 ms;
// docs/benchmarks.md, the first Zen 5 section) but the swept tiles faster: one thread, a slice of
// Qwen2.5-Coder 1.5B's weights in L2, cycles per 16 weight rows x 256 values x row at 16 / 64 rows,
// 6 + 2 against 8: Q5_K 64.4-66.0 / 62.3-64.9 -> 56.9-59.1 / 57.0-59.5, Q6_K (K = 8960) 86.4-95.3 /
// 89.6-96.4 -> 77.2-84.2 / 83.6-91.0, (K = 1536) 87.9 / 86.2 -> 75.5 / 74.9. Alone it did not show
// in prefill (kSweptChunkBytes did: the activations' passes bounded those calls).
#ifndef QG_SWEPT_WIDE_TILE_ROWS
#define QG_SWEPT_WIDE_TILE_ROWS QG_WIDE_TILE_ROWS
#endif
constexpr int kSweptWideTileRows = QG_SWEPT_WIDE_TILE_ROWS;
static_assert(kSweptWideTileRows >= 4 && kSweptWideTileRows <= kTileRows, "QG_SWEPT_WIDE_TILE_ROWS: 4 to 8 rows a tile");

// The most rows one tile takes: the 32-value types' 8 (32 registers: 8 sums, 8 accumulators, the
// weights); the K-quants' keep two chains of sums a row and take 4, but kTallTile's take 5 to 8 in
// one pass and kWideTile's up to kWideTileRows (streamed, PF) or kSweptWideTileRows.
template <int T, int G, bool PF>
constexpr int kTileRowsAvx512 = block_values(T) == 32 || kTallTile<T, G> ? 8
                                : kWideTile<T, G>                       ? (PF ? kWideTileRows : kSweptWideTileRows)
                                                                        : 4;

// The tiles of rows m0 .. m0 + mt - 1 over G groups from output n on: split_rows with group_avx512.
template <int T, bool PF, int G>
struct Avx512Tile {
    const Ctx& c;
    int64_t n;
    template <int R>
    QG_AVX512 void run(int64_t m) const { group_avx512<T, R, PF, G>(c, n, m); }
};
template <int T, bool PF, int G>
QG_AVX512 void groups_avx512(const Ctx& c, int64_t n, int64_t m0, int mt) {
    split_rows<kTileRowsAvx512<T, G, PF>>(Avx512Tile<T, PF, G>{c, n}, m0, mt);
}

// Where a CPU takes narrow tiles (kNarrowTileRows), Q6_K takes them up to 4 rows: streamed as in
// kNarrowTileRows' figures, 8-row tiles against 16-row ones at 1-4 rows K = 1536: 73-77 / 83-101,
// 73-75 / 86-87, 78-82 / 88-90, 87-89 / 98-101 (K = 8960 alike), at 5 rows 121 / 102 (K = 8960:
// 140-144 / 121-123). Where the one-group tiles pair their lanes (kPairedTile), Q4_K and Q5_K
// take them up to 4 rows too.
template <int T>
constexpr int64_t kNarrowRows = !kNarrowType<T> ? 0
                                : (T == Q6_K && kNarrowTileRows > 0) || kPairedTile<T, 1> ? std::max<int64_t>(kNarrowTileRows, 4) : kNarrowTileRows;

// rows_avx2's work split, with the groups above: 16 rows (two groups) on 512-bit vectors where
// the driver hands them out together, in calls of more than kNarrowRows rows.
template <int T>
QG_AVX512 void rows_avx512(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if (cols == 2 * kGroup && n + 2 * kGroup <= c.grouped && c.M > kNarrowRows<T>)
        return c.stream ? groups_avx512<T, true, 2>(c, n, m0, mt) : groups_avx512<T, false, 2>(c, n, m0, mt);
    for (int64_t g = n; g < n + cols; g += kGroup) {
        if (g >= c.grouped) return rows_portable_grouped<T>(c, g, int(n + cols - g), m0, mt);
        c.stream ? groups_avx512<T, true, 1>(c, g, m0, mt) : groups_avx512<T, false, 1>(c, g, m0, mt);
    }
}

// The types this path has kernels for (the block types that have a repacked layout).
constexpr bool avx512_has(int t) {
    return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K || t == Q5_K || t == Q6_K;
}

// dot_peak_avx2 with vpdpbusd on 512-bit registers (64 products an instruction). Emulated
// through SIMDe it measures nothing of the machine: -1, no probe.
QG_AVX512 __attribute__((noinline)) int64_t dot_peak_avx512(int64_t reps) {
#if defined(QG_EMULATE_AVX512)
    (void)reps;
    return -1;
#else
    __m512i a = _mm512_set1_epi8(1), acc[8], b[8];
    for (int j = 0; j < 8; j++) {
        acc[j] = _mm512_setzero_si512();
        b[j] = _mm512_set1_epi8(char(j + 1));
    }
    for (int64_t r = 0; r < reps; r++) {
        pin(a);
        for (int j = 0; j < 8; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b[j]);
    }
    __m512i s = acc[0];
    for (int j = 1; j < 8; j++) s = _mm512_add_epi32(s, acc[j]);
    alignas(64) int32_t lanes[16];
    _mm512_store_si512(lanes, s);
    volatile int32_t sink = lanes[0];
    (void)sink;
    return reps * 8 * 64 * 2;
#endif
}

// AVX-512 F, BW, VL and VNNI on the CPU, and the OS saving their registers (XCR0: SSE, AVX,
// opmask, upper ZMM halves, ZMM16-31).
bool have_avx512() {
#if defined(QG_EMULATE_AVX512)
    return true;
#else
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return false;
        unsigned lo, hi;
        asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & 0xe6) != 0xe6) return false;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const unsigned f = 1u << 16, bw = 1u << 30, vl = 1u << 31, vnni = 1u << 11;
        return (b & f) && (b & bw) && (b & vl) && (c & vnni);
    }();
    return ok && have_avx2();
#endif
}

}  // namespace
