// The AVX2 path (+FMA, F16C): kernels for the types avx2_has lists, each computing its
// portable dot's integers and float operations in the same order (quant/portable.h), so the
// bits agree. Functions carry a target attribute, so the file builds for any x86 CPU; the
// driver (quant_gemm.cpp) runs this path only where have_avx2() says the CPU has it.
//
// The AVX-VNNI path is this file's block kernels with V = true: where the CPU has AVX-VNNI (the
// VEX vpdpbusd on 256-bit vectors: Intel's cores since Alder Lake, which have no AVX-512), each
// lane sums its four u8 x s8 products straight into int32 (dot4_vnni) instead of vpmaddubsw's
// int16 pairs and a vpaddw. The integers are the same and so are the float steps, so the bits
// agree with every other path. AVX-512 does not build on it: Zen 4 has AVX-512 VNNI and not the
// VEX form.
#pragma once
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel.h"
#include "packed.h"
#include "portable.h"
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

// Byte j = 0xff where bit j of the little-endian u32 at p is set, else 0.
QG_AVX2 inline __m256i bit_bytes(const uint8_t* p) {
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(rd32(p))),
                                          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                             0x0303030303030303));
    return _mm256_cmpeq_epi8(_mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

// The 8 outputs of each of R rows, plus the bias (dot32's order: the bias last).
QG_AVX2 inline void group_store(const Ctx& c, int64_t n, int64_t m0, int R, const __m256* acc) {
    for (int i = 0; i < R; i++) {
        __m256 v = acc[i];
        if (c.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(c.bias + n));
        _mm256_storeu_ps(c.y + (m0 + i) * c.ldy + n, v);
    }
}

// 4 activation bytes in every 32-bit lane (vbroadcastss: a load, no shuffle).
QG_AVX2 inline __m256i bcast4(const int8_t* p) { return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p))); }

// The repacked layout's offsets (quant/packed.h): a 32-value type's weights come in unsigned
// (Q4_0's nibble, Q5_0's 5 bits) and the offset (8, 16) times the block's sum of x is taken
// off the integer dot; log2 of the offset, -1 for none.
template <int T>
constexpr int kOffsetShift = T == Q4_0 ? 3 : T == Q5_0 ? 4 : -1;
// log2 of the offset a vpdpbusd kernel takes off: kOffsetShift, and Q8_0's 128 (its signed
// weights made unsigned by flipping the top bit)
template <int T>
constexpr int kVnniShift = T == Q8_0 ? 7 : kOffsetShift<T>;

// acc + the 4 products u8 x s8 of each 32-bit lane (dpbusd_vnni; dot4_vnni: the 4 activation
// values at x in every lane): AVX-VNNI's vpdpbusd, VEX-encoded in an asm statement so that the
// function keeps this file's target. The tests' build without the CPU's AVX-512
// (QG_EMULATE_AVX512) computes the same integer exactly with AVX2 instead: the even and odd bytes
// widened to int16, two vpmaddwd.
QG_AVX2 inline __m256i dpbusd_vnni(__m256i acc, __m256i w, __m256i x) {
#if defined(QG_EMULATE_AVX512)
    const __m256i w_even = _mm256_and_si256(w, _mm256_set1_epi16(0xff)), w_odd = _mm256_srli_epi16(w, 8);
    const __m256i x_even = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), x_odd = _mm256_srai_epi16(x, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w_even, x_even), _mm256_madd_epi16(w_odd, x_odd)));
#else
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
    return acc;
#endif
}
QG_AVX2 inline __m256i dot4_vnni(__m256i acc, __m256i w, const int8_t* x) { return dpbusd_vnni(acc, w, bcast4(x)); }

// The activation rows of a group tile (row i is m0 + i): values, scales, and (Q4_1, Q5_1) d * sum
// or (offset weights) the integer sums; and the tile's accumulators, zeroed.
template <int T, int R>
struct GroupRows {
    const int8_t* xq[R];
    const float *xd[R], *xs[R];
    const int32_t* xo[R];
    __m256 acc[R];
    QG_AVX2 GroupRows(const Ctx& c, int64_t m0) {
        for (int i = 0; i < R; i++) {
            xq[i] = c.q + (m0 + i) * c.K;
            xd[i] = c.d + (m0 + i) * c.nb;
            xs[i] = c.s ? c.s + (m0 + i) * c.nb : nullptr;
            xo[i] = c.xsum ? c.xsum + (m0 + i) * c.nb : nullptr;
            acc[i] = _mm256_setzero_ps();
        }
    }
};

// The `bytes` of a streamed weight from p on, into the cache Locality names. Unrolled (a group
// block's bytes are a constant: a prefetch instruction a line): as a loop, each line also cost an
// add, a compare and a taken branch on the ports the tiles' vector work runs on. On a 2-vCPU Xeon
// (Emerald Rapids), the AVX2 configuration, builds alternating: Qwen2.5-Coder 1.5B's 1-row
// forward 3.0-3.6% faster, Gemma 3 270M's 8%, the 0.5B's 0.8%; natively within +-1.5%.
template <int Locality = kPrefetchLocality>
QG_AVX2 inline void prefetch_bytes(const uint8_t* p, int bytes) {
#pragma GCC unroll 64
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, Locality);
}
// A line of the thread's side ranges: one per group block streamed, however its lines are issued.
QG_AVX2 inline void step_side(const Ctx& c) {
    if (c.side) c.side->step(1);
}
// prefetch_bytes, and a line of the thread's side ranges.
template <int Locality = kPrefetchLocality>
QG_AVX2 inline void prefetch_lines(const Ctx& c, const uint8_t* p, int bytes) {
    prefetch_bytes<Locality>(p, bytes);
    step_side(c);
}
// Whether a K-quant tile of G groups (G = 1 on the AVX2 path) spreads a block's prefetches over
// its steps (prefetch_share) instead of issuing them together as the block starts (where
// QG_SPREAD_PREFETCH is set, and for one group where its lines go to one cache from one distance).
template <int T, int G>
constexpr bool kSpreadPrefetch = kSpreadPrefetchOn && block_values(T) == 256 &&
                                 (G == 2 || (kPrefetchNear == 0 && !kHardwarePrefetched<T>));
