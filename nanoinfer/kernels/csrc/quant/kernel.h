// What every kernel of every path sees: the work of one call (Ctx), one activation row as a
// type's dot takes it (ActsRow), and the scalar pieces whose exact behaviour the paths share:
// fp16/bf16 conversion, fused multiply-add, and sums the optimiser may not regroup.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../side_prefetch.h"

#if defined(__x86_64__) || defined(__i386__)
#define QG_X86 1
#endif

namespace {

constexpr int64_t QK = 256;      // values per K-quant block
// How far ahead of the block it reads a decode-sized call prefetches the weights (bytes; the
// rows of a chunk are contiguous, so this runs into the rows that follow). The hardware
// prefetcher alone left batch-1 decode at 11-15 GB/s of a memory that streams 19; 8 KiB
// ahead measured best on Zen 3 (2 KiB: +12%, 8 KiB: +25% tok/s, 32 KiB: worse again).
constexpr int64_t kPrefetch = 8192;
// The same where a thread streams one repacked group at a time (the AVX2 tiles and the AVX-512
// tiles of one group; those of two prefetch one call ahead: x86_avx512.h's group_blocks). The
// kernels are built for the CPU they run on and cpu_kernels.py sets QG_PREFETCH_ONE_GROUP by
// vendor: on Intel (a 2-vCPU Xeon, batch-1 decode) 8 -> 24 KiB took Qwen2.5-Coder 1.5B Q4_K_M's
// step from 66 to 52 ms and Gemma 3 270M's and Qwen2.5-Coder 0.5B's 10-16% down; AMD keeps Zen
// 3's 8 KiB. (Read from the Ctx at run time instead, this distance cost the AVX-512 tiles up to
// 15% at batch 8: registers. The two-group tiles' distance, one call, comes from the Ctx's row
// bytes, and measured faster all the same.)
#ifndef QG_PREFETCH_ONE_GROUP
#define QG_PREFETCH_ONE_GROUP 8192
#endif
constexpr int64_t kPrefetchOneGroup = QG_PREFETCH_ONE_GROUP;
// The types whose one-group streams are left to the hardware prefetcher alone: a bit per GGML
// type id. cpu_kernels.py sets Q8_0's and Q4_K's on Zen 4 (AMD family 25 with AVX-512), where
// the software prefetch above held their streams back. A 2-vCPU Zen 4, one activation row, each
// type's weights of a file repacked and streamed on two threads, no prefetch against 8 KiB
// ahead (paired medians of one process, alternating): Q4_K 1.08-1.12x (Qwen2.5-Coder 1.5B's and
// 0.5B's, Gemma 3 270M's), Q8_0 1.04-1.10x (0.5B's, SmolLM2's); and it left Q6_K 0.82-0.95x, Q4_0
// 0.94x, Q4_1 and Q5_0 0.97x, so they keep it. The KV side ranges (side_prefetch.h) still step.
#ifndef QG_UNPREFETCHED_TYPES
#define QG_UNPREFETCHED_TYPES 0
#endif
template <int T>
constexpr bool kHardwarePrefetched = (uint64_t(QG_UNPREFETCHED_TYPES) >> T) & 1;
// Where the streamed weights are prefetched to: __builtin_prefetch's locality, 3 into L1 (x86's
// prefetcht0), 2 into L2 (prefetcht1). cpu_kernels.py sets QG_PREFETCH_LOCALITY=2 on AMD family
// 25. On a 2-vCPU Zen 4 a prefetch into L1 holds one of the core's few L1 miss buffers until
// its line arrives, and the stream stalled on them: into L2, linears of 1.5B-sized weights
// cycled past the L3 ran at 1 row 1.86x (Q6_K: 16 -> 28 GB/s) and 1.27x (Q4_K) faster on the
// AVX-512 path, 1.58x and 1.34x on the AVX2 path; at 4 rows 1.73x and 1.39x, 1.32x and 1.07x.
#ifndef QG_PREFETCH_LOCALITY
#define QG_PREFETCH_LOCALITY 3
#endif
constexpr int kPrefetchLocality = QG_PREFETCH_LOCALITY;
// Two-level prefetch of the streams of one repacked group at a time (x86_avx2.h's
// prefetch_group: the AVX2 and AVX-VNNI tiles), where set (bytes; cpu_kernels.py sets 4096 on
// Intel): the far lines go into L2 only, and the lines this many bytes ahead into L1. On a
// 2-vCPU Xeon (Emerald Rapids) the far prefetch into L1 held the core's L1 miss buffers for a
// memory's latency each, and a thread's stream stalled on them; from L2 the near ones arrive in
// time. `bench verify` 1 / 4 rows, ms, builds alternating: AVX2 path, Qwen2.5-Coder 1.5B Q4_K_M
// 38.7-40.8 -> 32.1-32.5 / 49.9-54.1 -> 44.1-44.3, 0.5B 18.0-18.8 -> 15.5-16.3 / 23.7-24.1 ->
// 22.2-23.6, Gemma 3 270M 9.4-9.6 -> 8.7-8.9 / 12.2-12.9 -> 12.3-12.5; AVX-VNNI, the 1.5B
// 42.2-42.7 -> 35.4 / 55.3-55.5 -> 48.4-49.4. Near 2, 4 or 8 KiB ran alike; the far lines into
// L2 without the near ones, or both into L1, gained nothing. The AVX-512 tiles of two groups (one
// call ahead) took the same: the 1.5B's step ran 3-9% faster, Gemma 3 270M's and the 0.5B's
// decode 9-26% slower, so they keep one prefetch into L1 (docs/benchmarks.md, "The same Xeon, a
// ninth session").
#ifndef QG_PREFETCH_NEAR
#define QG_PREFETCH_NEAR 0
#endif
constexpr int64_t kPrefetchNear = QG_PREFETCH_NEAR;
// Whether the K-quant tiles spread a block's prefetches over its steps, a line or two a step
// (x86_avx2.h's kSpreadPrefetch), instead of issuing them together as the block starts: 36 lines
// at once for a Q4_K block of two groups, 54 for Q6_K's. cpu_kernels.py sets it on AMD family 26.
// On a 2-vCPU EPYC (Zen 5, family 26 model 2) the 16-row tiles of 2 and 3 rows streamed Q4_K at
// half the rate of one row's narrow tiles, slower than 4 rows did (one thread, the 1.5B's 56 Q4_K
// weights 8960 x 1536, ms at 1 / 2 / 3 / 4 / 5 / 8 rows: 12.2 / 28.3 / 33.9 / 15.0 / 39.2 / 42.1 ->
// 11.9 / 13.1 / 13.0 / 12.4 / 17.7 / 24.5), whatever the distance or cache the burst went to.
// End to end (Qwen2.5-Coder 1.5B Q4_K_M, rows of one sequence at position 512, builds loaded in
// one process, alternating, ms at 1 / 2 / 3 / 4 / 8 rows): in the host's slow memory state 23.5 /
// 29.9 / 31.9 / 28.2 / 35.9 -> 22.1 / 23.7 / 24.1 / 24.1 / 32.9, in its fast one 17.2 / 24.2 /
// 26.2 / 20.6 / 35.8 -> 15.1 / 17.9 / 20.0 / 19.5 / 35.4; the 0.5B, Gemma 3 270M and SmolLM2
// Q4_K_M alike or up to 5% faster. The AVX2 path spreads them in its 1-row tiles only (its 4-row
// Q4_K and Q5_K tiles were no longer unrolled with them): the 1.5B's 1-row forward there 17.0-17.5
// -> 15.4-15.7 ms in the fast state, 22.6-23.2 -> 21.7-22.4 in the slow one.
#ifndef QG_SPREAD_PREFETCH
#define QG_SPREAD_PREFETCH 0
#endif
constexpr bool kSpreadPrefetchOn = QG_SPREAD_PREFETCH;
// Calls of at most this many activation rows take the AVX-512 path's 8-row tiles on 256-bit
// vectors; larger ones its 16-row tiles on 512-bit vectors (Q6_K: x86_avx512.h's kNarrowRows).
// cpu_kernels.py sets QG_NARROW_TILE_ROWS=1 on AMD family 25 (Zen 4 runs a 512-bit operation as two
// 256-bit halves): streamed one thread on a 2-vCPU Zen 4 (a 256 MiB weight of K = 1536), ns per 8
// weight rows x 256 at 1 row, 8-row tiles against 16-row ones: Q4_K 51 / 55-56, Q5_K 67 / 66-69,
// Q6_K 73-77 / 83-101; Q4_1 (x 32) 7.2-7.5 / 7.9-8.0. From 2 rows the 16-row tiles ran faster (Q4_K
// at 4 rows 81 / 55, Q4_1 11.5 / 8.3). On Intel it sets 3, for the K-quants only (QG_NARROW_TYPES),
// whose 8-row tiles' one group at a time takes the two-distance prefetch (kPrefetchNear) that the
// 16-row tiles' two groups lost by (docs/benchmarks.md, "The same Xeon, a ninth session"). On a
// 2-vCPU Xeon (Emerald Rapids), rows of one sequence, builds loaded in one process, alternating,
// ms: Qwen2.5-Coder 1.5B Q4_K_M at 1 row 35.8 -> 32.3, at 2 and 3 rows (narrow to 1 -> to 3) 33.9
// -> 30.8 and 35.4 -> 33.4; at 1 row, every type narrow, the 0.5B 15.8 -> 15.5 and Gemma 3 270M
// Q4_K_M 9.7 -> 9.2; both alike at 2 and 3 rows. At 4 rows the 16-row tiles ran as fast or faster
// (but Q6_K's, kNarrowRows). The 32-value types ran slower there on the narrow tiles where the
// weights sat in the L3 (SmolLM2-135M, 94 MB in 300 MiB, 1 row: Q4_1 2.96 against 3.11, Q4_0 2.84
// against 3.06, Q8_0 4.03 against 4.20; Q4_1 at 4 rows 5.0 against 5.8) and no faster from memory
// (Q4_1, the L3 flushed before each forward: 5.21 against 5.27), so they keep the 16-row tiles. The
// same integers and float operations per lane either way: the same bits. On AMD family 26 (Zen 5,
// whose 512-bit operations run whole) it sets 1: a 2-vCPU EPYC (family 26 model 2), builds loaded in
// one process, alternating, rows of one sequence at position 512, ms for 1 / 4 / 8 rows, the
// defaults -> narrow at one row: Qwen2.5-Coder 1.5B Q4_K_M 32.5 / 32.5 / 37.5 -> 24.6 / 29.1 / 36.8;
// 0.5B 10.6 / 11.3 / 13.7 -> 9.0 / 11.0 / 13.6; Gemma 3 270M Q4_K_M 5.17 / 5.74 / 7.76 -> 4.38 /
// 5.59 / 7.63. That host's memory swung between two states; in its fast one (1.5B: one row 17-18
// ms) the 16-row tiles took 4 rows in 21-23 ms, where Q4_K's 4 rows narrow (as Q6_K's) took 23-26
// (25-30 against 28-32 in the slow one), so at 2-8 rows it keeps them.
#ifndef QG_NARROW_TILE_ROWS
#define QG_NARROW_TILE_ROWS 0
#endif
constexpr int64_t kNarrowTileRows = QG_NARROW_TILE_ROWS;
// The types whose calls take the narrow tiles: a bit per GGML type id, every type where unset.
#ifndef QG_NARROW_TYPES
#define QG_NARROW_TYPES (~0ull)
#endif
template <int T>
constexpr bool kNarrowType = (uint64_t(QG_NARROW_TYPES) >> T) & 1;

// The value as it is, hidden from the optimiser: a sum whose operands pass through here
// cannot be regrouped with other sums (-ffast-math allows regrouping otherwise).
inline float opaque(float v) {
#if defined(QG_X86)
    asm("" : "+x"(v));
#elif defined(__aarch64__)
    asm("" : "+w"(v));
#else
    asm("" : "+m"(v));
#endif
    return v;
}

// a * b + c rounded once where the CPU has FMA (as the AVX2 path computes it), else twice.
inline float madd(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE half to float, exactly (subnormal halves are normal floats; no float op sees a subnormal).
inline float f16(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, em = h & 0x7fff;
    float mag;
    if (em >= 0x7c00) mag = from_bits(0x7f800000u | ((em & 0x3ff) << 13));  // inf, nan
    else if (em >= 0x0400) mag = from_bits((em << 13) + (112u << 23));
    else mag = float(em) * 5.9604644775390625e-08f;  // subnormal: em * 2^-24
    return from_bits(to_bits(mag) | sign);
}
inline float bf16(uint16_t h) { return from_bits(uint32_t(h) << 16); }

// The fixed order in which 8 lanes are summed (the AVX2 hsum8 computes the same tree).
inline float hsum8(const float* a) {
    const float s0 = opaque(a[0] + a[4]), s1 = opaque(a[1] + a[5]), s2 = opaque(a[2] + a[6]), s3 = opaque(a[3] + a[7]);
    const float t0 = opaque(s0 + s2), t1 = opaque(s1 + s3);
    return opaque(t0 + t1);
}

// q8_K32's sums of q per 32 values: a 256-value block's 8. q8_K16's, per 256-value block: po, two
// per 16 values (kPairs16), and qo, one per 16 values (kSums16).
constexpr int64_t kSums32 = 8, kPairs16 = 32, kSums16 = 16;

// Everything one call works on. Activation row m: q + m * K, d, s and xsum + m * nb, bs + m * nb *
// kSums32 (q8_K32: sums of q per 32 values), and for q8_K16 po + m * nb * kPairs16 (per 16 values,
// -32 times the sums of their even and odd pairs) and qo + m * nb * kSums16 (-32 times the sum of q
// per 16 values); quantize_row.
struct Ctx {
    int64_t M, K, N, nb, rb;  // nb: weight blocks per row; rb: bytes per weight row
    const uint8_t* w;
    const float* x;           // fp32 activations (acts f32: F16, BF16)
    const int8_t* q;
    const float* d;
    const float* s;
    const int16_t* bs;
    const int16_t* po;
    const int32_t* qo;
    const int32_t* xsum;      // q8_0: sum(q) per block (the repacked kernels' offset for Q4_0, Q5_0, Q8_0)
    const float* bias;
    float* y;
    int64_t ldy;              // y[m, n] is y[m * ldy + n]
    bool stream;              // each weight row is read once (decode sizes): prefetch ahead
    int64_t grouped;          // the first `grouped` rows are in the repacked layout (quant/packed.h), 0: none
    nanoinfer::SidePrefetch* side;  // this thread's side ranges to prefetch while streaming (side_prefetch.h), or null
    int call_rows = 8;        // activation rows the driver hands a kernel call: kTileRows, or the path's own (x86_amx.h)
};

// A path's kernel for one type: outputs y[m0 .. m0 + mt - 1, n .. n + cols - 1] (cols <= 16,
// mt <= kTileRows), each as the type's dot computes it; a path takes the rows in tiles as tall
// as its registers allow.
constexpr int kTileRows = 8;
using RowsFn = void (*)(const Ctx&, int64_t n, int cols, int64_t m0, int mt);

// Rows m0 .. m0 + mt - 1 of a path's tiles over one stretch of outputs (Tile::run<R>(m): the R-row
// tile from row m): one tile where a tile takes that many rows (Max), else 4 rows at a time and the
// rest (7: 4 + 3). Not split evenly: the AVX2 F32 tile of 3 rows runs slower than that of 4 (232
// against 160-171 ns a weight row of 1536 in L2), so 5 F32 rows as 3 + 2 would take 1.5x 4 + 1.
template <int R, class Tile>
inline void tile_of_rows(const Tile& tile, int64_t m, int rows) {
    if constexpr (R > 1)
        if (rows < R) return tile_of_rows<R - 1>(tile, m, rows);
    tile.template run<R>(m);
}
template <int Max, class Tile>
inline void split_rows(const Tile& tile, int64_t m0, int mt) {
    if (mt <= Max) return tile_of_rows<Max>(tile, m0, mt);
    for (; mt > 0; m0 += 4, mt -= 4) tile_of_rows<Max>(tile, m0, mt < 4 ? mt : 4);
}

// One activation row, as a type's dot (types.def) takes it: x in fp32 (acts f32), or q in
// int8 with d a scale per block, s = d * sum(q) per block (q8_1), bs, kSums32 per block, the sums
// of q per 32 values (q8_K32), and qo, 16 per block, -32 times the sums of q per 16 values
// (q8_K16); what a format lacks is null.
struct ActsRow {
    const float* x;
    const int8_t* q;
    const float* d;
    const float* s;
    const int16_t* bs;
    const int32_t* qo;
};

inline ActsRow acts_row(const Ctx& c, int64_t m) {
    return {c.x ? c.x + m * c.K : nullptr, c.q ? c.q + m * c.K : nullptr, c.d ? c.d + m * c.nb : nullptr,
            c.s ? c.s + m * c.nb : nullptr, c.bs ? c.bs + m * c.nb * kSums32 : nullptr, c.qo ? c.qo + m * c.nb * kSums16 : nullptr};
}

}  // namespace
