// The small fp32 operations of a decoder layer, each one pass over its rows instead of the
// several PyTorch ops (and temporaries) it takes to spell them: RMSNorm with the residual
// add before it, rotary embedding, and SwiGLU's silu(gate) * up. At decode they are a few
// dozen rows, where the cost of an op is its dispatch; at prefill they are a few thousand,
// where it is the passes over memory.
//
// nanoinfer/layer_ops.py holds the PyTorch formulas they are tested against (and that run
// where the kernels cannot). Layouts: contiguous rows unless a stride is given.
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

constexpr int64_t kParallelFloats = 1 << 15;  // below this much work, threads cost more than they save

}  // namespace

// If add is given, x += add first (x is the residual stream, updated in place). Then
// out = w * (x / sqrt(mean(x^2) + eps)), w optional.
extern "C" void rms_norm_f32(float* x, const float* add, const float* w, float* out, int64_t rows, int64_t dim,
                             float eps) {
#pragma omp parallel for if (rows * dim >= kParallelFloats)
    for (int64_t r = 0; r < rows; r++) {
        float* xr = x + r * dim;
        float* o = out + r * dim;
        float ss = 0.f;
        if (add) {
            const float* ar = add + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                xr[i] += ar[i];
                ss += xr[i] * xr[i];
            }
        } else {
            for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        }
        const float scale = 1.f / std::sqrt(ss / float(dim) + eps);
        if (w)
            for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * scale);
        else
            for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * scale;
    }
}

// Rotary embedding, rotate-half layout: for each row t and head h of x (rows `stride`
// floats apart, `heads` heads of D), the pairs (i, i + D/2) turn by the angle whose cos and
// sin are cos[t, i], sin[t, i] ([rows, D/2]). Written to out, contiguous [rows, heads, D].
extern "C" void rope_f32(const float* x, int64_t stride, const float* cos, const float* sin, float* out,
                         int64_t rows, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
#pragma omp parallel for if (rows * heads * D >= kParallelFloats)
    for (int64_t t = 0; t < rows; t++) {
        const float* c = cos + t * half;
        const float* s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float* a = x + t * stride + h * D;
            float* o = out + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = a[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

// out[r] = silu(gate) * up where gate, up are the two halves of gate_up[r] (each `inter`
// floats). silu(g) = g / (1 + e^-g), with e^-|g| so that the exponential never overflows.
extern "C" void silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= kParallelFloats)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float e = exp_nonpositive(-std::fabs(g[i]));
            const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}
