// The pieces of a decoder layer as functions that every thread of an OpenMP team calls
// together (the work is split with `omp for`, which ends in a barrier), so that the decoder
// stack (decoder_stack.cpp) runs a whole forward in one parallel region. Each is the one
// body that the file's own C entry point runs too: both callers compute the same bits.
// Outside a parallel region they run on the calling thread alone.
#pragma once
#include <cstdint>

namespace nanoinfer {

// ---- quant_gemm.cpp --------------------------------------------------------------------

// Up to this many rows (decode sizes) quant_linear_team streams each weight row once,
// prefetching ahead (and the thread's side_prefetch ranges with it).
constexpr int64_t kStreamRows = 8;
// Bytes of quantised activations for M rows of K values, as a weight of qtype needs them.
int64_t quant_acts_bytes(int qtype, int64_t M, int64_t K);
// y[m, n] (row stride ldy) = x[m] . W[n] (+ bias[n]) for W [N, K] in qtype's blocks (in its
// repacked layout when `repacked`), on `path` (0: the best). `acts`: quant_acts_bytes(qtype, M, K) bytes, shared by the team; with
// quantise false, it already holds x quantised for a weight of the same activation format
// (the previous part of a fused projection). Returns 0 or quant_linear's error codes.
int quant_linear_team(int qtype, int path, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                      bool repacked, const float* bias, float* y, int64_t ldy, void* acts, bool quantise);
// G weights of one type and shape [N, K] (a routed layer's experts), weight g applied to rows
// start[g] .. start[g + 1] of x, writing those rows of y: as G calls of quant_linear_team (the
// same bits per row), with one quantisation of all start[G] rows and one work split over every
// weight's row chunks, so the team meets once rather than once per weight.
int quant_linear_grouped_team(int qtype, int path, const float* x, int64_t K, const uint8_t* const* w,
                              const int64_t* start, int64_t G, int64_t N, bool repacked, float* y, int64_t ldy,
                              void* acts, bool quantise);
// The same activation quantisation for weights of types a and b.
bool same_acts(int a, int b);

// ---- packed_gemm.cpp -------------------------------------------------------------------

// y [M, N] (row stride ldy) = x [M, K] w^T (+ bias [N]) for w [N, K] fp32 in pack_f32's
// panels (cpu_kernels.py): an fp32 model's linears, an F32 file's attention and MLP.
void linear_packed_f32_team(const float* x, const float* packed, const float* bias, float* y, int64_t ldy, int64_t M,
                            int64_t K, int64_t N);

// ---- routed_experts.cpp ----------------------------------------------------------------

// The layer as the kernels see it; kernels/routed_experts.py fills it (ctypes), the decoder
// stack's layers point to it.
struct RoutedExperts {
    int64_t num_experts, top_k, norm_topk, hidden, inter;
    const float* router;            // [num_experts, hidden] fp32
    int64_t qtype[3], repacked[3];  // gate, up, down: every expert's in one type and layout
    const uint8_t* const* w[3];     // [num_experts] each: gate and up [inter, hidden], down [hidden, inter]
};
// Bytes of work space routed_experts_team needs for T rows.
int64_t routed_experts_bytes(const RoutedExperts& L, int64_t T);
// out [T, hidden] = the routed experts' MLP of x [T, hidden]; `work`: routed_experts_bytes,
// 64-byte aligned, shared by the team. choices, weights: [T, top_k] each row's experts (in
// expert order) and their weights, written when not null. Returns 0 or quant_linear's codes.
int routed_experts_team(const RoutedExperts& L, int path, const float* x, int64_t T, float* out, void* work,
                        int32_t* choices, float* weights);

// ---- paged_attention.cpp ---------------------------------------------------------------

// Work units of each row's attention (offset: B + 1 values); returns their number.
int64_t attention_plan(const int64_t* ctx, int64_t B, int64_t window, int64_t* offset);
// The calling thread's side_prefetch() ranges set to the keys and values its items of
// attention_team_f32 will read, given the same arguments and attention_plan's offset.
void attention_side_prefetch(const void* k, const void* v, int kv_format, const int64_t* tables, int64_t width,
                             const int64_t* ctx, int64_t B, int64_t Hkv, int64_t D, int64_t bs, int64_t window,
                             const int64_t* offset);
// The KV cache's formats (attention/kv_cache.py).
enum KVFormat : int { KV_F32 = 0, KV_BF16 = 1, KV_Q8_0 = 2 };
// paged_decode with fp32 q and out over an fp32, bf16 or q8_0 cache. units: offset[B] * H * (D + 2)
// floats shared by the team; s: H * (max_ctx + D) floats of this thread's own.
void attention_team_f32(const float* q, const int64_t* rows, const void* k, const void* v, int kv_format,
                        const int64_t* tables, int64_t width, const int64_t* ctx, float* out, int64_t B, int64_t H,
                        int64_t Hkv, int64_t D, int64_t bs, int64_t window, int64_t max_ctx, float scale,
                        float softcap, const int64_t* offset, float* units, float* s);

// ---- layer_ops.cpp (one row each; fp32) ------------------------------------------------

void rms_norm_row_f32(float* x, const float* add, const float* w, float* out, int64_t dim, float eps);
void rope_row_f32(const float* x, const float* cos, const float* sin, float* out, int64_t heads, int64_t D);
void silu_mul_row_f32(const float* gate_up, float* out, int64_t inter);
void gelu_tanh_mul_row_f32(const float* gate_up, float* out, int64_t inter);

}  // namespace nanoinfer
