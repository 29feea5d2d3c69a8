// A mixture-of-experts layer's routed experts (Qwen2/3-MoE, Mixtral) with the experts' weights
// in their GGUF blocks: the router, each row's top_k experts, the rows gathered by expert, one
// multi-row GEMM per expert (all experts' GEMMs in one work split: quant_linear_grouped_team),
// silu(gate) * up, down, and each row's expert outputs summed in expert order, weighted.
//
// Why: in Python a decode step of a 64-expert layer was a router matmul, a sort, and eight
// experts' three linears each, ~30 small calls a layer; here it is one call (or a step of the
// decoder stack's team), the threads meeting about ten times a layer whatever the experts.
//
// One body for both callers (team.h): SparseMoeBlock's forward calls `routed_experts`, the
// decoder stack calls routed_experts_team inside its region, so the two agree bit for bit.
// A row's result depends on that row only: its router logits are fixed-order fp32 dots, its
// experts' GEMM rows are batch invariant (quant_gemm.cpp), and its sum runs in expert order.
//
// Routing, as transformers computes it for these families: softmax over the router's logits
// (fp32), the top_k probabilities (ties to the lower expert id), renormalised to sum 1 where
// the family says so (norm_topk).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "quant/kernel.h"
#include "team.h"

namespace {

using nanoinfer::RoutedExperts;

enum { GATE = 0, UP = 1, DOWN = 2 };

// x . w over n fp32 values: 16 lanes (k mod 16) of fused multiply-adds, then a fixed tree.
float dot_f32(const float* x, const float* w, int64_t n) {
    float acc[16] = {};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16)
        for (int l = 0; l < 16; l++) acc[l] = madd(x[k + l], w[k + l], acc[l]);
    for (int l = 0; k + l < n; l++) acc[l] = madd(x[k + l], w[k + l], acc[l]);
    float v[8];
    for (int j = 0; j < 8; j++) v[j] = opaque(acc[j] + acc[j + 8]);
    return hsum8(v);
}

// Where the parts of the work space lie for T rows (R = T * top_k routed rows), each 64-byte aligned.
struct Work {
    float *logits, *weights, *xg, *gu, *act, *yd;
    int32_t* choices;
    int64_t *pos, *start, *count;  // pos: each choice's gathered row; start: each active expert's first
    const uint8_t** ptrs;          // the active experts' weights: gate, up, down, G each
    void* acts;
    int64_t bytes;

    Work(const RoutedExperts& L, int64_t T, void* base) {
        const int64_t E = L.num_experts, R = T * L.top_k, H = L.hidden, I = L.inter;
        int64_t acts_bytes = 0;
        for (int p = 0; p < 3; p++)
            acts_bytes = std::max(acts_bytes, nanoinfer::quant_acts_bytes(int(L.qtype[p]), R, p == DOWN ? I : H));
        char* at = static_cast<char*>(base);
        int64_t used = 0;
        auto take = [&](int64_t n) {
            char* p = at ? at + used : nullptr;
            used += (n + 63) / 64 * 64;
            return p;
        };
        logits = reinterpret_cast<float*>(take(4 * T * E));
        weights = reinterpret_cast<float*>(take(4 * R));
        choices = reinterpret_cast<int32_t*>(take(4 * R));
        pos = reinterpret_cast<int64_t*>(take(8 * R));
        start = reinterpret_cast<int64_t*>(take(8 * (E + 1)));
        count = reinterpret_cast<int64_t*>(take(8 * (E + 1)));
        ptrs = reinterpret_cast<const uint8_t**>(take(8 * 3 * E));
        xg = reinterpret_cast<float*>(take(4 * R * H));
        gu = reinterpret_cast<float*>(take(4 * R * 2 * I));
        act = reinterpret_cast<float*>(take(4 * R * I));
        yd = reinterpret_cast<float*>(take(4 * R * H));
        acts = take(acts_bytes);
        bytes = used;
    }
};

// Row t's top_k experts, in expert order, and their weights.
void route_row(const RoutedExperts& L, float* probs, int32_t* choice, float* weight) {
    const int64_t E = L.num_experts, k = L.top_k;
    float most = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < E; e++) most = std::max(most, probs[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; e++) {
        probs[e] = std::exp(probs[e] - most);
        sum += probs[e];
    }
    for (int64_t e = 0; e < E; e++) probs[e] /= sum;
    float picked = 0.f;
    for (int64_t j = 0; j < k; j++) {  // the largest left, ties (and NaN rows) to the lower id
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            bool taken = false;
            for (int64_t i = 0; i < j; i++) taken |= choice[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        choice[j] = int32_t(best);
        weight[j] = probs[best];
        picked += probs[best];
    }
    if (L.norm_topk)
        for (int64_t j = 0; j < k; j++) weight[j] /= picked;
    for (int64_t j = 1; j < k; j++)  // into expert order: the order the outputs are summed in
        for (int64_t i = j; i > 0 && choice[i - 1] > choice[i]; i--) {
            std::swap(choice[i - 1], choice[i]);
            std::swap(weight[i - 1], weight[i]);
        }
}

}  // namespace

