// The AVX-512 path (F, BW, VL and VNNI): kernels for the types avx512_has lists; on this path
// the driver runs the AVX2 kernel of any other type that has one (quant/x86_avx2.h, which this
// file builds on), else its portable dot. Target attributes again, so it builds anywhere x86.
#pragma once
#include <cstdint>

#include "kernel.h"
#include "types.h"
#include "x86_avx2.h"

#if defined(QG_EMULATE_AVX512)  // the AVX-512 path through SIMDe's portable intrinsics (tests)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#endif

namespace {

// The 32-value block types with vpdpbusd (u8 x s8, four products summed into an int32, no
// saturation), two blocks per 512-bit vector; the K-quants, F16 and BF16 run their AVX2 kernels.
// The integers are the AVX2 path's: a weight is made unsigned by a bias (u = w + 8 for Q4_0, 16
// for Q5_0, 128 for Q8_0; Q4_1 and Q5_1 are unsigned already) and bias * (sum of x over the
// four) is taken off, so each lane's integer is the same sum of w * x; the float operations
// are the AVX2 path's one by one, in the same order. So the paths agree bit for bit.
//
// Built with -DQG_EMULATE_AVX512 (and SIMDe's headers) the same code runs on any x86 CPU
// through SIMDe's portable intrinsics: how the tests check it on CPUs without AVX-512.
#if defined(QG_EMULATE_AVX512)
#define QG_AVX512 QG_AVX2
#else
#define QG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

template <int T>
constexpr int kBiasShift = T == Q4_0 ? 3 : T == Q5_0 ? 4 : T == Q8_0 ? 7 : -1;  // log2 of the bias; -1: none

// A 32-block's values as unsigned bytes w + bias, in element order.
template <int T>
QG_AVX512 inline __m256i load32u(const uint8_t* b) {
    if constexpr (T == Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_epi8(char(0x80)));
    if constexpr (T == Q4_0) return nibbles(b + 2);
    if constexpr (T == Q4_1) return nibbles(b + 4);
    if constexpr (T == Q5_0) return _mm256_or_si256(nibbles(b + 6), _mm256_and_si256(bit_bytes(b + 2), _mm256_set1_epi8(16)));
    if constexpr (T == Q5_1) return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bit_bytes(b + 4), _mm256_set1_epi8(16)));
}

// tile32_avx2's outputs and arithmetic; blocks b and b + 1 share one vpdpbusd per x row.
template <int T, int R, int C, bool PF>
QG_AVX512 void tile32_avx512(const Ctx& c, int64_t n, int64_t m0) {
    constexpr int64_t size = block_bytes(T);
    constexpr bool has_min = T == Q4_1 || T == Q5_1;
    constexpr int shift = kBiasShift<T>;
    const uint8_t* w = c.w + n * c.rb;
    const int8_t* xq[R];
    const float *xd[R], *xs[R];
    __m256 acc[C][R];
    __m128 mins[C][R];
    tile32_start<T, R, C>(c, m0, xq, xd, xs, acc, mins);
    // One block's contribution to output (j, i) from its exact integers p, as tile32_avx2 adds it.
    auto add = [&](int j, int i, __m256 dw, __m128 mw, __m256 xdb, __m128 xsb, __m256i p) QG_AVX512 {
        acc[j][i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, xdb), _mm256_cvtepi32_ps(p), acc[j][i]);
        if constexpr (has_min) mins[j][i] = _mm_fmadd_ss(mw, xsb, mins[j][i]);
    };
    const __m512i ones8 = _mm512_set1_epi8(1);
    int64_t b = 0;
    for (; b + 2 <= c.nb; b += 2) {
        __m512i xv[R], xoff[R];  // two blocks of each x row, and bias * (its sums of four)
        for (int i = 0; i < R; i++) {
            xv[i] = _mm512_loadu_si512(xq[i] + b * 32);
            if constexpr (shift >= 0) xoff[i] = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones8, xv[i]), shift);
        }
        for (int j = 0; j < C; j++) {
            const uint8_t* blk = w + j * c.rb + b * size;
            if constexpr (PF) {
                _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(blk + size + kPrefetch), _MM_HINT_T0);
            }
            __m256 dw0, dw1;
            __m128 mw0, mw1;
            block_scales<T>(blk, dw0, mw0);
            block_scales<T>(blk + size, dw1, mw1);
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(load32u<T>(blk)), load32u<T>(blk + size), 1);
            for (int i = 0; i < R; i++) {
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv[i]);
                if constexpr (shift >= 0) p = _mm512_sub_epi32(p, xoff[i]);
                const __m128 xs0 = has_min ? _mm_load_ss(xs[i] + b) : _mm_setzero_ps();
                const __m128 xs1 = has_min ? _mm_load_ss(xs[i] + b + 1) : _mm_setzero_ps();
                add(j, i, dw0, mw0, _mm256_broadcast_ss(xd[i] + b), xs0, _mm512_castsi512_si256(p));
                add(j, i, dw1, mw1, _mm256_broadcast_ss(xd[i] + b + 1), xs1, _mm512_extracti64x4_epi64(p, 1));
            }
        }
    }
    if (b < c.nb) {  // an odd last block: the same integers, 256 bits wide
        const __m256i ones8h = _mm256_set1_epi8(1);
        for (int j = 0; j < C; j++) {
            const uint8_t* blk = w + j * c.rb + b * size;
            __m256 dw;
            __m128 mw;
            block_scales<T>(blk, dw, mw);
            const __m256i u = load32u<T>(blk);
            for (int i = 0; i < R; i++) {
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + b * 32));
                __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
                if constexpr (shift >= 0)
                    p = _mm256_sub_epi32(p, _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones8h, x), shift));
                add(j, i, dw, mw, _mm256_broadcast_ss(xd[i] + b), has_min ? _mm_load_ss(xs[i] + b) : _mm_setzero_ps(), p);
            }
        }
    }
    tile32_store<T, R, C>(c, n, m0, acc, mins);
}

template <int T, bool PF>
QG_AVX512 void tiles32_avx512(const Ctx& c, int64_t n, int64_t m0, int mt) {
    switch (mt) {
        case 4: tile32_avx512<T, 4, 1, PF>(c, n, m0); break;
        case 3: tile32_avx512<T, 3, 1, PF>(c, n, m0); break;
        case 2: tile32_avx512<T, 2, 1, PF>(c, n, m0); break;
        default: tile32_avx512<T, 1, 1, PF>(c, n, m0); break;
    }
}
// rows_avx2's work split, with the 32-block tiles above.
template <int T>
QG_AVX512 void rows_avx512(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if (!c.stream) {
        for (int j = 0; j < cols; j++) tiles32_avx512<T, false>(c, n + j, m0, mt);
        return;
    }
    if (mt == 1) {
        if (T == Q8_0 && cols == 8) return tile32_avx512<T, 1, 8, true>(c, n, m0);
        for (; cols >= 4; cols -= 4, n += 4) tile32_avx512<T, 1, 4, true>(c, n, m0);
        for (; cols >= 2; cols -= 2, n += 2) tile32_avx512<T, 1, 2, true>(c, n, m0);
    }
    for (int j = 0; j < cols; j++) tiles32_avx512<T, true>(c, n + j, m0, mt);
}

// The types this path has kernels for (the 32-value block types).
constexpr bool avx512_has(int t) { return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0; }

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
        asm("" : "+v"(a));
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
