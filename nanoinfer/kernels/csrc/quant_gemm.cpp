// y = x W^T (+ bias) on the CPU with W kept as a GGUF file stores it: each of the N rows of W
// is K / block_size blocks in llama.cpp's layouts (ggml-common.h), byte for byte as in the
// file. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16 and BF16; the Python side is
// nanoinfer/kernels/quant.py, the block layouts are spelled out at decode32 / decode256.
//
// As llama.cpp does, the activations are quantised per block first, so that a block's dot
// product is an exact integer sum and the float work is a multiply-add per block:
//   Q8_0, Q4_0, Q5_0 weights  <- q8_0 rows: per 32 values d = max|x| / 127 and int8 q = rint(x / d)
//   Q4_1, Q5_1                <- q8_1: q8_0 plus s = d * sum(q) (the weight's min times s)
//   Q4_K, Q5_K, Q6_K          <- q8_K: per 256 values one d, int8 q, and the sums of q per 32
//                                (Q4_K, Q5_K: times the sub-block mins) or per 16 (Q6_K: its -32)
// (d and s stay fp32 where llama.cpp rounds them to fp16.) F16 and BF16 weights take the fp32
// activations as they are, converting weights on the fly.
//
// Batch invariance: a row's quantisation depends on that row only, threads split N (never
// K), and each output y[m, n] is one fixed sequence of float operations whatever M, the tile
// its row falls in or the thread that runs it, so a row's result is bit for bit the same
// alone or in any batch. -ffast-math would let the compiler reassociate sums differently in
// each function it inlines into; the sums that matter are fused multiply-adds (which it
// cannot reassociate) and horizontal sums whose partial results pass through `opaque`.
//
// Three paths, chosen at run time: AVX-512 (F, BW, VL and VNNI: the 32-value block types;
// the others run their AVX2 code there), AVX2 (+FMA, F16C) and portable C++; the SIMD ones
// are functions compiled with a target attribute, so the file builds anywhere. They compute
// the same integers
// and the same float operations in the same order, so they agree bit for bit (up to the
// sign of a zero): per output of a 32-block type, 8 lanes each take one fused multiply-add
// per block (lane j: d_w * d_x times the integer dot of the block's values 4j..4j+3), then
// the lanes are summed in a fixed tree (hsum8), then (Q4_1, Q5_1) plus the chain of
// m_w * s_x over the blocks; per output of a K-quant, 8 lanes (and 4 for the mins) each take
// one fused multiply-add per 256-block, summed in fixed trees at the end (dotk_portable); per output of F16/BF16, 16 lanes (k mod 16) of fused
// multiply-adds over k, then a fixed tree. Bias last.
//
// Work split: rows of W in chunks of 16 per thread (OpenMP, static), only when the matrix is
// big enough to pay for the threads (inside the decoder stack's team, always). Up to 8 rows of x, each weight row is read once while
// every tile of (up to 4) x rows takes it from L1; a single x row takes 4 or 8 weight rows
// at once. More rows of x: each tile of 4 sweeps a chunk of 16 weight rows kept in cache.
//
// Layouts: x [M, K] fp32, w [N, row_bytes] uint8, bias [N] fp32 or null, y [M, N] fp32,
// all contiguous.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#define QG_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(QG_EMULATE_AVX512)  // the AVX-512 path through SIMDe's portable intrinsics (tests)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#endif
#endif

#include "team.h"

