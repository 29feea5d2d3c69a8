// y = x W^T (+ bias) on the CPU with W kept in a GGUF file's blocks: each of the N rows of W is
// K / block_size blocks in llama.cpp's layouts (ggml-common.h), byte for byte as in the file,
// or (the 32-value types) the same bytes repacked at load into groups of 8 interleaved rows.
// This file is the driver (activation quantisation, threads, dispatch, the C API); what each
// type is and how it computes lives in quant/:
//   quant/types.def   one record per type (GGML id, block values and bytes, activation format,
//                     repacked layout, dequantize and dot functions); the Python side,
//                     nanoinfer/kernels/quant.py, reads the same records
//   quant/types.h     the records as C++: type ids, block_values, block_bytes, acts_of, interleave_of
//   quant/kernel.h    what every kernel sees: Ctx, ActsRow, fp16 conversion, madd, opaque sums
//   quant/packed.h    the repacked layout: 8 rows' blocks interleaved 4 values at a time
//   quant/portable.h  each type's block layout, dequantisation and dot in plain C++: the
//                     definition every path matches, and the fallback of every path
//   quant/x86_avx2.h, quant/x86_avx512.h   the SIMD paths, each listing the types it covers
//                     (an ARM NEON path would be quant/arm_neon.h, included below the same way)
//
// As llama.cpp does, the activations are quantised per block first, so that a block's dot
// product is an exact integer sum and the float work is a multiply-add per block; the record's
// `acts` says how:
//   q8_0 (Q8_0, Q4_0, Q5_0)  per 32 values d = max|x| / 127 and int8 q = rint(x / d), and the
//                            integer sum(q) (what a repacked kernel takes off for an offset weight)
//   q8_1 (Q4_1, Q5_1)        q8_0 plus s = d * sum(q) (the weight's min times s)
//   q8_K32 (Q4_K, Q5_K)      per 256 values one d, int8 q, and the sums of q per 32 (times the
//                            sub-block mins)
//   q8_K16 (Q6_K)            per 256 values one d, int8 q, and its -32 times the sums of q per 16
//                            values (qo: where the AVX-512 tile's int32 chains start) and per
//                            even and per odd pairs of them (po: where the AVX2 tile's int16 lanes start)
// (d and s stay fp32 where llama.cpp rounds them to fp16.) F32, F16 and BF16 weights take the
// fp32 activations as they are (f32), converting 16-bit weights on the fly.
//
// Batch invariance: a row's quantisation depends on that row only, threads split N (never
// K), and each output y[m, n] is one fixed sequence of float operations whatever M, the tile
// its row falls in or the thread that runs it, so a row's result is bit for bit the same
// alone or in any batch. -ffast-math would let the compiler reassociate sums differently in
// each function it inlines into; the sums that matter are fused multiply-adds (which it
// cannot reassociate) and horizontal sums whose partial results pass through `opaque`.
//
// The paths, chosen at run time: AMX (the AVX-512 path, with Q4_K and Q5_K calls of many rows on
// the tile unit), AVX-512 (F, BW, VL and VNNI: the block types; the others run their AVX2 code
// there), AVX-VNNI (AVX2's block kernels with VEX vpdpbusd), AVX2 (+FMA, F16C) and portable C++;
// the SIMD ones are functions compiled with a target attribute, so the file builds anywhere. A type
// a path has no kernel for runs its portable dot there. They compute the same integers and the same
// float operations in the same order, so they agree bit for bit (up to the sign of a zero), in
// either layout: per output of a 32-value type, one chain of fused multiply-adds over the blocks,
// d_w * d_x times the block's exact integer dot (then, Q4_1 and Q5_1, m_w times s_x; a repacked
// kernel keeps 8 outputs' chains in the lanes of one vector); per output of a K-quant, 8 lanes (and
// 4 for the mins) each take one fused multiply-add per 256-block, summed in fixed trees at the end
// (dotk); per output of F32/F16/BF16, 16 lanes (k mod 16) of fused multiply-adds over k, then a
// fixed tree. Bias last.
//
// Work split: rows of W in chunks of 16, handed to the threads by OpenMP's guided schedule
// (contiguous runs of chunks, halving as they run out), only when the matrix is big enough to
// pay for the threads (inside the decoder stack's team, always). Static halves left a thread
// waiting at each linear's end whenever the other ran slower (2-vCPU hosts do, by turns).
// Up to 8 rows of x, each weight row (a repacked group: 8 rows) is read once while every tile
// of x rows (up to 4-8, by path and type) takes it from L1; more rows of x: each tile sweeps a
// chunk of 16 weight rows kept in cache. The rows of a 32-value type left as stored (a weight's last
// N % 8, or a weight not repacked) run the portable dot.
//
// Layouts: x [M, K] fp32, w [N, row_bytes] uint8, bias [N] fp32 or null, y [M, N] fp32,
// all contiguous.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "quant/kernel.h"
#include "quant/packed.h"
#include "quant/portable.h"
#include "quant/types.h"
#if defined(QG_X86)
#include "quant/x86_avx2.h"
#include "quant/x86_avx512.h"
#include "quant/x86_amx.h"
#endif
#include "team.h"

