// Decode attention over a paged KV cache, for the CPU: one query token per sequence,
// keys and values read straight from their blocks (no gathered copy, no padding).
//
// Built at first use by nanoinfer/cpu_kernels.py (c++ -O3 -march=native -fopenmp) and
// called through ctypes; nanoinfer/attention.py's plain PyTorch path is the reference it
// is tested against, and what runs when no compiler is found.
//
// Layouts (all contiguous):
//   q, out    [T, H, D]             rows[b] is the row of sequence b's query
//   k, v      [blocks, block_size, Hkv, D]   one layer's cache
//   tables    [B, width]            block ids of each sequence, in order
//   ctx       [B]                   keys each sequence attends over (its position + 1)
// Query head h reads kv head h / (H / Hkv) (grouped-query attention). window > 0 keeps
// only the last `window` keys (sliding window). Softmax scale: 1 / sqrt(D).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

struct BF16 { uint16_t bits; };

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const BF16* p, int64_t i) {
    uint32_t u = uint32_t(p[i].bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(BF16* p, int64_t i, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffff) > 0x7f800000) { p[i].bits = uint16_t((u >> 16) | 0x40); return; }  // NaN
    u += 0x7fff + ((u >> 16) & 1);
    p[i].bits = uint16_t(u >> 16);
}

// e^x for x <= 0 in plain arithmetic, so that the softmax loop vectorises (a libm call
// does not): x = k ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7, 2^k
// through the exponent bits. Relative error below 1e-7 over [-87, 0].
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float k = std::floor(x * 1.44269504f + 0.5f);
    const float r = x - k * 0.693145752f - k * 1.42860677e-06f;  // ln2 in two parts
    float p = 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (int32_t(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

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

// One sequence, every head. qf: [H, D] fp32, already scaled. s: [H, n - start] scratch.
// acc: [H, D] out. D_ > 0 fixes the head size at compile time (the loops unroll).
template <typename T, int D_>
void attend_one(const float* qf, const T* k, const T* v, const int64_t* table, int64_t start, int64_t n,
                int64_t bs, int64_t Hkv, int64_t G, int64_t D, float* s, float* acc) {
    if (D_ > 0) D = D_;
    const int64_t S = n - start, H = Hkv * G, row = Hkv * D;
    // scores: the keys are read in cache order, a whole token row (all kv heads) at a time
    for (int64_t t = start; t < n;) {
        const Run run = block_run(table, t, n, bs);
        prefetch_block(k, table, t + run.count, n, bs, row);
        const T* kp = k + run.slot * row;
        for (int64_t j = 0; j < run.count; j++, kp += row)
            for (int64_t hk = 0; hk < Hkv; hk++)
                for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
                    const float* qh = qf + h * D;
                    const T* kh = kp + hk * D;
                    float a = 0.f;
                    for (int64_t d = 0; d < D; d++) a += qh[d] * load(kh, d);
                    s[h * S + t - start + j] = a;
                }
        t += run.count;
    }
    for (int64_t h = 0; h < H; h++) {
        float* sh = s + h * S;
        float m = -INFINITY, l = 0.f;
        for (int64_t i = 0; i < S; i++) m = sh[i] > m ? sh[i] : m;
        for (int64_t i = 0; i < S; i++) sh[i] = exp_nonpositive(sh[i] - m);
        for (int64_t i = 0; i < S; i++) l += sh[i];
        const float inv = 1.f / l;
        for (int64_t i = 0; i < S; i++) sh[i] *= inv;
        for (int64_t d = 0; d < D; d++) acc[h * D + d] = 0.f;
    }
    for (int64_t t = start; t < n;) {
        const Run run = block_run(table, t, n, bs);
        prefetch_block(v, table, t + run.count, n, bs, row);
        const T* vp = v + run.slot * row;
        for (int64_t j = 0; j < run.count; j++, vp += row)
            for (int64_t hk = 0; hk < Hkv; hk++)
                for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
                    const float p = s[h * S + t - start + j];
                    const T* vh = vp + hk * D;
                    float* ah = acc + h * D;
                    for (int64_t d = 0; d < D; d++) ah[d] += p * load(vh, d);
                }
        t += run.count;
    }
}

// Returns 0, or 1 if a thread could not allocate its scratch (nothing is then written).
template <typename T>
int paged_decode(const T* q, const int64_t* rows, const T* k, const T* v, const int64_t* tables, int64_t width,
                 const int64_t* ctx, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                 int64_t window, int64_t max_ctx) {
    const int64_t G = H / Hkv;
    const float scale = 1.f / std::sqrt(float(D));
    int failed = 0;
#pragma omp parallel
    {
        float* s = static_cast<float*>(std::malloc(sizeof(float) * (H * max_ctx + 2 * H * D)));
        float* acc = s + H * max_ctx;
        float* qf = acc + H * D;
        if (s == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(dynamic)
        for (int64_t b = 0; b < (failed ? 0 : B); b++) {
            const int64_t n = ctx[b], start = window > 0 && n > window ? n - window : 0;
            const T* qb = q + rows[b] * H * D;
            for (int64_t i = 0; i < H * D; i++) qf[i] = load(qb, i) * scale;
            const int64_t* table = tables + b * width;
            if (D == 64) attend_one<T, 64>(qf, k, v, table, start, n, bs, Hkv, G, D, s, acc);
            else if (D == 128) attend_one<T, 128>(qf, k, v, table, start, n, bs, Hkv, G, D, s, acc);
            else attend_one<T, 0>(qf, k, v, table, start, n, bs, Hkv, G, D, s, acc);
            T* ob = out + rows[b] * H * D;
            for (int64_t i = 0; i < H * D; i++) store(ob, i, acc[i]);
        }
        std::free(s);
    }
    return failed;
}

}  // namespace

#define ENTRY(NAME, T)                                                                                      \
    extern "C" int NAME(const T* q, const int64_t* rows, const T* k, const T* v, const int64_t* tables,    \
                        int64_t width, const int64_t* ctx, T* out, int64_t B, int64_t H, int64_t Hkv,      \
                        int64_t D, int64_t bs, int64_t window, int64_t max_ctx) {                          \
        return paged_decode<T>(q, rows, k, v, tables, width, ctx, out, B, H, Hkv, D, bs, window, max_ctx); \
    }
ENTRY(paged_decode_f32, float)
ENTRY(paged_decode_bf16, BF16)