namespace {

enum : int { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
enum : int { PATH_BEST = 0, PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512 = 3 };

constexpr int64_t QK = 256;      // values per K-quant block
constexpr int64_t NCHUNK = 16;   // weight rows per unit of work (a thread's share is whole chunks)
constexpr int MT = 4;            // activation rows per tile: one weight block decoded serves them all
// How far ahead of the block it reads a decode-sized call prefetches the weights (bytes; the
// rows of a chunk are contiguous, so this runs into the rows that follow). The hardware
// prefetcher alone left batch-1 decode at 11-15 GB/s of a memory that streams 19; 8 KiB
// ahead measured best on Zen 3 (2 KiB: +12%, 8 KiB: +25% tok/s, 32 KiB: worse again).
constexpr int64_t kPrefetch = 8192;

int64_t block_of(int t) { return t == F16 || t == BF16 ? 1 : t == Q4_K || t == Q5_K || t == Q6_K ? QK : 32; }
int64_t bytes_of(int t) {
    switch (t) {
        case F16: case BF16: return 2;
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}

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

// ---- activations ----------------------------------------------------------------------

// One row in blocks of B values: d[b] = max|x| / 127, q = rint(x * 127 / max|x|) (ties to
// even), s[b] = d[b] * sum(q) when s is given, bs = sums of q per `group` values when given.
void quantize_row(const float* x, int64_t K, int64_t B, int8_t* q, float* d, float* s, int16_t* bs, int64_t group) {
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
        if (s) {
            int32_t sum = 0;
            for (int64_t i = 0; i < B; i++) sum += qb[i];
            s[b] = d[b] * float(sum);
        }
        if (bs)
            for (int64_t g = 0; g < B / group; g++) {
                int32_t sum = 0;
                for (int64_t i = 0; i < group; i++) sum += qb[g * group + i];
                bs[b * (B / 16) + g] = int16_t(sum);  // a block's sums 16 apart, whatever the group
            }
    }
}

// Everything one call works on. Activation row m: q + m * K, d and s + m * nb, bs + m * nb * 16
// (sums of q per 16 values for Q6_K, per 32 for Q4_K and Q5_K: 8 used of 16).
struct Ctx {
    int64_t M, K, N, nb, rb;  // nb: weight blocks per row; rb: bytes per weight row
    const uint8_t* w;
    const float* x;           // fp32 activations (F16, BF16)
    const int8_t* q;
    const float* d;
    const float* s;
    const int16_t* bs;
    const float* bias;
    float* y;
    int64_t ldy;              // y[m, n] is y[m * ldy + n]
    bool stream;              // each weight row is read once (decode sizes): prefetch ahead
};

// ---- block layouts (portable decoders; also the reference for the AVX2 loaders) --------

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
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++)
                    q[128 * h + 32 * t + l] = uint8_t(((ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15) |
                                                      (((qh[32 * h + l] >> (2 * t)) & 3) << 4));
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

// ---- portable path ----------------------------------------------------------------------

template <int T>
float dot32_portable(const uint8_t* w, int64_t nb, const int8_t* x, const float* xd, const float* xs) {
    constexpr int64_t size = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
    constexpr bool has_min = T == Q4_1 || T == Q5_1;
    float acc[8] = {}, mins = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * size;
        int8_t q[32];
        decode32<T>(blk, q);
        const int8_t* xb = x + b * 32;
        const float scale = f16(rd16(blk)) * xd[b];
        for (int j = 0; j < 8; j++) {
            int32_t p = 0;
            for (int t = 0; t < 4; t++) p += int32_t(q[4 * j + t]) * xb[4 * j + t];
            acc[j] = madd(scale, float(p), acc[j]);
        }
        if constexpr (has_min) mins = madd(f16(rd16(blk + 2)), xs[b], mins);
    }
    float v = hsum8(acc);
    if constexpr (has_min) v = opaque(v + mins);
    return v;
}

// K-quants, per output: 8 float lanes, lane l taking values 4l..4l+3 of every 32 (the lanes of
// the AVX2 integer sums); per 256-block each lane's exact integer sum, its sub-block scales
// applied in integers (Q6_K: its -32 too), goes in with one fused multiply-add by d_w * d_x.
// Q4_K and Q5_K add their mins in 4 more lanes (lane l: sub-blocks 2l and 2l + 1), one fused
// multiply-add by -dmin_w * d_x per block. At the end the 8 lanes in hsum8's tree, plus the 4
// in hsum4's. (Summing the lanes once per output, not once per block, is what lets a tile of
// several x rows spend its time on the products.)
inline float hsum4(const float* a) { return opaque(opaque(a[0] + a[2]) + opaque(a[1] + a[3])); }

template <int T>
float dotk_portable(const uint8_t* w, int64_t nb, const int8_t* x, const float* xd, const int16_t* bs) {
    constexpr int64_t size = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
    float acc[8] = {}, accm[4] = {};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * size;
        uint8_t q[QK];
        decode256<T>(blk, q);
        const int8_t* xb = x + b * QK;
        const int16_t* sb = bs + b * 16;
        int32_t lane[8] = {};
        if constexpr (T == Q6_K) {
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
            for (int i = 0; i < QK; i++) lane[(i % 32) / 4] += sc[i / 16] * int32_t(q[i]) * xb[i];
            for (int l = 0; l < 8; l++) lane[l] += -32 * (sc[2 * l] * sb[2 * l] + sc[2 * l + 1] * sb[2 * l + 1]);
            const float s = f16(rd16(blk + 208)) * xd[b];
            for (int l = 0; l < 8; l++) acc[l] = madd(s, float(lane[l]), acc[l]);
        } else {
            uint8_t sc[8], mn[8];
            kscales(blk + 4, sc, mn);
            for (int i = 0; i < QK; i++) lane[(i % 32) / 4] += sc[i / 32] * int32_t(q[i]) * xb[i];
            const float dx = xd[b];
            const float s = f16(rd16(blk)) * dx, sm = -(f16(rd16(blk + 2)) * dx);
            for (int l = 0; l < 8; l++) acc[l] = madd(s, float(lane[l]), acc[l]);
            for (int l = 0; l < 4; l++) accm[l] = madd(sm, float(mn[2 * l] * sb[2 * l] + mn[2 * l + 1] * sb[2 * l + 1]), accm[l]);
        }
    }
    float v = hsum8(acc);
    if constexpr (T != Q6_K) v = opaque(v + hsum4(accm));
    return v;
}