// Whether a tile of G groups that streams (PF) spreads its blocks' prefetches: what every
// spreading step, and the prefetches it replaces, ask.
template <int T, int G, bool PF>
constexpr bool kSpreads = PF && kSpreadPrefetch<T, G>;
// A prefetch of p's line into the cache kPrefetchLocality names: __builtin_prefetch's instruction,
// in inline assembly, for GCC dropped prefetch_share's __builtin_prefetch calls. (The bursts,
// prefetch_bytes, keep the builtin: every CPU's tiles were tuned with the code it makes.)
QG_AVX2 inline void prefetch_line(const uint8_t* p) {
    if constexpr (kPrefetchLocality == 3) asm volatile("prefetcht0 %0" : : "m"(*p));
    else if constexpr (kPrefetchLocality == 2) asm volatile("prefetcht1 %0" : : "m"(*p));
    else if constexpr (kPrefetchLocality == 1) asm volatile("prefetcht2 %0" : : "m"(*p));
    else asm volatile("prefetchnta %0" : : "m"(*p));
}
// How far ahead of a block a tile of G groups prefetches its stream: two groups the same block one
// call on (2 * kGroup rows), one group kPrefetchOneGroup bytes on in its own rows.
template <int G>
QG_AVX2 inline int64_t stream_ahead(const Ctx& c) {
    return G == 2 ? 2 * kGroup * c.rb : kPrefetchOneGroup;
}
// Where a spreading tile's steps prefetch block gb[k]'s lines: stream_ahead bytes on, once a block.
// Two groups' distance is known at run time only, so the pointer is hidden from the optimiser and
// each line is it plus a constant: folded into the distance, the 36 lines' offsets of a two-group
// Q4_K block became 36 values kept on the stack and loaded back, one a prefetch.
template <int G>
QG_AVX2 inline void spread_bases(const Ctx& c, const uint8_t* const* gb, const uint8_t** at) {
    for (int k = 0; k < G; k++) {
        at[k] = gb[k] + stream_ahead<G>(c);
        if constexpr (G == 2) asm("" : "+r"(at[k]));
    }
}
// Share `part` of `Parts` of the lines of G group blocks of `bytes` each from at[k] on
// (spread_bases): one or two lines, no loop (a loop here kept GCC from unrolling the AVX2 4-row
// Q4_K tile).
template <int bytes, int G, int Parts>
QG_AVX2 inline void prefetch_share(const uint8_t* const* at, int part) {
    constexpr int per = (bytes + 63) / 64, lines = G * per;
    static_assert(lines <= 2 * Parts, "prefetch_share: at most two lines a share");
    const int l0 = part * lines / Parts, l1 = (part + 1) * lines / Parts;
    if (l0 < l1) prefetch_line(at[l0 / per] + 64 * (l0 % per));
    if constexpr (lines > Parts)
        if (l0 + 1 < l1) prefetch_line(at[(l0 + 1) / per] + 64 * ((l0 + 1) % per));
}
// The next `bytes` of a weight of type T streamed one group at a time from block p on:
// kPrefetchOneGroup bytes ahead, into L2 with those kPrefetchNear bytes ahead into L1 where that
// is set (none where kHardwarePrefetched), and a line of the side ranges either way.
template <int T>
QG_AVX2 inline void prefetch_group(const Ctx& c, const uint8_t* p, int bytes) {
    if (kHardwarePrefetched<T>) bytes = 0;
    if constexpr (kPrefetchNear > 0) {
        prefetch_bytes<3>(p + kPrefetchNear, bytes);
        prefetch_lines<2>(c, p + kPrefetchOneGroup, bytes);
    } else {
        prefetch_lines(c, p + kPrefetchOneGroup, bytes);
    }
}

// Vector v of a 4- or 5-bit group block as unsigned bytes: lo holds values 4v..4v+3 of each row,
// hi values 16 + 4v..
template <int T>
QG_AVX2 inline void group_nibbles(const uint8_t* gb, int v, __m256i& lo, __m256i& hi) {
    using L = Packed32<T>;
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + L::qs + 32 * v));
    lo = _mm256_and_si256(qv, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), low);
    if constexpr (L::has_qh) {
        lo = _mm256_or_si256(lo, _mm256_and_si256(bit_bytes(gb + L::qh + 4 * v), _mm256_set1_epi8(16)));
        hi = _mm256_or_si256(hi, _mm256_and_si256(bit_bytes(gb + L::qh + 16 + 4 * v), _mm256_set1_epi8(16)));
    }
}

// Block b of a group into each row's 8 outputs, from the rows' exact integer dots p (offset
// not yet taken off when shift >= 0): dot32's float steps, lane by lane.
template <int T, int R, int shift>
QG_AVX2 inline void group_add_block(const uint8_t* gb, GroupRows<T, R>& r, int64_t b, __m256i* p) {
    if constexpr (shift >= 0)
        for (int i = 0; i < R; i++) p[i] = _mm256_sub_epi32(p[i], _mm256_set1_epi32(r.xo[i][b] * (1 << shift)));
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb)));
    for (int i = 0; i < R; i++)
        r.acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(r.xd[i] + b)), _mm256_cvtepi32_ps(p[i]), r.acc[i]);
    if constexpr (Packed32<T>::has_min) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + Packed32<T>::m)));
        for (int i = 0; i < R; i++) r.acc[i] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(r.xs[i] + b), r.acc[i]);
    }
}

