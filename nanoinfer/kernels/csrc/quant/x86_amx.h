// The AMX path (AMX-TILE and AMX-INT8 beside the AVX-512 path's features), the default where the
// CPU has it: Q4_K and Q5_K weights in calls of kAmxMinRows activation rows or more hand their
// 8-bit products to the tile unit; everything else on this path is the AVX-512 path's
// (quant/x86_avx512.h, which this file builds on). Measured on a 2-vCPU Xeon (Emerald Rapids), the
// 1.5B's Q4_K linears at 64-512 rows took 1.04-1.9x less time than on the AVX-512 tiles, never
// more; end to end, prefill 1.02-1.38x and batch-32 decode 1.16x (docs/benchmarks.md, the AMX
// sections).
//
// A call takes two groups (16 outputs) and up to kAmxCallRows rows. The weights are unpacked once
// for all of them into B tiles (k_scaled_weights), then each A tile of up to 16 rows (the int8
// activations, read in place at their row stride) meets them in TDPBSUD, one pair of C tiles per
// 256-value block (C_lo, C_hi: the sub-block scales split in two, see k_scaled_weights), and the
// epilogue (k_tile_rows) runs the AVX-512 tile's mins and float operations in its order on
// C_lo + 8 C_hi, the exact integer that tile makes with vpmulld. So the paths agree bit for bit. A
// short tail of a call's rows (kAmxTailRows) runs the AVX-512 tiles.
//
// No SIMDe build has the tile unit (tests run this path where the CPU has it), and Linux hands a
// process the tile registers only when it asks (have_amx).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel.h"
#include "packed.h"
#include "types.h"
#include "x86_avx512.h"

#if defined(QG_X86) && !defined(QG_EMULATE_AVX512)
#define QG_AMX_BUILD 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(QG_AMX_BUILD)
#define QG_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// ldtilecfg's 64-byte operand, palette 1: each tile's rows and bytes a row.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Palette 1 with every tile 64 bytes a row: B (tmm4-7) 16 rows, C and A (tmm0-3) `rows`.
QG_AMX inline void configure_tiles(int rows) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = uint8_t(t < 4 ? rows : 16), cfg.colsb[t] = 64;
    asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

// The tile instructions, each an asm statement: GCC's intrinsics (12) tell the compiler neither
// that tileloadd reads the buffer the weights were just stored to, nor that tilestored writes the
// one read next, nor all 64 bytes that ldtilecfg reads; a memory clobber on each does.
#define QG_TILE_LOADD(t, base, stride) asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(int64_t(stride)) : "memory")
#define QG_TILE_STORED(t, base, stride) asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(int64_t(stride)) : "memory")
#define QG_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::)
#define QG_TILE_DPBSUD(c, a, b) asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// Activation rows per call on this path: the driver hands a K-quant's two groups this many rows
// at once, so their weights are unpacked once for all of them (kTileRows elsewhere). A prefill
// chunk of 512 rows (the engine's default budget) is one call: Qwen2.5-Coder 1.5B's prefill at 512
// tokens on the Xeon, alternating processes, 245-259 tok/s with calls of 64 rows, 276-282 with 512,
// 268-284 with 4096; 2048 tokens in one chunk 187-217, 203-224, 209-217.
constexpr int kAmxCallRows = 512;
constexpr int kAmxTileRows = 16;  // an A tile's rows

// Scratch of a thread, 64-byte aligned, grown as needed: the unpacked weights and the tiles' sums.
QG_AMX inline uint8_t* amx_scratch(int64_t bytes) {
    thread_local std::vector<uint8_t> buf;
    if (int64_t(buf.size()) < bytes + 64) buf.resize(bytes + 64);
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

// One 256-value block's B tiles for Q4_K / Q5_K (two groups, 16 outputs), 8 KiB at out: the
// weights times the low 3 bits of their sub-block's 6-bit scale (4 tiles of 64 values: row r of
// tile q holds values 64q + 4r .. + 3 of the 16 outputs), then times its high 3 bits (4 more).
// A byte times 0..7 stays a byte (31 x 7 = 217), and vpmullw on the 16-bit pairs of bytes
// multiplies both without a carry between them, so sum_j s_j dot_j, the integer the AVX-512 tile
// makes with vpmulld, is C_lo + 8 C_hi, exactly, with one pair of C tiles a block.
template <int T>
QG_AMX inline void k_scaled_weights(const uint8_t* const* gb, const KScales* ks, uint8_t* out) {
    for (int j = 0; j < 8; j++) {
        __m256i part[2];
        for (int k = 0; k < 2; k++) part[k] = ks[k].scale32(j);
        const __m512i s = join<2>(part);
        const __m512i lo = _mm512_and_si512(s, _mm512_set1_epi32(7)), hi = _mm512_srli_epi32(s, 3);
        const __m512i lo2 = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16)), hi2 = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));
        uint8_t* at = out + 1024 * (j / 2) + 512 * (j & 1);
        for (int v = 0; v < 8; v++) {
            const __m512i w = k_weights_of<T, 2>(gb, j, v);
            _mm512_store_si512(at + 64 * v, _mm512_mullo_epi16(w, lo2));
            _mm512_store_si512(at + 4096 + 64 * v, _mm512_mullo_epi16(w, hi2));
        }
    }
}