namespace {

// Each path builds on the ones below it: it runs their kernels for the types it has none of,
// except AVX-VNNI, a branch of AVX2 that AVX-512 does not build on (Zen 4 has AVX-512 VNNI and
// not the VEX form): AVX-512 runs AVX2's kernels, never AVX-VNNI's.
enum : int { PATH_BEST = 0, PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVXVNNI = 3, PATH_AVX512 = 4, PATH_AMX = 5 };

constexpr int64_t NCHUNK = 16;   // weight rows per unit of work (a thread's share is whole chunks)
constexpr int MT = kTileRows;    // activation rows per tile: one weight block decoded serves them all

#if !defined(QG_X86)
bool have_avx2() { return false; }
bool have_avxvnni() { return false; }
bool have_avx512() { return false; }
bool have_amx() { return false; }
constexpr bool amx_has(int) { return false; }
constexpr int kAmxCallRows = 0;
#endif

// Whether this CPU runs `path` (PATH_BEST not included).
bool path_runs(int path) {
    switch (path) {
        case PATH_PORTABLE: return true;
        case PATH_AVX2: return have_avx2();
        case PATH_AVXVNNI: return have_avxvnni();
        case PATH_AVX512: return have_avx512();
        case PATH_AMX: return have_amx();
        default: return false;
    }
}

// The path PATH_BEST names: the highest this CPU runs, in the enum's order (AMX hands the tile
// unit only the calls it was measured faster on, kAmxMinRows in quant/x86_amx.h).
int best_path() {
    int path = PATH_AMX;
    while (path > PATH_PORTABLE && !path_runs(path)) path--;
    return path;
}

// ---- activations ----------------------------------------------------------------------

// One row in blocks of B values: d[b] = max|x| / 127, q = rint(x * 127 / max|x|) (ties to
// even), s[b] = d[b] * sum(q) when s is given, xsum[b] = sum(q) when xsum is given, bs = sums
// of q per 32 values when given, and per 16 values when given: po (-32 times the sum of the
// pairs of q at 4v, 4v + 1 and, next, of those at 4v + 2, 4v + 3, v = 0..3; within
// +-32 * 8 * 127) and qo (-32 times the sum of the 16).
void quantize_row(const float* x, int64_t K, int64_t B, int8_t* q, float* d, float* s, int32_t* xsum, int16_t* bs,
                  int16_t* po, int32_t* qo) {
    for (int64_t b = 0; b < K / B; b++) {
        const float* xb = x + b * B;
        int8_t* qb = q + b * B;
        uint32_t abits = 0;  // max |x| through the bits: an integer max, which vectorises
        for (int64_t i = 0; i < B; i++) abits = std::max(abits, to_bits(xb[i]) & 0x7fffffffu);
        const float amax = from_bits(abits);
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax * (1.f / 127.f);
        for (int64_t i = 0; i < B; i++) {
            const float v = std::nearbyint(xb[i] * id);
            qb[i] = int8_t(std::max(-127.f, std::min(127.f, v)));
        }
        if (s || xsum) {
            int32_t sum = 0;
            for (int64_t i = 0; i < B; i++) sum += qb[i];
            if (s) s[b] = d[b] * float(sum);
            if (xsum) xsum[b] = sum;
        }
        if (bs)
            for (int64_t g = 0; g < B / 32; g++) {
                int32_t sum = 0;
                for (int64_t i = 0; i < 32; i++) sum += qb[32 * g + i];
                bs[b * kSums32 + g] = int16_t(sum);
            }
        if (po || qo)
            for (int64_t g = 0; g < B / 16; g++) {
                int32_t pair[2] = {0, 0};
                for (int p = 0; p < 2; p++)
                    for (int v = 0; v < 4; v++) pair[p] += qb[16 * g + 4 * v + 2 * p] + qb[16 * g + 4 * v + 2 * p + 1];
                if (po) po[b * kPairs16 + 2 * g] = int16_t(-32 * pair[0]), po[b * kPairs16 + 2 * g + 1] = int16_t(-32 * pair[1]);
                if (qo) qo[b * kSums16 + g] = -32 * (pair[0] + pair[1]);
            }
    }
}

// ---- dispatch ---------------------------------------------------------------------------

// The kernel for type T on `path`: the path's own where its file lists T (AVX-512 falls back
// to AVX2's), else the portable one built on the record's dot. A path never instantiates a
// kernel for a type it does not list, so a new type needs no code in the arch files.
template <int T, auto Dot>
RowsFn kernel_for(int path) {
#if defined(QG_X86)
#if defined(QG_AMX_BUILD)  // (not in the tests' build without the CPU's AVX-512: no tile unit there)
    if constexpr (amx_has(T))
        if (path == PATH_AMX) return rows_amx<T>;
#endif
    if constexpr (avx512_has(T))
        if (path >= PATH_AVX512) return rows_avx512<T>;
    if constexpr (avxvnni_has(T))
        if (path == PATH_AVXVNNI) return rows_avx2<T, true>;
    if constexpr (avx2_has(T))
        if (path >= PATH_AVX2) return rows_avx2<T>;
#endif
    (void)path;
    if constexpr (interleave_of(T) == kGroup) return rows_portable_grouped<T>;
    return rows_portable<Dot>;
}

RowsFn pick(int qtype, int path) {
    switch (qtype) {
#define QUANT_TYPE(name, ggml, values, bytes, acts, interleave, dequantize, dot) case name: return kernel_for<name, dot>(path);
#include "quant/types.def"
#undef QUANT_TYPE
        default: return nullptr;
    }
}

// The weight rows in chunks of `rows`, split among the threads (each output is computed by
// exactly one call, whatever the split): chunk ch. Decode-sized batches take every activation
// tile for a few weight rows (8, or two repacked groups: 16) while they are in L1/L2; larger ones
// sweep a chunk of rows (kept in L1/L2) per tile of activation rows.
void drive_chunk(const Ctx& c, RowsFn fn, int64_t ch, int64_t rows) {
    const int64_t n0 = ch * rows, n1 = std::min(c.N, n0 + rows);
    if (c.stream) {
        const int64_t step = c.grouped ? 2 * kGroup : 8;  // two repacked groups: the AVX-512 tiles' 16 rows
        for (int64_t n = n0; n < n1; n += step)
            for (int64_t m0 = 0; m0 < c.M; m0 += c.call_rows)
                fn(c, n, int(std::min<int64_t>(step, n1 - n)), m0, int(std::min<int64_t>(c.call_rows, c.M - m0)));
    } else {
        const int64_t step = c.grouped ? 2 * kGroup : 2;
        for (int64_t m0 = 0; m0 < c.M; m0 += c.call_rows)
            for (int64_t n = n0; n < n1; n += step)
                fn(c, n, int(std::min<int64_t>(step, n1 - n)), m0, int(std::min<int64_t>(c.call_rows, c.M - m0)));
    }
}

int64_t chunks_of(int64_t N, int64_t rows = NCHUNK) { return (N + rows - 1) / rows; }

// A swept call's chunk: NCHUNK rows, or where cpu_kernels.py sets QG_SWEPT_CHUNK_BYTES (AMD's
// Zen 5) as many whole NCHUNKs as fit in that many bytes of weights, but at least two chunks a
// thread. Every activation tile passes over a chunk's rows, so a chunk of 16 rows read all M
// rows' activations again for each 16 weight rows: at prefill's 512 rows 786 KB (K = 1536) or
// 4.6 MB (K = 8960, past L2) a sweep. Larger chunks stay in L2 while each tile, in L1 where it
// fits, meets all their rows. The same calls, in another order: the same bits. On a 2-vCPU Zen 5,
// Qwen2.5-Coder 1.5B Q5_K_M's weights at 512 rows, two threads, ms for each shape's weights, 16
// rows against 256 KiB (128 and 512 KiB in between or alike): 8960 x 1536 808-872 -> 645-662,
// 1536 x 8960 194-203 -> 174-176, Q6_K's 1536 x 8960 263-272 -> 234-238; its prefill of 512
// tokens 322-346 -> 367-371 tok/s (docs/benchmarks.md, the sixth Zen 5 section).
#ifndef QG_SWEPT_CHUNK_BYTES
#define QG_SWEPT_CHUNK_BYTES 0
#endif
constexpr int64_t kSweptChunkBytes = QG_SWEPT_CHUNK_BYTES;
int64_t chunk_rows(const Ctx& c) {
    if (c.stream || kSweptChunkBytes == 0 || c.rb <= 0) return NCHUNK;
    const int64_t threads = omp_get_num_threads(), share = threads * kSweptChunkBytes;
    const int64_t chunks = threads * std::max<int64_t>((c.N * c.rb + share - 1) / share, 2);  // the same count a thread
    const int64_t rows = (c.N + chunks - 1) / chunks;
    return std::max<int64_t>(NCHUNK, (rows + NCHUNK - 1) / NCHUNK * NCHUNK);
}

void drive(const Ctx& c, RowsFn fn) {
    const int64_t rows = chunk_rows(c);
#pragma omp for schedule(guided)
    for (int64_t ch = 0; ch < chunks_of(c.N, rows); ch++) drive_chunk(c, fn, ch, rows);
}

// Where the quantised activations of M rows lie in one buffer: int8 values, then a scale per
// block, then (q8_1) d * sum(q) per block, then (q8_0) sum(q) per block, then (q8_K32) sums of
// q per 32 values, then (q8_K16) po, 2 per 16 values, and qo, 1 per 16 values.
struct Acts {
    int64_t nq, nd, nbs, npo, nqo;  // 8-byte words of each part
    bool with_s, with_xsum, with_bs, with_q6;  // with_q6: q8_K16's po and qo
    Acts(int qtype, int64_t M, int64_t K) {
        const ActsFormat f = acts_of(qtype);
        const int64_t B = acts_block(f);
        with_s = f == ActsFormat::q8_1;
        with_xsum = f == ActsFormat::q8_0;
        with_bs = f == ActsFormat::q8_K32;
        with_q6 = f == ActsFormat::q8_K16;
        nq = B > 1 ? (M * K + 7) / 8 : 0;
        nd = B > 1 ? (M * (K / B) + 1) / 2 : 0;
        nbs = with_bs ? (M * K / 32 + 3) / 4 : 0;
        npo = with_q6 ? (M * K / 8 + 3) / 4 : 0;
        nqo = with_q6 ? (M * K / 16 + 1) / 2 : 0;
    }
    int64_t words() const { return nq + nd * ((with_s ? 2 : 1) + (with_xsum ? 1 : 0)) + nbs + npo + nqo; }
};

// c's activation pointers into `acts`, a buffer of M rows laid out as Acts(qtype, M, K), at its row m0.
void point_acts(Ctx& c, int qtype, int64_t M, void* acts, int64_t m0) {
    const Acts a(qtype, M, c.K);
    uint64_t* p = static_cast<uint64_t*>(acts);
    c.q = reinterpret_cast<const int8_t*>(p) + m0 * c.K;
    c.d = reinterpret_cast<const float*>(p + a.nq) + m0 * c.nb;
    c.s = a.with_s ? reinterpret_cast<const float*>(p + a.nq + a.nd) + m0 * c.nb : nullptr;
    c.xsum = a.with_xsum ? reinterpret_cast<const int32_t*>(p + a.nq + a.nd) + m0 * c.nb : nullptr;
    c.bs = a.with_bs ? reinterpret_cast<const int16_t*>(p + a.nq + a.nd) + m0 * c.nb * kSums32 : nullptr;
    c.po = a.with_q6 ? reinterpret_cast<const int16_t*>(p + a.nq + a.nd + a.nbs) + m0 * c.nb * kPairs16 : nullptr;
    c.qo = a.with_q6 ? reinterpret_cast<const int32_t*>(p + a.nq + a.nd + a.nbs + a.npo) + m0 * c.nb * kSums16 : nullptr;
}

// x's M rows quantised into `acts` as qtype's activation format, the rows split among the team:
// by quantize_row on the portable path, by the AVX2 path's own quantisation (the same bits) on
// the SIMD paths, which all build on AVX2.
void quantise_team(int qtype, int path, const float* x, int64_t M, int64_t K, void* acts) {
    const ActsFormat f = acts_of(qtype);
    if (f == ActsFormat::f32) return;
    Ctx c{};
    const int64_t B = block_values(qtype);
    c.K = K, c.nb = K / B;
    point_acts(c, qtype, M, acts, 0);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * K;
        int8_t* q = const_cast<int8_t*>(c.q) + m * K;
        float* d = const_cast<float*>(c.d) + m * c.nb;
        float* s = c.s ? const_cast<float*>(c.s) + m * c.nb : nullptr;
        int32_t* xsum = c.xsum ? const_cast<int32_t*>(c.xsum) + m * c.nb : nullptr;
        int16_t* bs = c.bs ? const_cast<int16_t*>(c.bs) + m * c.nb * kSums32 : nullptr;
        int16_t* po = c.po ? const_cast<int16_t*>(c.po) + m * c.nb * kPairs16 : nullptr;
        int32_t* qo = c.qo ? const_cast<int32_t*>(c.qo) + m * c.nb * kSums16 : nullptr;
#if defined(QG_X86)
        if (path != PATH_PORTABLE) {  // the activation blocks are 32 or 256 values (types.def)
            B == 32 ? quantize_row_avx2<32>(xr, K, q, d, s, xsum, bs, po, qo)
                    : quantize_row_avx2<256>(xr, K, q, d, s, xsum, bs, po, qo);
            continue;
        }
#endif
        (void)path;
        quantize_row(xr, K, B, q, d, s, xsum, bs, po, qo);
    }
}