template <bool BF>
float dot16_portable(const uint16_t* w, const float* x, int64_t K) {
    float acc[16] = {};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; l++) acc[l] = madd(x[k + l], BF ? bf16(w[k + l]) : f16(w[k + l]), acc[l]);
    for (int l = 0; k + l < K; l++) acc[l] = madd(x[k + l], BF ? bf16(w[k + l]) : f16(w[k + l]), acc[l]);
    float v[8];
    for (int j = 0; j < 8; j++) v[j] = opaque(acc[j] + acc[j + 8]);
    return hsum8(v);
}

// Outputs y[m0 .. m0 + mt - 1, n .. n + cols - 1].
template <int T>
void rows_portable(const Ctx& c, int64_t n0, int cols, int64_t m0, int mt) {
    for (int64_t n = n0; n < n0 + cols; n++)
    for (int64_t m = m0; m < m0 + mt; m++) {
        const uint8_t* w = c.w + n * c.rb;
        float v;
        if constexpr (T == F16 || T == BF16)
            v = dot16_portable<T == BF16>(reinterpret_cast<const uint16_t*>(w), c.x + m * c.K, c.K);
        else if constexpr (T == Q4_K || T == Q5_K || T == Q6_K)
            v = dotk_portable<T>(w, c.nb, c.q + m * c.K, c.d + m * c.nb, c.bs + m * c.nb * 16);
        else
            v = dot32_portable<T>(w, c.nb, c.q + m * c.K, c.d + m * c.nb, c.s ? c.s + m * c.nb : nullptr);
        c.y[m * c.ldy + n] = c.bias ? v + c.bias[n] : v;
    }
}

// ---- AVX2 path --------------------------------------------------------------------------
#if defined(QG_X86)
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
    constexpr int64_t size = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
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
    constexpr int64_t S = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
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

bool have_avx2();

// ---- AVX-512 path (AVX-512 F/BW/VL and VNNI) -----------------------------------------------
// The 32-value block types with vpdpbusd (u8 x s8, four products summed into an int32, no
// saturation), two blocks per 512-bit vector; the K-quants, F16 and BF16 run their AVX2 tiles.
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
    constexpr int64_t size = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
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