// Outputs y[m0 .. m0 + R - 1, n .. n + 7] of a 32-value type in the repacked layout, n a
// group's first row: lane j of each vector is output n + j. Per block, 4 activation values
// broadcast to every lane meet 4 values of each of the 8 rows in one vpmaddubsw; the int16
// sums of a block stay exact (4-bit: 8 products of at most 15 * 127 per lane; Q5: 4 of 31 *
// 127 per partial sum), one vpmaddwd makes them the lane's int32 dot, and one fused
// multiply-add per row adds the block for 8 outputs: dot32's arithmetic, lane by lane. Q8_0
// is signed: vpsignb moves its signs onto x (|w| <= 128, so a pair stays in int16) and each
// vector's pairs are summed in int32. With V (AVX-VNNI), a row's products go straight into one
// int32 chain (dot4_vnni), Q8_0's weights made unsigned by an offset of 128 that is taken off
// with the others (kVnniShift): the same integers.
template <int T, int R, bool PF, bool V>
QG_AVX2 void group32_avx2(const Ctx& c, int64_t n, int64_t m0) {
    using L = Packed32<T>;
    const uint8_t* g = c.w + n * c.rb;
    GroupRows<T, R> r(c, m0);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb = g + b * L::group_bytes;
        if constexpr (PF) prefetch_group<T>(c, gb, L::group_bytes);
        __m256i p[R];
        if constexpr (V) {
            for (int i = 0; i < R; i++) p[i] = _mm256_setzero_si256();
            if constexpr (T == Q8_0) {
                for (int v = 0; v < 8; v++) {
                    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + L::qs + 32 * v)),
                                                       _mm256_set1_epi8(char(0x80)));
                    for (int i = 0; i < R; i++) p[i] = dot4_vnni(p[i], u, r.xq[i] + b * 32 + 4 * v);
                }
            } else {
                for (int v = 0; v < 4; v++) {
                    __m256i lo, hi;
                    group_nibbles<T>(gb, v, lo, hi);
                    for (int i = 0; i < R; i++) {
                        const int8_t* x = r.xq[i] + b * 32;
                        p[i] = dot4_vnni(p[i], lo, x + 4 * v);
                        p[i] = dot4_vnni(p[i], hi, x + 16 + 4 * v);
                    }
                }
            }
            group_add_block<T, R, kVnniShift<T>>(gb, r, b, p);
            continue;
        }
        if constexpr (T == Q8_0) {
            for (int i = 0; i < R; i++) p[i] = _mm256_setzero_si256();
            // Unrolled (GCC kept a loop of the 8 vectors at 5 and 6 rows): built for AVX2 on a 2-vCPU
            // Zen 5, one thread, in L2, cycles per 16 rows x 256 at 5 / 6 rows 965-1,015 / 1,100-1,182 ->
            // 899-939 / 1,070-1,115 (8 rows, unrolled before, alike). The same operations: the same bits.
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + L::qs + 32 * v));
                const __m256i aw = _mm256_sign_epi8(wv, wv);
                for (int i = 0; i < R; i++) {
                    p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(r.xq[i] + b * 32 + 4 * v), wv)), ones));
                    asm("" : "+x"(p[i]));
                }
            }
        } else {
            __m256i s0[R], s1[R];
            for (int i = 0; i < R; i++) s0[i] = s1[i] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                __m256i lo, hi;
                group_nibbles<T>(gb, v, lo, hi);
                for (int i = 0; i < R; i++) {
                    const int8_t* x = r.xq[i] + b * 32;
                    __m256i& s = L::has_qh && v >= 2 ? s1[i] : s0[i];
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo, bcast4(x + 4 * v)));
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi, bcast4(x + 16 + 4 * v)));
                    asm("" : "+x"(s));  // summed as it goes: a tree of the products spills registers
                }
            }
            for (int i = 0; i < R; i++) {
                p[i] = _mm256_madd_epi16(s0[i], ones);
                if constexpr (L::has_qh) p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(s1[i], ones));
            }
        }
        group_add_block<T, R, kOffsetShift<T>>(gb, r, b, p);
    }
    group_store(c, n, m0, R, r.acc);
}

// vpshufb patterns, per 32-bit lane (row) of a vector holding 4 bytes per row: byte k as two
// int16 (zero-extended: kByte16[k]; in the high halves, for an arithmetic shift to sign-extend
// it: kByteHi16[k]), and bytes k, k + 1 as an int16 pair (kPair16[k / 2]).
#define QG_LANES(a, b, c, d) a, b, c, d, 4 + a, 4 + b, 4 + c, 4 + d, 8 + a, 8 + b, 8 + c, 8 + d, 12 + a, 12 + b, 12 + c, 12 + d
alignas(32) const uint8_t kByte16[4][32] = {
#define QG_B(k) {QG_LANES(k, 0x80, k, 0x80), QG_LANES(k, 0x80, k, 0x80)}
    QG_B(0), QG_B(1), QG_B(2), QG_B(3),
#undef QG_B
};
alignas(32) const uint8_t kByteHi16[4][32] = {
#define QG_B(k) {QG_LANES(0x80, k, 0x80, k), QG_LANES(0x80, k, 0x80, k)}
    QG_B(0), QG_B(1), QG_B(2), QG_B(3),
#undef QG_B
};
alignas(32) const uint8_t kPair16[2][32] = {
    {QG_LANES(0, 0x80, 1, 0x80), QG_LANES(0, 0x80, 1, 0x80)}, {QG_LANES(2, 0x80, 3, 0x80), QG_LANES(2, 0x80, 3, 0x80)},
};
alignas(32) const uint8_t kByte32[4][32] = {  // byte k as the lane's int32, zero-extended
#define QG_B(k) {QG_LANES(k, 0x80, 0x80, 0x80), QG_LANES(k, 0x80, 0x80, 0x80)}
    QG_B(0), QG_B(1), QG_B(2), QG_B(3),
#undef QG_B
};
alignas(32) const uint8_t kByteHi32[4][32] = {  // byte k in the lane's top byte (an arithmetic shift sign-extends it)
#define QG_B(k) {QG_LANES(0x80, 0x80, 0x80, k), QG_LANES(0x80, 0x80, 0x80, k)}
    QG_B(0), QG_B(1), QG_B(2), QG_B(3),
#undef QG_B
};
#undef QG_LANES

