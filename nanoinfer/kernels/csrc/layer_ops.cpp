// The small operations of a decoder layer, each one pass over its rows instead of the
// several PyTorch ops (and temporaries) it takes to spell them: RMSNorm with the residual
// add before it, rotary embedding, and the gated MLPs' silu(gate) * up and gelu_tanh(gate) * up. At decode they are a few
// dozen rows, where the cost of an op is its dispatch; at prefill they are a few thousand,
// where it is the passes over memory.
//
// fp32 and bf16. Arithmetic is in fp32; for bf16, each result that torch rounds to bf16
// (every op on bf16 tensors) is rounded here at the same point (round_as), so the
// kernels compute what the PyTorch formulas in nanoinfer/layer_ops.py compute, which they
// are tested against and which run where the kernels cannot.
//
// Layouts: contiguous rows unless a stride is given.
#include <cmath>
#include <cstdint>

#include "common.h"
#include "team.h"

namespace {

constexpr int64_t kParallelValues = 1 << 15;  // below this much work, threads cost more than they save

// If add is given, x = x + add first (x is the residual stream, updated in place). Then
// out = w * (x / sqrt(mean(x^2) + eps)) (normalised in fp32, rounded, times w), w optional.
// One row. The row functions are never inlined: the entry points below and the decoder
// stack (decoder_stack.cpp) run the same bodies, so they compute the same bits.
template <typename T>
__attribute__((noinline)) void rms_norm_row(T* xr, const T* add, const T* w, T* o, int64_t dim, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < dim; i++) {
        float v = load(xr, i);
        if (add) {
            v = round_as(v + load(add, i), xr);
            store(xr, i, v);
        }
        ss += v * v;
    }
    const float scale = 1.f / std::sqrt(ss / float(dim) + eps);
    for (int64_t i = 0; i < dim; i++) {
        const float n = round_as(load(xr, i) * scale, xr);
        store(o, i, w ? load(w, i) * n : n);
    }
}

template <typename T>
void rms_norm(T* x, const T* add, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= kParallelValues)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, add ? add + r * dim : nullptr, w, out + r * dim, dim, eps);
}

// Rotary embedding, rotate-half layout: for each head h of one row a (`heads` heads of D),
// the pairs (i, i + D/2) turn by the angle whose cos and sin are c[i], s[i]. Written to o.
template <typename T>
__attribute__((noinline)) void rope_row(const T* __restrict a, const T* __restrict c, const T* __restrict s,
                                        T* __restrict o, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++, a += D, o += D)
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load(a, i), x2 = load(a, i + half), ci = load(c, i), si = load(s, i);
            store(o, i, round_as(x1 * ci, o) - round_as(x2 * si, o));
            store(o, i + half, round_as(x2 * ci, o) + round_as(x1 * si, o));
        }
}

// rope_row for each row t of x (rows `stride` values apart), cos and sin [rows, D/2], out
// contiguous [rows, heads, D].
template <typename T>
void rope(const T* x, int64_t stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads, int64_t D) {
#pragma omp parallel for if (rows * heads * D >= kParallelValues)
    for (int64_t t = 0; t < rows; t++) rope_row(x + t * stride, cos + t * (D / 2), sin + t * (D / 2), out + t * heads * D, heads, D);
}

// o = silu(gate) * up where gate, up are the two halves of g (each `inter` values).
// silu(g) = g / (1 + e^-g), with e^-|g| so that the exponential never overflows.
template <typename T>
__attribute__((noinline)) void silu_mul_row(const T* g, T* o, int64_t inter) {
    const T* u = g + inter;
    for (int64_t i = 0; i < inter; i++) {
        const float gi = load(g, i);
        const float e = exp_nonpositive(-std::fabs(gi));
        const float sig = gi >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        store(o, i, round_as(gi * sig, o) * load(u, i));
    }
}

// o = gelu_tanh(gate) * up (Gemma's MLP), gelu_tanh(g) = g / 2 * (1 + tanh(v)), v = sqrt(2 / pi) (g +
// 0.044715 g^3), in torch's order (so 1 + tanh(v) cancels where it does in torch: a gate far below
// zero gives 0, as there); tanh through common.h's tanh_poly_exp.
template <typename T>
__attribute__((noinline)) void gelu_tanh_mul_row(const T* g, T* o, int64_t inter) {
    const T* u = g + inter;
    for (int64_t i = 0; i < inter; i++) {
        const float gi = load(g, i);
        const float v = 0.7978845608028654f * (gi + 0.044715f * gi * gi * gi);
        store(o, i, round_as(0.5f * gi * (1.f + tanh_poly_exp(v)), o) * load(u, i));
    }
}

template <typename T>
void gelu_tanh_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= kParallelValues)
    for (int64_t r = 0; r < rows; r++) gelu_tanh_mul_row(gate_up + r * 2 * inter, out + r * inter, inter);
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= kParallelValues)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * 2 * inter, out + r * inter, inter);
}

}  // namespace

#define LAYER_OPS(SUFFIX, T)                                                                                   \
    extern "C" void rms_norm_##SUFFIX(T* x, const T* add, const T* w, T* out, int64_t rows, int64_t dim,      \
                                      float eps) {                                                           \
        rms_norm(x, add, w, out, rows, dim, eps);                                                            \
    }                                                                                                        \
    extern "C" void rope_##SUFFIX(const T* x, int64_t stride, const T* cos, const T* sin, T* out, int64_t rows, \
                                  int64_t heads, int64_t D) {                                                \
        rope(x, stride, cos, sin, out, rows, heads, D);                                                      \
    }                                                                                                        \
    extern "C" void silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t inter) {                 \
        silu_mul(gate_up, out, rows, inter);                                                                 \
    }                                                                                                        \
    extern "C" void gelu_tanh_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t inter) {            \
        gelu_tanh_mul(gate_up, out, rows, inter);                                                            \
    }

LAYER_OPS(f32, float)
LAYER_OPS(bf16, BF16)

namespace nanoinfer {
void rms_norm_row_f32(float* x, const float* add, const float* w, float* out, int64_t dim, float eps) {
    rms_norm_row(x, add, w, out, dim, eps);
}
void rope_row_f32(const float* x, const float* cos, const float* sin, float* out, int64_t heads, int64_t D) {
    rope_row(x, cos, sin, out, heads, D);
}
void silu_mul_row_f32(const float* gate_up, float* out, int64_t inter) { silu_mul_row(gate_up, out, inter); }
void gelu_tanh_mul_row_f32(const float* gate_up, float* out, int64_t inter) { gelu_tanh_mul_row(gate_up, out, inter); }
}  // namespace nanoinfer