namespace nanoinfer {

int64_t routed_experts_bytes(const RoutedExperts& L, int64_t T) { return Work(L, T, nullptr).bytes; }

int routed_experts_team(const RoutedExperts& L, int path, const float* x, int64_t T, float* out, void* work,
                        int32_t* choices, float* weights) {
    const int64_t E = L.num_experts, k = L.top_k, H = L.hidden, I = L.inter, R = T * k;
    if (T <= 0) return 0;
    const Work w(L, T, work);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < T * E; u++) w.logits[u] = dot_f32(x + u / E * H, L.router + u % E * H, H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) route_row(L, w.logits + t * E, w.choices + t * k, w.weights + t * k);
    // The plan: the experts chosen (G of them, in order), each one's rows gathered in row order.
#pragma omp single
    {
        std::fill(w.count, w.count + E, 0);
        for (int64_t c = 0; c < R; c++) w.count[w.choices[c]]++;
        int64_t G = 0, row = 0;
        for (int64_t e = 0; e < E; e++) {
            const int64_t n = w.count[e];
            if (!n) continue;
            w.start[G] = row;
            for (int p = 0; p < 3; p++) w.ptrs[p * E + G] = L.w[p][e];
            w.count[e] = row;  // from here: the expert's next gathered row
            row += n;
            G++;
        }
        w.start[G] = row;
        w.count[E] = G;
        for (int64_t c = 0; c < R; c++) w.pos[c] = w.count[w.choices[c]]++;
    }
    const int64_t G = w.count[E];
#pragma omp for schedule(static)
    for (int64_t c = 0; c < R; c++) std::memcpy(w.xg + w.pos[c] * H, x + c / k * H, sizeof(float) * H);
    int rc = quant_linear_grouped_team(int(L.qtype[GATE]), path, w.xg, H, w.ptrs + GATE * E, w.start, G, I,
                                       L.repacked[GATE] != 0, w.gu, 2 * I, w.acts, true);
    if (!rc)
        rc = quant_linear_grouped_team(int(L.qtype[UP]), path, w.xg, H, w.ptrs + UP * E, w.start, G, I,
                                       L.repacked[UP] != 0, w.gu + I, 2 * I, w.acts,
                                       !same_acts(int(L.qtype[GATE]), int(L.qtype[UP])));
    if (rc) return rc;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) silu_mul_row_f32(w.gu + r * 2 * I, w.act + r * I, I);
    rc = quant_linear_grouped_team(int(L.qtype[DOWN]), path, w.act, I, w.ptrs + DOWN * E, w.start, G, H,
                                   L.repacked[DOWN] != 0, w.yd, H, w.acts, true);
    if (rc) return rc;
    // Each row's expert outputs, weighted, summed in expert order.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float* o = out + t * H;
        for (int64_t j = 0; j < k; j++) {
            const float* y = w.yd + w.pos[t * k + j] * H;
            const float g = w.weights[t * k + j];
            if (j == 0)
                for (int64_t i = 0; i < H; i++) o[i] = y[i] * g;
            else
                for (int64_t i = 0; i < H; i++) o[i] += y[i] * g;
        }
        if (choices) std::memcpy(choices + t * k, w.choices + t * k, sizeof(int32_t) * k);
        if (weights) std::memcpy(weights + t * k, w.weights + t * k, sizeof(float) * k);
    }
    return 0;
}

}  // namespace nanoinfer

// The layer for SparseMoeBlock's forward (kernels/routed_experts.py): out [T, hidden] for x
// [T, hidden], on `path` (quant_gemm's PATH_*, 0: the best); choices and weights [T, top_k] as
// routed_experts_team. Returns 0, a quant_linear error code (< 0), or 1: the layer is malformed.
extern "C" int routed_experts(const nanoinfer::RoutedExperts* L, int64_t path, const float* x, int64_t T, float* out,
                              int32_t* choices, float* weights) {
    if (L->num_experts <= 0 || L->top_k <= 0 || L->top_k > L->num_experts || L->hidden <= 0 || L->inter <= 0)
        return 1;
    static thread_local std::vector<uint64_t> buf;
    buf.resize(size_t(nanoinfer::routed_experts_bytes(*L, T) / 8 + 8));
    void* work = buf.data() + (8 - reinterpret_cast<uintptr_t>(buf.data()) / 8 % 8) % 8;  // 64-byte aligned
    int rc = 0;
#pragma omp parallel
    {
        const int r = nanoinfer::routed_experts_team(*L, int(path), x, T, out, work, choices, weights);
#pragma omp master
        rc = r;
    }
    return rc;
}