QG_AVX2 inline __m256i pick_bytes(__m256i v, const uint8_t* pattern) {
    return _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(pattern)));
}

// The high bit of the 5-bit values of sub-block j, at bit 4 of each byte (Q5_K: bit j of qh).
QG_AVX2 inline __m256i qh_bit(__m256i h, int j) {
    const __m256i b = j < 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
    return _mm256_and_si256(b, _mm256_set1_epi8(16));
}

// The activation rows of a K-quant tile (row i is m0 + i): values, scales, and the sums per 32
// values (q8_K32) or Q6_K's offsets per 16 values as int16 pairs and as int32 (q8_K16: Ctx::po
// and Ctx::qo); what the format lacks is null.
template <int R>
struct KActs {
    const int8_t* xq[R];
    const float* xd[R];
    const int16_t* xb[R];
    const int16_t* xo[R];
    const int32_t* xqo[R];
    QG_AVX2 KActs(const Ctx& c, int64_t m0) {
        for (int i = 0; i < R; i++) {
            xq[i] = c.q + (m0 + i) * c.K;
            xd[i] = c.d + (m0 + i) * c.nb;
            xb[i] = c.bs ? c.bs + (m0 + i) * c.nb * kSums32 : nullptr;
            xo[i] = c.po ? c.po + (m0 + i) * c.nb * kPairs16 : nullptr;
            xqo[i] = c.qo ? c.qo + (m0 + i) * c.nb * kSums16 : nullptr;
        }
    }
};

// The 6-bit scales and mins of a Q4_K / Q5_K group block, 8 rows at once (kscales on 32-bit
// lanes): lane j of sc_lo holds row j's scales 0..3 as bytes, sc_hi 4..7; the same for the mins.
struct KScales {
    __m256i sc_lo, sc_hi, mn_lo, mn_hi;
    KScales() = default;
    QG_AVX2 explicit KScales(const uint8_t* sc) {
        const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc));
        const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32));
        const __m256i C = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 64));
        const __m256i m6 = _mm256_set1_epi8(0x3f), m2 = _mm256_set1_epi8(3), low = _mm256_set1_epi8(15);
        sc_lo = _mm256_and_si256(A, m6), mn_lo = _mm256_and_si256(B, m6);
        sc_hi = _mm256_or_si256(_mm256_and_si256(C, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(A, 6), m2), 4));
        mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), low),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(B, 6), m2), 4));
    }
    // sub-block j's scale as an int16 pair per lane (for vpmaddwd) / as the lane's int32
    QG_AVX2 __m256i scale16(int j) const { return pick_bytes(j < 4 ? sc_lo : sc_hi, kByte16[j & 3]); }
    QG_AVX2 __m256i scale32(int j) const { return pick_bytes(j < 4 ? sc_lo : sc_hi, kByte32[j & 3]); }
    // mins 2p and 2p + 1 as an int16 pair per lane (for vpmaddwd against the sums of x)
    QG_AVX2 __m256i min_pair16(int p) const { return pick_bytes(p < 2 ? mn_lo : mn_hi, kPair16[p & 1]); }
};

// Q4_K, Q5_K: each row's sum_j m_j * (the sum of x over sub-block j), the integer the mins take
// off (times dmin * d_x).
template <int R>
QG_AVX2 inline void k_min_sums(const KScales& ks, const KActs<R>& x, int64_t b, __m256i* ms) {
    const __m256i mp[4] = {ks.min_pair16(0), ks.min_pair16(1), ks.min_pair16(2), ks.min_pair16(3)};
    for (int i = 0; i < R; i++) {
        ms[i] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            ms[i] = _mm256_add_epi32(ms[i], _mm256_madd_epi16(mp[p], bcast4(reinterpret_cast<const int8_t*>(x.xb[i] + b * kSums32 + 2 * p))));
            asm("" : "+x"(ms[i]));
        }
    }
}

// 8 fp16 values at p (the group's d or dmin) as fp32.
QG_AVX2 inline __m256 load8_half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Q4_K, Q5_K: vector v of sub-block j as unsigned bytes (4 values of each of 8 rows).
template <int T>
QG_AVX2 inline __m256i k_weights(const uint8_t* gb, int j, int v) {
    using L = PackedK<T>;
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + L::qs + 32 * (8 * (j / 2) + v)));
    __m256i wv = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(15));
    if constexpr (T == Q5_K) wv = _mm256_or_si256(wv, qh_bit(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + L::qh + 32 * v)), j));
    return wv;
}