// rows_avx2's work split, with the 32-block tiles above; other types run rows_avx2.
template <int T>
QG_AVX512 void rows_avx512(const Ctx& c, int64_t n, int cols, int64_t m0, int mt) {
    if constexpr (T == F16 || T == BF16 || T == Q4_K || T == Q5_K || T == Q6_K) {
        rows_avx2<T>(c, n, cols, m0, mt);
    } else {
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
#else
bool have_avx2() { return false; }
bool have_avx512() { return false; }
#endif

// ---- dispatch ---------------------------------------------------------------------------

using RowsFn = void (*)(const Ctx&, int64_t n, int cols, int64_t m0, int mt);

template <template <int> class Pick>
RowsFn pick(int t) {
    switch (t) {
        case F16: return Pick<F16>::fn;
        case BF16: return Pick<BF16>::fn;
        case Q4_0: return Pick<Q4_0>::fn;
        case Q4_1: return Pick<Q4_1>::fn;
        case Q5_0: return Pick<Q5_0>::fn;
        case Q5_1: return Pick<Q5_1>::fn;
        case Q8_0: return Pick<Q8_0>::fn;
        case Q4_K: return Pick<Q4_K>::fn;
        case Q5_K: return Pick<Q5_K>::fn;
        case Q6_K: return Pick<Q6_K>::fn;
        default: return nullptr;
    }
}
template <int T> struct PickPortable { static constexpr RowsFn fn = rows_portable<T>; };
#if defined(QG_X86)
template <int T> struct PickAvx2 { static constexpr RowsFn fn = rows_avx2<T>; };
template <int T> struct PickAvx512 { static constexpr RowsFn fn = rows_avx512<T>; };
#endif

// The weight rows in chunks of NCHUNK, split among the threads (each output is computed by
// exactly one call, whatever the split). Decode-sized batches take every activation tile
// for one weight row while it is in L1; larger ones sweep a chunk of rows (kept in L1/L2)
// per tile of activation rows.
void drive(const Ctx& c, RowsFn fn) {
    const int64_t chunks = (c.N + NCHUNK - 1) / NCHUNK;
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t n0 = ch * NCHUNK, n1 = std::min(c.N, n0 + NCHUNK);
        if (c.M <= 2 * MT) {
            for (int64_t n = n0; n < n1; n += 8)
                for (int64_t m0 = 0; m0 < c.M; m0 += MT)
                    fn(c, n, int(std::min<int64_t>(8, n1 - n)), m0, int(std::min<int64_t>(MT, c.M - m0)));
        } else {
            for (int64_t m0 = 0; m0 < c.M; m0 += MT)
                for (int64_t n = n0; n < n1; n += 2)
                    fn(c, n, int(std::min<int64_t>(2, n1 - n)), m0, int(std::min<int64_t>(MT, c.M - m0)));
        }
    }
}

// Where the quantised activations of M rows lie in one buffer: int8 values, then a scale per
// block, then (Q4_1, Q5_1) d * sum(q) per block, then (K-quants) sums of q per 16 values.
struct Acts {
    int64_t nq, nd, nbs;  // 8-byte words of each part
    bool with_s, with_bs;
    Acts(int qtype, int64_t M, int64_t K) {
        const int64_t B = block_of(qtype);
        with_s = qtype == Q4_1 || qtype == Q5_1;
        with_bs = B == QK;
        nq = B > 1 ? (M * K + 7) / 8 : 0;
        nd = B > 1 ? (M * (K / B) + 1) / 2 : 0;
        nbs = with_bs ? (M * K / 16 + 3) / 4 : 0;
    }
    int64_t words() const { return nq + nd * (with_s ? 2 : 1) + nbs; }
};

}  // namespace