// The checks every linear makes, the same on every thread (they depend on the arguments only);
// path resolved from PATH_BEST. Returns 0 or quant_linear_team's codes.
int check_linear(int qtype, int& path, int64_t K, bool repacked) {
    if (block_bytes(qtype) == 0) return -1;
    if (repacked && interleave_of(qtype) == 1) return -5;
    if (K <= 0 || K % block_values(qtype) != 0) return -3;
    if (path == PATH_BEST) path = best_path();
    return path_runs(path) ? 0 : -2;
}

Ctx linear_ctx(int qtype, int path, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, bool repacked,
               const float* bias, float* y, int64_t ldy) {
    const int64_t nb = K / block_values(qtype);
    nanoinfer::SidePrefetch& side = nanoinfer::side_prefetch();
    return Ctx{M, K, N, nb, nb * block_bytes(qtype), w, x, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, bias, y, ldy,
               M <= nanoinfer::kStreamRows, repacked ? N - N % interleave_of(qtype) : 0, side.pending() ? &side : nullptr,
               path == PATH_AMX && amx_has(qtype) ? kAmxCallRows : MT};
}

// out[r] = row rows[r] of w dequantised, block by block with the record's dequantize (a
// repacked weight's blocks first taken back to their stored form).
template <int T, auto Dequantize>
void dequantize_rows(const uint8_t* w, int64_t N, int64_t K, bool repacked, const int64_t* rows, int64_t R,
                     float* out) {
    constexpr int64_t B = block_values(T), size = block_bytes(T);
    const int64_t nb = K / B, rb = nb * size;
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < nb; b++) {
            if constexpr (interleave_of(T) == kGroup) {
                if (repacked) {
                    uint8_t blk[size];
                    stored_block<T>(w, rb, N - N % kGroup, rows[r], b, blk);
                    Dequantize(blk, out + r * K + b * B);
                    continue;
                }
            }
            Dequantize(w + rows[r] * rb + b * size, out + r * K + b * B);
        }
}