// Q6_K: the 16 int8 scales of 8 rows (vector w: row j's scales 4w..4w+3), and one as the
// lane's int16 pair / int32 (sign-extended).
struct Q6Scales {
    __m256i S[4];
    Q6Scales() = default;
    QG_AVX2 explicit Q6Scales(const uint8_t* gb) {
        for (int w = 0; w < 4; w++) S[w] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + PackedK<Q6_K>::q6_sc + 32 * w));
    }
    QG_AVX2 __m256i scale16(int g) const { return _mm256_srai_epi16(pick_bytes(S[g / 4], kByteHi16[g % 4]), 8); }
    QG_AVX2 __m256i scale32(int g) const { return _mm256_srai_epi32(pick_bytes(S[g / 4], kByteHi32[g % 4]), 24); }
};

// Q6_K: the 6-bit values 128h + 32t + 4v + (0..3) of 8 rows as unsigned bytes (0..63): for
// t < 3 the low 6 bits of vector (h, v, t), for t = 3 the top 2 bits of the three vectors
// (16-bit shifts; the masks drop what crosses from the neighbouring byte).
QG_AVX2 inline __m256i q6_weights(const uint8_t* gb, int h, int t, int v) {
    const __m256i* p = reinterpret_cast<const __m256i*>(gb + q6_vector(h, v, 0));
    if (t < 3) return _mm256_and_si256(_mm256_loadu_si256(p + t), _mm256_set1_epi8(63));
    const __m256i b01 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(p), 6), _mm256_set1_epi8(3));
    const __m256i b23 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(p + 1), 4), _mm256_set1_epi8(12));
    const __m256i b45 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(p + 2), 2), _mm256_set1_epi8(48));
    return _mm256_or_si256(_mm256_or_si256(b01, b23), b45);
}

// Each row's int16 sums of a run of weight vectors, times the run's scale (int16 pairs), into
// its int32 sum. In order, behind a barrier: left free, GCC kept all of a block's runs on the
// stack to add them as a tree at the end (a 4-row Q6_K tile spilled 128 vectors a block).
template <int R>
QG_AVX2 inline void add_scaled(__m256i* isum, const __m256i* s, __m256i s16) {
    for (int i = 0; i < R; i++) {
        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(s[i], s16));
        asm("" : "+x"(isum[i]));
    }
}
// The same for int32 sums (the AVX-VNNI tiles' chains): times the scale (int32 lanes) by vpmulld.
template <int R>
QG_AVX2 inline void add_scaled32(__m256i* isum, const __m256i* p, __m256i s32) {
    for (int i = 0; i < R; i++) {
        isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(p[i], s32));
        asm("" : "+x"(isum[i]));
    }
}