namespace nanoinfer {

int64_t quant_acts_bytes(int qtype, int64_t M, int64_t K) { return Acts(qtype, M, K).words() * 8; }

// The activation format a weight type takes: q8_0, q8_1 (with d * sum), q8_K with sums per 32
// (Q4_K, Q5_K) or per 16 (Q6_K), or none (F16, BF16).
int acts_format(int t) {
    switch (t) {
        case Q4_0: case Q5_0: case Q8_0: return 1;
        case Q4_1: case Q5_1: return 2;
        case Q4_K: case Q5_K: return 3;
        case Q6_K: return 4;
        default: return 0;
    }
}

bool same_acts(int a, int b) { return acts_format(a) == acts_format(b); }

// Returns 0, or -1: no kernel for qtype, -2: path unavailable, -3: K not a multiple of the block.
// Every thread of a team returns the same: the checks depend on the arguments only.
__attribute__((noinline)) int quant_linear_team(int qtype, int path, const float* x, int64_t M, int64_t K,
                                                const uint8_t* w, int64_t N, const float* bias, float* y, int64_t ldy,
                                                void* acts, bool quantise) {
    if (bytes_of(qtype) == 0) return -1;
    const int64_t B = block_of(qtype);
    if (K <= 0 || K % B != 0) return -3;
    if (path == PATH_BEST) path = have_avx512() ? PATH_AVX512 : have_avx2() ? PATH_AVX2 : PATH_PORTABLE;
    if ((path == PATH_AVX2 && !have_avx2()) || (path == PATH_AVX512 && !have_avx512())) return -2;
    if (path != PATH_AVX512 && path != PATH_AVX2 && path != PATH_PORTABLE) return -2;
    RowsFn fn = pick<PickPortable>(qtype);
#if defined(QG_X86)
    if (path == PATH_AVX2) fn = pick<PickAvx2>(qtype);
    if (path == PATH_AVX512) fn = pick<PickAvx512>(qtype);
#endif
    if (M <= 0 || N <= 0) return 0;

    Ctx c{M, K, N, K / B, K / B * bytes_of(qtype), w, x, nullptr, nullptr, nullptr, nullptr, bias, y, ldy, M <= 2 * MT};
    if (B > 1) {
        const Acts a(qtype, M, K);
        uint64_t* p = static_cast<uint64_t*>(acts);
        c.q = reinterpret_cast<const int8_t*>(p);
        c.d = reinterpret_cast<const float*>(p + a.nq);
        c.s = a.with_s ? reinterpret_cast<const float*>(p + a.nq + a.nd) : nullptr;
        c.bs = a.with_bs ? reinterpret_cast<const int16_t*>(p + a.nq + a.nd * (a.with_s ? 2 : 1)) : nullptr;
        if (quantise) {
            const int64_t group = qtype == Q6_K ? 16 : 32;
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                quantize_row(x + m * K, K, B, const_cast<int8_t*>(c.q) + m * K, const_cast<float*>(c.d) + m * c.nb,
                             c.s ? const_cast<float*>(c.s) + m * c.nb : nullptr,
                             c.bs ? const_cast<int16_t*>(c.bs) + m * (K / 16) : nullptr, group);
        }
    }
    drive(c, fn);
    return 0;
}

}  // namespace nanoinfer

// Bit p set when path p (PATH_PORTABLE, PATH_AVX2, PATH_AVX512) runs on this CPU.
extern "C" int quant_paths() {
    return (1 << PATH_PORTABLE) | (have_avx2() ? 1 << PATH_AVX2 : 0) | (have_avx512() ? 1 << PATH_AVX512 : 0);
}

// The arguments of quant_linear, as one array of int64 (one ctypes argument converts faster
// than nine): qtype, path (PATH_*), x, w, bias (or 0), y, M, K, N.
struct LinearArgs {
    int64_t qtype, path;
    const float* x;
    const uint8_t* w;
    const float* bias;
    float* y;
    int64_t M, K, N;
};