template <int T>
int repack_type(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb, bool unpack) {
    if constexpr (interleave_of(T) == kGroup) {
        repack_rows<T>(src, dst, N, nb, unpack);
        return 0;
    }
    return -5;
}

}  // namespace

namespace nanoinfer {

int64_t quant_acts_bytes(int qtype, int64_t M, int64_t K) { return Acts(qtype, M, K).words() * 8; }

bool same_acts(int a, int b) { return acts_of(a) == acts_of(b); }

// Returns 0, or -1: no kernel for qtype, -2: path unavailable, -3: K not a multiple of the block,
// -5: w said to be repacked where the type has no repacked layout. Every thread of a team
// returns the same: the checks depend on the arguments only.
__attribute__((noinline)) int quant_linear_team(int qtype, int path, const float* x, int64_t M, int64_t K,
                                                const uint8_t* w, int64_t N, bool repacked, const float* bias, float* y,
                                                int64_t ldy, void* acts, bool quantise) {
    if (const int rc = check_linear(qtype, path, K, repacked)) return rc;
    const RowsFn fn = pick(qtype, path);
    if (M <= 0 || N <= 0) return 0;
    Ctx c = linear_ctx(qtype, path, x, M, K, w, N, repacked, bias, y, ldy);
    if (acts_of(qtype) != ActsFormat::f32) {
        if (quantise) quantise_team(qtype, path, x, M, K, acts);
        point_acts(c, qtype, M, acts, 0);
    }
    drive(c, fn);
    return 0;
}

__attribute__((noinline)) int quant_linear_grouped_team(int qtype, int path, const float* x, int64_t K,
                                                        const uint8_t* const* w, const int64_t* start, int64_t G,
                                                        int64_t N, bool repacked, float* y, int64_t ldy, void* acts,
                                                        bool quantise) {
    if (const int rc = check_linear(qtype, path, K, repacked)) return rc;
    const RowsFn fn = pick(qtype, path);
    const int64_t M = G > 0 ? start[G] : 0;
    if (M <= 0 || N <= 0) return 0;
    if (quantise) quantise_team(qtype, path, x, M, K, acts);
    const int64_t chunks = chunks_of(N);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < G * chunks; u++) {
        const int64_t g = u / chunks, ch = u % chunks, m0 = start[g], rows = start[g + 1] - m0;
        if (rows <= 0) continue;
        Ctx c = linear_ctx(qtype, path, x + m0 * K, rows, K, w[g], N, repacked, nullptr, y + m0 * ldy, ldy);
        if (acts_of(qtype) != ActsFormat::f32) point_acts(c, qtype, M, acts, m0);
        // Streaming, a thread runs on from one expert's last chunk into the next expert's first,
        // elsewhere in memory, which its prefetch ahead did not reach: the head of that weight
        // now (the F32 Qwen3-MoE's decode step 5% faster on a Zen 4).
        if (c.stream && ch == chunks - 1 && g + 1 < G)
            for (int64_t o = 0; o < std::min<int64_t>(kPrefetch, N * c.rb); o += 64)
                __builtin_prefetch(w[g + 1] + o, 0, kPrefetchLocality);
        drive_chunk(c, fn, ch, NCHUNK);
    }
    return 0;
}

}  // namespace nanoinfer