// K-quants in the repacked layout: outputs y[m0 .. m0 + R - 1, n .. n + 7] as dotk computes
// them, lane j of each vector output n + j. Per sub-block, 4 activation values broadcast to
// every lane meet 4 values of each of the 8 rows (vpmaddubsw, summed in int16 while exact:
// Q4_K 8 products of at most 15 * 127, Q5_K 4 of 31 * 127), then vpmaddwd by the row's scale
// makes the lane's int32; the mins take one vpmaddwd per two sub-blocks against the
// activations' sums. Q6_K sums a group's 4 vectors in int16 from the lane's offset on (po:
// -32 times the sum of its 8 activation values): at every step the sum is (w - 32) x over
// the values added and -32 x over the rest, 8 terms within +-32 * 127, so it stays exact.
// With V (AVX-VNNI), as groupk_avx512 does: a row's products of a sub-block (Q6_K: of a group of
// 16 values, from its -32 x sum(x), Ctx::qo, on) go into an int32 chain by dot4_vnni, two chains
// at once where the tile has 1 or 2 rows (to hide the instruction's latency) and one where its
// rows' sums must share the 16 registers, then vpmulld by the scale (add_scaled32).
template <int T, int R, bool PF, bool V>
QG_AVX2 void groupk_avx2(const Ctx& c, int64_t n, int64_t m0) {
    using L = PackedK<T>;
    constexpr int C = R <= 2 ? 2 : 1;  // V: the int32 chains a row keeps at once (two sub-blocks or groups)
    const uint8_t* g = c.w + n * c.rb;
    const KActs<R> x(c, m0);
    __m256 acc[R];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb = g + b * L::group_bytes;
        // (1-row tiles only: with the prefetches in its steps GCC no longer unrolled Q5_K's 4-row one)
        constexpr bool spread = !V && R == 1 && kSpreads<T, 1, PF>;
        if constexpr (PF && !spread) prefetch_group<T>(c, gb, L::group_bytes);
        const uint8_t* lines_at[1];
        if constexpr (spread) {
            step_side(c);
            spread_bases<1>(c, &gb, lines_at);
        }
        __m256i isum[R];
        for (int i = 0; i < R; i++) isum[i] = _mm256_setzero_si256();
        __m256 dv;
        if constexpr (T == Q6_K && V) {  // each chain from its group's -32 x sum(x) on (Ctx::qo)
            const Q6Scales sc(gb);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++)  // values 128h + 32t + 4v + (0..3): groups 8h + 2t (v < 4), 8h + 2t + 1
#pragma GCC unroll 2
                    for (int half0 = 0; half0 < 2; half0 += C) {  // groups 8h + 2t + half0 .. + C - 1 at once
                        const int group = 8 * h + 2 * t + half0;
                        __m256i p[C][R];
                        for (int k = 0; k < C; k++)
                            for (int i = 0; i < R; i++) p[k][i] = _mm256_set1_epi32(x.xqo[i][kSums16 * b + group + k]);
#pragma GCC unroll 4
                        for (int u = 0; u < 4; u++)
                            for (int k = 0; k < C; k++) {
                                const int v = 4 * (half0 + k) + u;
                                const __m256i w = q6_weights(gb, h, t, v);
                                for (int i = 0; i < R; i++) p[k][i] = dot4_vnni(p[k][i], w, x.xq[i] + b * QK + 128 * h + 32 * t + 4 * v);
                            }
                        for (int k = 0; k < C; k++) add_scaled32<R>(isum, p[k], sc.scale32(group + k));
                    }
            dv = load8_half(gb + L::q6_d);
        } else if constexpr (T == Q6_K) {
            const Q6Scales sc(gb);
            // (unrolled: the shifts take immediate counts)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++)  // values 128h + 32t + 4v + (0..3): groups 8h + 2t (v < 4), 8h + 2t + 1
#pragma GCC unroll 2
                    for (int half = 0; half < 2; half++) {
                        const int group = 8 * h + 2 * t + half;
                        __m256i s[R];  // from the offset on
                        for (int i = 0; i < R; i++) s[i] = bcast4(reinterpret_cast<const int8_t*>(x.xo[i] + b * kPairs16 + 2 * group));
#pragma GCC unroll 4
                        for (int u = 0; u < 4; u++) {
                            const int v = 4 * half + u;
                            if constexpr (spread) prefetch_share<L::group_bytes, 1, 64>(lines_at, 32 * h + 8 * t + v);
                            const __m256i wv = q6_weights(gb, h, t, v);
                            for (int i = 0; i < R; i++) {
                                s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(wv, bcast4(x.xq[i] + b * QK + 128 * h + 32 * t + 4 * v)));
                                asm("" : "+x"(s[i]));
                            }
                        }
                        add_scaled<R>(isum, s, sc.scale16(group));
                    }
            dv = load8_half(gb + L::q6_d);
        } else {
            const KScales ks(gb + L::sc);
            {  // the mins first: -(dmin * d_x) * their integer
                __m256i ms[R];
                k_min_sums(ks, x, b, ms);
                const __m256 dmv = load8_half(gb + 16);
                for (int i = 0; i < R; i++)
                    acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmv, _mm256_broadcast_ss(x.xd[i] + b)), _mm256_cvtepi32_ps(ms[i]), acc[i]);
            }
            if constexpr (V) {
#pragma GCC unroll 8
                for (int j0 = 0; j0 < 8; j0 += C) {  // sub-blocks j0 .. j0 + C - 1 at once
                    __m256i p[C][R];
                    for (int k = 0; k < C; k++)
                        for (int i = 0; i < R; i++) p[k][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int v = 0; v < 8; v++)
                        for (int k = 0; k < C; k++) {
                            const __m256i w = k_weights<T>(gb, j0 + k, v);
                            for (int i = 0; i < R; i++) p[k][i] = dot4_vnni(p[k][i], w, x.xq[i] + b * QK + 32 * (j0 + k) + 4 * v);
                        }
                    for (int k = 0; k < C; k++) add_scaled32<R>(isum, p[k], ks.scale32(j0 + k));
                }
            } else
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {  // (unrolled: qh_bit's shifts take immediate counts)
                const __m256i s16 = ks.scale16(j);
                constexpr int run = T == Q5_K ? 4 : 8;  // weight vectors whose int16 sums stay exact
                for (int v0 = 0; v0 < 8; v0 += run) {
                    __m256i s[R];
                    for (int i = 0; i < R; i++) s[i] = _mm256_setzero_si256();
                    for (int v = v0; v < v0 + run; v++) {
                        if constexpr (spread) prefetch_share<L::group_bytes, 1, 64>(lines_at, 8 * j + v);
                        const __m256i wv = k_weights<T>(gb, j, v);
                        for (int i = 0; i < R; i++) {
                            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(wv, bcast4(x.xq[i] + b * QK + 32 * j + 4 * v)));
                            asm("" : "+x"(s[i]));
                        }
                    }
                    add_scaled<R>(isum, s, s16);
                }
            }
            dv = load8_half(gb);
        }
        for (int i = 0; i < R; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_broadcast_ss(x.xd[i] + b)), _mm256_cvtepi32_ps(isum[i]), acc[i]);
    }
    group_store(c, n, m0, R, acc);
}