// One 64-value step of a block: A (tile a) from x + 64 q, B lo and hi (tiles blo, bhi) from the
// block's tiles q and 4 + q, into C_lo (tmm0) and C_hi (tmm1). Tile numbers are immediates, so the
// steps alternate two sets of tiles by macro, letting a step's loads overlap the last one's products.
#define QG_K_TILE_STEP(a, blo, bhi, q)               \
    QG_TILE_LOADD(a, x + 64 * (q), K);               \
    QG_TILE_LOADD(blo, w + 1024 * (q), 64);          \
    QG_TILE_LOADD(bhi, w + 4096 + 1024 * (q), 64);   \
    QG_TILE_DPBSUD(0, a, blo);                       \
    QG_TILE_DPBSUD(1, a, bhi)

// C_lo, C_hi of rows [m, m + rows) for each block: sums[b] 2 x 16 rows x 16 int32.
QG_AMX inline void k_tile_sums(const int8_t* q, int64_t K, int64_t nb, const uint8_t* wts, int32_t* sums) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* w = wts + 8192 * b;
        const int8_t* x = q + 256 * b;
        QG_TILE_ZERO(0);
        QG_TILE_ZERO(1);
        QG_K_TILE_STEP(2, 4, 6, 0);
        QG_K_TILE_STEP(3, 5, 7, 1);
        QG_K_TILE_STEP(2, 4, 6, 2);
        QG_K_TILE_STEP(3, 5, 7, 3);
        QG_TILE_STORED(0, sums + 512 * b, 64);
        QG_TILE_STORED(1, sums + 512 * b + 256, 64);
    }
}
#undef QG_K_TILE_STEP

// A block's epilogue operands for the two groups, made once a call (not once an A tile): the mins'
// int16 pairs (k_min_pairs), dmin and d.
struct alignas(64) KBlockEpilogue {
    __m512i mp[4];
    __m512 dmin, d;
};

// Rows m .. m + R - 1 from the tiles' sums: per block the mins, then d * d_x * (C_lo + 8 C_hi),
// groupk_avx512's float operations in its order.
template <int R>
QG_AMX void k_tile_rows(const Ctx& c, int64_t n, int64_t m, const KBlockEpilogue* ep, const int32_t* sums) {
    const KActs<R> x(c, m);
    __m512 acc[R];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < c.nb; b++) {
        sub_k_mins_of<2, R>(acc, ep[b].mp, ep[b].dmin, x, b);
        const int32_t* s = sums + 512 * b;
        for (int i = 0; i < R; i++) {
            const __m512i isum = _mm512_add_epi32(_mm512_load_si512(s + 16 * i), _mm512_slli_epi32(_mm512_load_si512(s + 256 + 16 * i), 3));
            acc[i] = v_fma(acc[i], ep[b].d, x.xd[i] + b, isum);
        }
    }
    store_groups<2, R>(c, n, m, acc);
}

struct AmxRows {
    const Ctx& c;
    int64_t n;
    const KBlockEpilogue* ep;
    const int32_t* sums;
    template <int R>
    QG_AMX void run(int64_t m) const { k_tile_rows<R>(c, n, m, ep, sums); }
};

// Rows m0 .. m0 + mt - 1 of outputs n .. n + cols - 1 on the AVX-512 tiles, handed out as the
// driver hands them on that path (kTileRows at a time).
template <int T>
QG_AMX void rows_on_avx512(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    for (int64_t m = m0; m < m0 + mt; m += kTileRows)
        rows_avx512<T>(c, n, cols, m, int(std::min<int64_t>(kTileRows, m0 + mt - m)));
}

// Rows past the last full A tile go to the AVX-512 tiles when there are fewer than this: an A tile
// costs its products and its epilogue at any height. One thread, K = 1536, weights in L1/L2 on
// the Xeon (Emerald Rapids), ns per 16 rows x 16 outputs x 256 values, all rows on the tiles
// against the tail on AVX-512: 17 rows 623-847 / 485-487, 20 rows 518-525 / 456-469; 24 rows
// 434-441 / 460-595, 28 and 31 rows alike or better on the tiles.
constexpr int kAmxTailRows = 8;