// Bit p set when path p (PATH_PORTABLE ... PATH_AMX) runs on this CPU.
extern "C" int quant_paths() {
    int mask = 0;
    for (int p = PATH_PORTABLE; p <= PATH_AMX; p++) mask |= path_runs(p) ? 1 << p : 0;
    return mask;
}

// The path calls run on unless one is named (PATH_BEST's).
extern "C" int quant_default_path() { return best_path(); }

// The arguments of quant_linear, as one array of int64 (one ctypes argument converts faster
// than ten): qtype, path (PATH_*), x, w, bias (or 0), y, M, K, N, repacked (w in the type's
// repacked layout, quant/packed.h: 1; as stored: 0).
struct LinearArgs {
    int64_t qtype, path;
    const float* x;
    const uint8_t* w;
    const float* bias;
    float* y;
    int64_t M, K, N, repacked;
};

// Returns 0 or the codes of quant_linear_team.
extern "C" int quant_linear(const LinearArgs* a) {
    const int qtype = int(a->qtype);
    const int64_t M = a->M, K = a->K, N = a->N;
    if (block_bytes(qtype) == 0) return -1;
    // The quantised activations, in one buffer per calling thread, reused across calls.
    static thread_local std::vector<uint64_t> buf;
    buf.resize(size_t(std::max<int64_t>(1, Acts(qtype, std::max<int64_t>(M, 0), K).words())));
    void* acts = buf.data();  // taken here: in the team, `buf` names each thread's own
    // Threads only where there is work for them: starting a team and the barriers cost a few
    // microseconds, more than a small matrix takes.
    const int64_t B = block_values(qtype);
    const int64_t rb = K > 0 && K % B == 0 ? K / B * block_bytes(qtype) : 0;
    const bool parallel = N * rb * std::min<int64_t>(M, 4) >= (1 << 16) && N >= 2 * NCHUNK;
    if (!parallel)
        return nanoinfer::quant_linear_team(qtype, int(a->path), a->x, M, K, a->w, N, a->repacked != 0, a->bias, a->y,
                                            N, acts, true);
    int rc = 0;
#pragma omp parallel
    {
        const int r = nanoinfer::quant_linear_team(qtype, int(a->path), a->x, M, K, a->w, N, a->repacked != 0, a->bias,
                                                   a->y, N, acts, true);
#pragma omp master
        rc = r;
    }
    return rc;
}