// 8 values of a float type's row (F32, F16, BF16) from value k on, as fp32.
template <int T>
QG_AVX2 inline __m256 load8_float(const uint8_t* w, int64_t k) {
    if constexpr (T == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k));
    if constexpr (T == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

// F32 / F16 / BF16: 16 lanes (k mod 16) of fused multiply-adds per output, as dot16.
template <int T, int R, bool PF>
QG_AVX2 void tile16_avx2(const Ctx& c, int64_t n, int64_t m0) {
    constexpr int64_t size = block_bytes(T);
    const uint8_t* w = c.w + n * c.rb;
    const int64_t K = c.K;
    const float* x[R];
    __m256 a0[R], a1[R];
    for (int i = 0; i < R; i++) {
        x[i] = c.x + (m0 + i) * K;
        a0[i] = a1[i] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (PF && k % (64 / size) == 0) __builtin_prefetch(w + size * k + kPrefetch, 0, kPrefetchLocality);
        const __m256 w0 = load8_float<T>(w, k), w1 = load8_float<T>(w, k + 8);
        for (int i = 0; i < R; i++) {
            a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k), w0, a0[i]);
            a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k + 8), w1, a1[i]);
        }
    }
    if (k < K) {  // the tail, zero-padded to 16
        alignas(32) uint8_t wt[16 * size] = {};
        alignas(32) float xt[16] = {};
        std::memcpy(wt, w + size * k, (K - k) * size);
        const __m256 w0 = load8_float<T>(wt, 0), w1 = load8_float<T>(wt, 8);
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

template <int T, int R, bool PF, bool V>
QG_AVX2 void tile_avx2(const Ctx& c, int64_t n, int64_t m0) {
    if constexpr (interleave_of(T) == kGroup && block_values(T) == 32) group32_avx2<T, R, PF, V>(c, n, m0);
    else if constexpr (interleave_of(T) == kGroup) groupk_avx2<T, R, PF, V>(c, n, m0);
    else tile16_avx2<T, R, PF>(c, n, m0);
}

// The most activation rows one tile takes (16 ymm registers hold the sums of few), as measured:
// one thread, weights in L2, ns per 8 weight rows x a block, a Zen 4 built for AVX2. 5 rows in
// one tile against a 4-row and a 1-row one: Q4_K 78 / 92, Q5_K 104-114 / 124-129, Q6_K 96-101 /
// 117, Q4_0 10.9-11.2 / 12.7-13.2, Q4_1 11.0 / 12.8, Q8_0 19.8 / 20.8; 6 rows against 4 + 2: Q5_K
// 121-128 (once 145) / 139-145, Q6_K 114-122 / 130-135, Q4_1 12.8-13.1 / 14.6-14.7, Q4_K 103-107 /
// 105-106. Q5_0's tile (two chains of sums a row) spilled at 5 rows (21.3-22.0 against 20.9-21.1),
// and Q5_1's (two a row too) keeps 4. The floats' tiles (two accumulators a row), ns per weight
// row of 1536: 5 rows F32 224-230 against 242-255, F16 181-184 against 218-220, BF16 184-185
// against 226-242; 6 rows F16 243-336 against 235-237. At 7 rows one tile gains nothing (Q4_K 118
// against 4 + 3: 117).
// The AVX-VNNI tiles (V): a row's sums are one int32 chain (two where R <= 2), and every block type
// takes a whole call of the driver's, kTileRows (8), in one tile: from 5 rows (the K-quants: a
// chain, the block's total and the accumulator a row) or 7 (the 32-value types) some sums spill,
// and still one pass over each group beats two (4 + 1 .. 4 + 4), which decode the group's scales
// and weights twice. On a 2-vCPU Xeon (Emerald Rapids, built with -mno-avx512f), one thread,
// prefetched, cycles per 8 weight rows x 256 values x row, one tile against two passes, in L2 (512
// rows of 1536) / streamed (65536): Q4_K 5 rows 58-60 / 60-61 against 74 / 59-78 (4 + 1), 6 rows
// 57-58 / 60-61 against 68 / 71-72, 7 rows 56-59 / 56-58 against 64 / 65-67, 8 rows 55 / 48-56
// against 63-64 / 64-66; Q5_K 5 rows 72-74 / 66-78 against 101-105 / 105-107, 8 rows 62-64 / 63-67
// against 81 / 84; Q6_K 6 rows 70-71 / 77-79 against 91-92 / 99-106, 8 rows 71-72 / 62-80 against
// 79-81 / 70-92. The 32-value types, per 8 weight rows x 32 values x row, 8 rows against 4 + 4 and
// 7 against 4 + 3: in L2 Q4_0 6.6 / 7.2-7.3 and 6.4-6.7 / 7.5-7.7, Q4_1 6.5-6.7 / 7.4-7.7 and 6.4 /
// 7.1, Q5_0 8.8 / 10.2-10.4 and 8.4-8.7 / 11.0-11.3, Q5_1 8.2-8.4 / 9.5-9.9 and 7.0-7.7 / 9.3-10.4,
// Q8_0 6.1-6.5 / 7.4-7.6 and 6.2-6.3 / 7.0-7.2; streamed (141 MB) 0.62-0.92x the time. The default
// model's weights on two threads, streamed, builds alternating: at 7 and 8 rows Q4_1 1536 x 576 ran
// at 1.08-1.15x the rate, the Q8_0 head 1.09-1.20x; its 8-row forward (`bench verify --rows 1,8
// --prompt-len 128`) 6.35-6.49 -> 5.88-6.02 ms.
template <int T, bool V>
constexpr int kTileRowsAvx2 = V ? kTileRows
                              : T == Q5_0 || T == Q5_1 ? 4
                              : T == F32 || T == F16 || T == BF16 ? 5 : 6;

// The tiles of rows m0 .. m0 + mt - 1 over outputs n ..: split_rows with tile_avx2.
template <int T, bool PF, bool V>
struct Avx2Tile {
    const Ctx& c;
    int64_t n;
    template <int R>
    QG_AVX2 void run(int64_t m) const { tile_avx2<T, R, PF, V>(c, n, m); }
};
template <int T, bool PF, bool V>
QG_AVX2 void tiles_avx2(const Ctx& c, int64_t n, int64_t m0, int mt) {
    split_rows<kTileRowsAvx2<T, V>>(Avx2Tile<T, PF, V>{c, n}, m0, mt);
}

// Outputs y[m0 .. m0 + mt - 1, n .. n + cols - 1]. A repacked group takes all 8 of its rows
// at once; rows of a repacked type left as stored (a weight's last N % 8) run the portable
// dot. Decode sizes prefetch (a template flag: the branch alone slowed the prefill tiles by 25%).
// V: the AVX-VNNI path's block kernels (only for the types avxvnni_has lists).
template <int T, bool V = false>
QG_AVX2 void rows_avx2(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if constexpr (interleave_of(T) == kGroup) {
        for (int64_t g = n; g < n + cols; g += kGroup) {
            if (g >= c.grouped) return rows_portable_grouped<T>(c, g, int(n + cols - g), m0, mt);
            c.stream ? tiles_avx2<T, true, V>(c, g, m0, mt) : tiles_avx2<T, false, V>(c, g, m0, mt);
        }
        return;
    }
    for (int j = 0; j < cols; j++)
        c.stream ? tiles_avx2<T, true, V>(c, n + j, m0, mt) : tiles_avx2<T, false, V>(c, n + j, m0, mt);
}

// The 8-bit dot peak of one thread on this path (the roofline's denominator for block
// formats): `reps` rounds of 8 independent u8 x s8 multiply-add chains, as the kernels issue
// them (maddubs, madd to int32, add; V, the AVX-VNNI path: vpdpbusd). Returns the integer
// operations done, 2 per product; the emulated vpdpbusd (QG_EMULATE_AVX512) measures nothing of
// the machine: -1, no probe.
template <bool V>
QG_AVX2 __attribute__((noinline)) int64_t dot_peak_avx2(int64_t reps) {
#if defined(QG_EMULATE_AVX512)
    if constexpr (V) return -1;
#endif
    __m256i a = _mm256_set1_epi8(1), acc[8], b[8];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 8; j++) {
        acc[j] = _mm256_setzero_si256();
        b[j] = _mm256_set1_epi8(char(j + 1));
    }
    for (int64_t r = 0; r < reps; r++) {
        asm("" : "+x"(a));  // a new operand each round: nothing is hoisted out of the loop
        for (int j = 0; j < 8; j++)
            acc[j] = V ? dpbusd_vnni(acc[j], a, b[j]) : _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[j]), ones));
    }
    __m256i s = acc[0];
    for (int j = 1; j < 8; j++) s = _mm256_add_epi32(s, acc[j]);
    volatile int32_t sink = _mm256_extract_epi32(s, 0);
    (void)sink;
    return reps * 8 * 32 * 2;
}