// groupk_avx512's outputs for two groups (rows n .. n + 15), rows m0 .. m0 + mt - 1, on the tiles:
// the weights unpacked and scaled once (k_scaled_weights), then each A tile of up to 16 rows.
template <int T>
QG_AMX void groupk_amx(const Ctx& c, int64_t n, int64_t m0, int mt) {
    using L = PackedK<T>;
    if (const int tail = mt % kAmxTileRows; tail < kAmxTailRows) {
        rows_on_avx512<T>(c, n, 2 * kGroup, m0 + mt - tail, tail);
        if ((mt -= tail) == 0) return;
    }
    // B tiles, then the tiles' sums, then the epilogue's operands
    uint8_t* wts = amx_scratch((8192 + 2048 + int64_t(sizeof(KBlockEpilogue))) * c.nb);
    int32_t* sums = reinterpret_cast<int32_t*>(wts + 8192 * c.nb);
    KBlockEpilogue* ep = reinterpret_cast<KBlockEpilogue*>(wts + (8192 + 2048) * c.nb);
    for (int64_t b = 0; b < c.nb; b++) {
        const uint8_t* gb[2];
        group_blocks<T, 2, false>(c, n, b, L::group_bytes, gb);  // never streamed: kAmxMinRows is above team.h's kStreamRows
        KScales ks[2];
        for (int k = 0; k < 2; k++) ks[k] = KScales(gb[k] + L::sc);
        k_scaled_weights<T>(gb, ks, wts + 8192 * b);
        k_min_pairs<2>(ks, ep[b].mp);
        ep[b].dmin = halves_of<2>(gb, 16);
        ep[b].d = halves_of<2>(gb, 0);
    }
    int configured = 0;  // the A and C tiles' rows ldtilecfg last set: once a call, again for a short last tile
    for (int64_t m = m0; m < m0 + mt; m += kAmxTileRows) {
        const int rows = int(std::min<int64_t>(kAmxTileRows, m0 + mt - m));
        if (rows != configured) configure_tiles(configured = rows);
        k_tile_sums(c.q + m * c.K, c.K, c.nb, wts, sums);
        tile_of_rows<kAmxTileRows>(AmxRows{c, n, ep, sums}, m, rows);
    }
    asm volatile("tilerelease" ::: "memory");
}

// The fewest rows of a linear that go to the tile unit (fewer run the AVX-512 tiles): at 2-8 rows
// the unpacking was not paid back (an earlier version 1.8-2.8x slower there). One thread, weights
// in L1/L2 on the Xeon, ns per 16 rows x 16 outputs x 256 values, AVX-512 tiles / AMX: K = 1536,
// 16 rows 369-380 / 431-433, 24 rows 339-352 / 370-392, 32 rows 372-393 / 335-380, 48 rows
// 343-379 / 284-297, 64 rows 350-363 / 262-270; K = 8960, 24 rows 395-406 / 342-432, 32 rows
// 355-378 / 290-312.
constexpr int kAmxMinRows = 32;

// The types this path runs on the tile unit.
constexpr bool amx_has(int t) { return t == Q4_K || t == Q5_K; }

// rows_avx512, but two groups of an amx_has type for kAmxMinRows rows or more on the tiles.
template <int T>
QG_AMX void rows_amx(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if constexpr (amx_has(T)) {
        if (cols == 2 * kGroup && n + 2 * kGroup <= c.grouped && c.M >= kAmxMinRows) return groupk_amx<T>(c, n, m0, mt);
    }
    rows_on_avx512<T>(c, n, cols, m0, mt);
}

// The tile unit's 8-bit dot peak, dot_peak_avx512's counterpart: four independent C tiles, each
// TDPBSUD 16 x 16 outputs of 64 products from A and B tiles held in registers. Returns the
// integer operations done (2 a product).
QG_AMX __attribute__((noinline)) int64_t dot_peak_amx(int64_t reps) {
    alignas(64) uint8_t ones[1024];
    std::memset(ones, 1, sizeof ones);
    configure_tiles(16);
    QG_TILE_LOADD(4, ones, 64);
    QG_TILE_LOADD(5, ones, 64);
    QG_TILE_LOADD(6, ones, 64);
    QG_TILE_LOADD(7, ones, 64);
    QG_TILE_ZERO(0);
    QG_TILE_ZERO(1);
    QG_TILE_ZERO(2);
    QG_TILE_ZERO(3);
    for (int64_t r = 0; r < reps; r++) {
        QG_TILE_DPBSUD(0, 4, 6);
        QG_TILE_DPBSUD(1, 4, 7);
        QG_TILE_DPBSUD(2, 5, 6);
        QG_TILE_DPBSUD(3, 5, 7);
    }
    alignas(64) int32_t sums[256];
    QG_TILE_STORED(0, sums, 64);
    asm volatile("tilerelease" ::: "memory");
    volatile int32_t sink = sums[0];
    (void)sink;
    return reps * 4 * (16 * 16 * 64) * 2;
}

// AMX-TILE and AMX-INT8 on the CPU with the AVX-512 path, and Linux's leave to use the tile
// registers (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process; a kernel that
// predates it, or a VM that hides the state from XCR0, refuses).
bool have_amx() {
    static const bool ok = [] {
        if (!have_avx512()) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const unsigned tile = 1u << 24, int8 = 1u << 25;
        if (!(d & tile) || !(d & int8)) return false;
        constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
        if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) return false;
        unsigned lo, hi;
        asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        return (lo & (3u << 17)) == (3u << 17);
    }();
    return ok;
}
#else
constexpr int kAmxCallRows = 0;
constexpr bool amx_has(int) { return false; }
bool have_amx() { return false; }
int64_t dot_peak_amx(int64_t) { return -1; }
#endif

}  // namespace