// The 8-bit dot peak probe (quant/x86_*.h): `reps` rounds on every thread of a team on `path`
// (0: the best), the caller timing the call. Returns the integer operations done, 2 per
// u8 x s8 product, or -1 where there is no probe (the portable path: what the compiler makes
// of plain C++ is no machine peak).
extern "C" int64_t quant_dot_peak(int path, int64_t reps) {
    if (path == PATH_BEST) path = best_path();
    if (!path_runs(path) || path == PATH_PORTABLE) return -1;
    int64_t ops = 0;
#if defined(QG_X86)
#pragma omp parallel reduction(+ : ops)
    ops += path == PATH_AMX       ? dot_peak_amx(reps)
           : path == PATH_AVX512  ? dot_peak_avx512(reps)
           : path == PATH_AVXVNNI ? dot_peak_avx2<true>(reps)
                                  : dot_peak_avx2<false>(reps);
#endif
    return ops > 0 ? ops : -1;
}

// Type records, as this library was built with them: (GGML id, values per block, bytes per
// block, interleave) for each, up to `cap` records into out; returns how many there are (tests
// compare them with Python's reading of quant/types.def).
extern "C" int quant_types(int64_t* out, int cap) {
    int n = 0;
#define QUANT_TYPE(name, ggml, values, bytes, acts, interleave, ...)                                   \
    if (n < cap) {                                                                                    \
        out[4 * n] = ggml, out[4 * n + 1] = values, out[4 * n + 2] = bytes, out[4 * n + 3] = interleave; \
    }                                                                                                 \
    n++;
#include "quant/types.def"
#undef QUANT_TYPE
    return n;
}