// One row of activations quantised in blocks of B values (32 or 256), as quant_gemm.cpp's
// quantize_row defines it, 8 values a vector: max|x| as the integer max of the values' bits, then
// in every lane the same IEEE steps (id = 127 / max|x|, 0 where max|x| is not above 0; x * id,
// clamped to +-127 by minps and maxps in std::min's and std::max's operand order, so a NaN
// becomes 127 as there; rounded by vcvtps2dq in the current rounding mode, as nearbyint is:
// rounding and clamping commute within +-127). The sums of q are exact integers in any order.
// The same bits as quantize_row for every input: the kernel tests compare the two on ties, zeros,
// subnormal blocks and values near fp32's largest, and a harness did on NaN and infinities too;
// 1.4-2.8x its speed on a Xeon (Emerald Rapids), 0.6-1.0 cycles a value against
// 1.0-2.6 (one thread, K = 1536; the K-quants' formats gain least).
template <int B>
QG_AVX2 void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* xsum, int16_t* bs,
                               int16_t* po, int32_t* qo) {
    const __m256i abs_bits = _mm256_set1_epi32(0x7fffffff), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
    for (int64_t b = 0; b < K / B; b++) {
        const float* xb = x + b * B;
        int8_t* qb = q + b * B;
        __m256i m = _mm256_setzero_si256();
        for (int i = 0; i < B; i += 8)
            m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + i)), abs_bits));
        m = _mm256_max_epu32(m, _mm256_permute2x128_si256(m, m, 1));
        m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0x4e));
        const __m256 amax = _mm256_castsi256_ps(_mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0xb1)));  // in every lane
        const __m256 id = _mm256_and_ps(_mm256_div_ps(top, amax), _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ));
        d[b] = _mm256_cvtss_f32(amax) * (1.f / 127.f);
        int32_t total = 0;
        for (int j = 0; j < B; j += 32) {
            __m256i v[4];
            for (int k = 0; k < 4; k++)
                v[k] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * k), id), top), bottom));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + j), _mm256_permutevar8x32_epi32(p, order));
            // per 16 values, the sums of those at 0, 1, 4, 5, 8, 9, 12, 13 and at 2, 3, 6, 7, ..., 15
            const __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
            const __m128i pairs = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            const __m128i two = _mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0x4e));
            const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 0xb1)));
            total += sum;
            if (bs) bs[b * kSums32 + j / 32] = int16_t(sum);
            if (po || qo) {
                alignas(16) int32_t pr[4];
                _mm_store_si128(reinterpret_cast<__m128i*>(pr), pairs);
                for (int g = 0; g < 2; g++) {
                    const int64_t i = b * kSums16 + j / 16 + g;
                    if (po) po[2 * i] = int16_t(-32 * pr[2 * g]), po[2 * i + 1] = int16_t(-32 * pr[2 * g + 1]);
                    if (qo) qo[i] = -32 * (pr[2 * g] + pr[2 * g + 1]);
                }
            }
        }
        if (s) s[b] = d[b] * float(total);
        if (xsum) xsum[b] = total;
    }
}

// The types this path has kernels for; on this path any other type runs its portable dot.
constexpr bool avx2_has(int t) {
    return t == F32 || t == F16 || t == BF16 || t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K ||
           t == Q5_K || t == Q6_K;
}

// The types the AVX-VNNI path has its own kernels for: AVX2's block types with a repacked layout
// (their tiles with V); it runs the AVX2 kernels of the rest.
constexpr bool avxvnni_has(int t) { return avx2_has(t) && interleave_of(t) == kGroup; }

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

// The AVX2 path's features and AVX-VNNI (cpuid leaf 7, subleaf 1, eax bit 4). In the tests' build
// without the CPU's AVX-512 (QG_EMULATE_AVX512) dot4_vnni is AVX2 code, so any AVX2 CPU runs it.
bool have_avxvnni() {
#if defined(QG_EMULATE_AVX512)
    return have_avx2();
#else
    static const bool ok = [] {
        unsigned a, b, c, d;
        return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
    }();
    return ok && have_avx2();
#endif
}

}  // namespace
