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

// The 32-value block types in the repacked layout with vpdpbusd on 256-bit vectors (u8 x s8,
// four products summed into an int32 lane, no saturation): group32_avx2's outputs, lanes and
// integers, without its int16 steps. A weight is made unsigned by an offset (u = w + 8 for
// Q4_0, 16 for Q5_0, 128 for Q8_0; Q4_1 and Q5_1 are unsigned already) and offset * (the
// block's sum of x) is taken off, so each lane's integer is the same sum of w * x; the float
// operations are the AVX2 path's one by one, in the same order. So the paths agree bit for bit.
//
// Built with -DQG_EMULATE_AVX512 (and SIMDe's headers) the same code runs on any x86 CPU
// through SIMDe's portable intrinsics: how the tests check it on CPUs without AVX-512.
#if defined(QG_EMULATE_AVX512)
#define QG_AVX512 QG_AVX2
#else
#define QG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

// log2 of the offset taken off: group32_avx2's, and Q8_0's 128
template <int T>
constexpr int kVnniShift = T == Q8_0 ? 7 : kOffsetShift<T>;

template <int T, int R, bool PF>
QG_AVX512 void group32_avx512(const Ctx& c, int64_t n, int64_t m0) {
    using L = Packed32<T>;
    const uint8_t* g = c.w + n * c.rb;
    GroupRows<T, R> r(c, m0);
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb = g + b * L::group_bytes;
        if constexpr (PF) prefetch_ahead(gb, L::group_bytes);
        __m256i p[R];
        for (int i = 0; i < R; i++) p[i] = _mm256_setzero_si256();
        if constexpr (T == Q8_0) {
            for (int v = 0; v < 8; v++) {
                const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + L::qs + 32 * v)),
                                                   _mm256_set1_epi8(char(0x80)));
                for (int i = 0; i < R; i++) p[i] = _mm256_dpbusd_epi32(p[i], u, bcast4(r.xq[i] + b * 32 + 4 * v));
            }
        } else {
            for (int v = 0; v < 4; v++) {
                __m256i lo, hi;
                group_nibbles<T>(gb, v, lo, hi);
                for (int i = 0; i < R; i++) {
                    const int8_t* x = r.xq[i] + b * 32;
                    p[i] = _mm256_dpbusd_epi32(p[i], lo, bcast4(x + 4 * v));
                    p[i] = _mm256_dpbusd_epi32(p[i], hi, bcast4(x + 16 + 4 * v));
                }
            }
        }
        group_add_block<T, R, kVnniShift<T>>(gb, r, b, p);
    }
    group_store(c, n, m0, R, r.acc);
}

template <int T, bool PF>
QG_AVX512 void groups32_avx512(const Ctx& c, int64_t n, int64_t m0, int mt) {
    switch (mt) {
        case 4: group32_avx512<T, 4, PF>(c, n, m0); break;
        case 3: group32_avx512<T, 3, PF>(c, n, m0); break;
        case 2: group32_avx512<T, 2, PF>(c, n, m0); break;
        default: group32_avx512<T, 1, PF>(c, n, m0); break;
    }
}

// rows_avx2's work split, with the groups above.
template <int T>
QG_AVX512 void rows_avx512(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if (n >= c.grouped) return rows_portable_grouped<T>(c, n, cols, m0, mt);
    return c.stream ? groups32_avx512<T, true>(c, n, m0, mt) : groups32_avx512<T, false>(c, n, m0, mt);
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