// out[r] = row rows[r] of w (N rows, repacked or as stored) dequantised (K values), exactly as
// gguf's numpy dequantisation computes it. Returns 0, -1: no kernel for qtype, -3: bad K, -4: a
// row out of range, -5: repacked where the type has no repacked layout.
extern "C" int quant_dequantize_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, int repacked,
                                     const int64_t* rows, int64_t R, float* out) {
    const int64_t size = block_bytes(qtype), B = block_values(qtype);
    if (size == 0) return -1;
    if (K <= 0 || K % B != 0) return -3;
    if (repacked && interleave_of(qtype) == 1) return -5;
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= N) return -4;
    switch (qtype) {
#define QUANT_TYPE(name, ggml, values, bytes, acts, interleave, dequantize, dot) \
        case name: dequantize_rows<name, dequantize>(w, N, K, repacked != 0, rows, R, out); break;
#include "quant/types.def"
#undef QUANT_TYPE
    }
    return 0;
}

// dst = src (N rows of K values, as stored) in the type's repacked layout (quant/packed.h), or
// with unpack the other way. Returns 0, -1: no kernel for qtype, -3: bad K, -5: no repacked
// layout for the type.
extern "C" int quant_repack(int qtype, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, int unpack) {
    const int64_t B = block_values(qtype);
    if (block_bytes(qtype) == 0) return -1;
    if (K <= 0 || K % B != 0) return -3;
    switch (qtype) {
#define QUANT_TYPE(name, ...) case name: return repack_type<name>(src, dst, N, K / B, unpack != 0);
#include "quant/types.def"
#undef QUANT_TYPE
    }
    return -1;
}