// Returns 0 or the codes of quant_linear_team.
extern "C" int quant_linear(const LinearArgs* a) {
    const int qtype = int(a->qtype);
    const int64_t M = a->M, K = a->K, N = a->N;
    if (bytes_of(qtype) == 0) return -1;
    // The quantised activations, in one buffer per calling thread, reused across calls.
    static thread_local std::vector<uint64_t> buf;
    buf.resize(size_t(std::max<int64_t>(1, Acts(qtype, std::max<int64_t>(M, 0), K).words())));
    void* acts = buf.data();  // taken here: in the team, `buf` names each thread's own
    // Threads only where there is work for them: starting a team and the barriers cost a few
    // microseconds, more than a small matrix takes.
    const int64_t rb = K > 0 && K % block_of(qtype) == 0 ? K / block_of(qtype) * bytes_of(qtype) : 0;
    const bool parallel = N * rb * std::min<int64_t>(M, 4) >= (1 << 16) && N >= 2 * NCHUNK;
    if (!parallel)
        return nanoinfer::quant_linear_team(qtype, int(a->path), a->x, M, K, a->w, N, a->bias, a->y, N, acts, true);
    int rc = 0;
#pragma omp parallel
    {
        const int r = nanoinfer::quant_linear_team(qtype, int(a->path), a->x, M, K, a->w, N, a->bias, a->y, N, acts,
                                                   true);
#pragma omp master
        rc = r;
    }
    return rc;
}

// out[r] = row rows[r] of w dequantised (K values), exactly as gguf's numpy dequantisation
// computes it. Returns 0, -1: no kernel for qtype, -3: bad K, -4: a row out of range.
extern "C" int quant_dequantize_rows(int qtype, const uint8_t* w, int64_t N, int64_t K, const int64_t* rows,
                                     int64_t R, float* out) {
    const int64_t size = bytes_of(qtype), B = block_of(qtype);
    if (size == 0) return -1;
    if (K <= 0 || K % B != 0) return -3;
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= N) return -4;
    const int64_t nb = K / B, rb = nb * size;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t* row = w + rows[r] * rb;
        float* o = out + r * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t* blk = row + b * size;
            float* ob = o + b * B;
            switch (qtype) {
                case F16: ob[0] = f16(rd16(blk)); break;
                case BF16: ob[0] = bf16(rd16(blk)); break;
                case Q4_0: case Q5_0: case Q8_0: case Q4_1: case Q5_1: {
                    int8_t q[32];
                    if (qtype == Q4_0) decode32<Q4_0>(blk, q);
                    else if (qtype == Q5_0) decode32<Q5_0>(blk, q);
                    else if (qtype == Q8_0) decode32<Q8_0>(blk, q);
                    else if (qtype == Q4_1) decode32<Q4_1>(blk, q);
                    else decode32<Q5_1>(blk, q);
                    const float d = f16(rd16(blk));
                    const float m = qtype == Q4_1 || qtype == Q5_1 ? f16(rd16(blk + 2)) : 0.f;
                    // d * q is exact (11 x 8 bits): one rounding, in the add, as numpy's d * q + m
                    for (int i = 0; i < 32; i++) ob[i] = d * float(q[i]) + m;
                    break;
                }
                case Q4_K: case Q5_K: {
                    uint8_t q[QK], sc[8], mn[8];
                    if (qtype == Q4_K) decode256<Q4_K>(blk, q);
                    else decode256<Q5_K>(blk, q);
                    kscales(blk + 4, sc, mn);
                    const float d = f16(rd16(blk)), dmin = f16(rd16(blk + 2));
                    for (int j = 0; j < 8; j++) {
                        // d * sc and dmin * m exact, (d * sc) * q exact (<= 22 bits): one rounding
                        const float ds = d * float(sc[j]), dm = dmin * float(mn[j]);
                        for (int l = 0; l < 32; l++) ob[32 * j + l] = ds * float(q[32 * j + l]) - dm;
                    }
                    break;
                }
                case Q6_K: {
                    uint8_t q[QK];
                    decode256<Q6_K>(blk, q);
                    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
                    const float d = f16(rd16(blk + 208));
                    for (int g = 0; g < 16; g++) {
                        const float ds = opaque(d * float(sc[g]));  // exact; then one rounding, in ds * q as numpy
                        for (int l = 0; l < 16; l++) ob[16 * g + l] = ds * float(int(q[16 * g + l]) - 32);
                    }
                    break;
                }
            }
        }
    }
    return 0;
}
