// The decoder layers of a Llama-family model (Llama, Mistral, Qwen2/3, SmolLM, Phi-3, Gemma 2/3,
// OLMo 2, and the mixtures of experts: Qwen2/3-MoE without a shared expert, Mixtral) as one call:
// for every layer, RMSNorm (with the residual add), the q/k/v projection, q/k norms where the
// model has them (per head, or over all heads), rotary, k and v written to their cache slots,
// paged attention, the output projection, RMSNorm, gate/up, the gated activation, down (or the
// routed experts: routed_experts.cpp); sandwich norms (Gemma) and post-norm layers (OLMo 2) move
// the norms. Weights in their GGUF blocks (quant_gemm.cpp), or fp32 in the packed GEMM's panels
// (packed_gemm.cpp: an fp32 model's, an F32 file's).
//
// Why: at batch-1 decode a layer is a dozen small operations, and calling each from Python
// (module call, tensor allocation, ctypes, an OpenMP team started per op) cost more than the
// arithmetic: 30 layers of SmolLM2-135M took ~18 ms a token, ~10 of them in the kernels.
// Here the whole stack runs in one OpenMP parallel region, the threads meeting at a barrier
// between steps, and every buffer is reused from step to step.
//
// Each step is the same function the Python path calls (team.h: one body for both callers),
// on the same values in the same order, so a row's output is bit for bit what the layer
// modules compute (tests/test_decoder_stack.py holds them to it), and batch invariance
// carries over: rows are split among threads only where each row's result is its own.
//
// Layouts: x, residual [T, hidden] fp32; cos, sin [T, D / 2]; the caches one layer each,
// [blocks, block_size, Hkv, D] fp32 or bf16 (or q8_0 blocks, common.h's Q8); slots [T], rows [T], tables [T, width], ctx [T]
// as the CPU attention backend's metadata (every row a one-row query over the cache); slots
// and tables one set per KV group (attention/kv_cache.py: each group's pool has its own block
// ids), a layer reading its group's.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "side_prefetch.h"
#include "team.h"

namespace {

constexpr int kMaxParts = 3;
constexpr int kMaxKVGroups = 4;  // _MAX_KV_GROUPS in kernels/decoder_stack.py
// StackPart.qtype of an fp32 weight in the packed GEMM's panels (packed_gemm.cpp), as the
// fp32 model's PackedLinear holds it: not a GGML type, so below every GGML id.
constexpr int64_t kPackedF32 = -1;

struct StackPart {
    int64_t qtype;     // GGML's type id, or kPackedF32
    const uint8_t* w;
    int64_t n;         // output columns (rows of W)
    int64_t repacked;  // w in the type's repacked layout (quant/packed.h)
};

struct StackLinear {
    int64_t nparts;
    StackPart part[kMaxParts];  // outputs side by side, as the fused projection's
    const float* bias;          // [sum of n] or null
};

struct StackLayer {
    const float *in_norm, *post_norm, *q_norm, *k_norm;  // q_norm, k_norm: [D] or null
    StackLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t kv_group;  // which of the step's slot and table sets its cache's block ids are
    int64_t window;  // 0: none
    float scale, softcap;
    int64_t rope;  // 0: no rotary in this layer (SmolLM3's NoPE layers); 2: the local tables (Gemma's windowed layers)
    // Sandwich norms (Gemma): the attention's and the MLP's outputs normed before they join the
    // stream (null: pre-norm layers). post_norm is then the norm before the MLP.
    const float *attn_out_norm, *mlp_out_norm;
    int64_t act;  // 0: silu(gate) * up; 1: gelu_tanh(gate) * up
    // Post-norm layers (OLMo 2): no norm before attention or the MLP; each branch's output is
    // normed (attn_out_norm, mlp_out_norm) and added to the stream, which is the branches' input.
    int64_t post_norm_layout;
    int64_t qk_norm_whole;  // q and k each normed over all their heads at once (OLMo 2), not per head
    // A mixture-of-experts layer: the routed experts in place of gate_up and down (which are empty).
    const nanoinfer::RoutedExperts* moe;
};

struct StackModel {
    int64_t num_layers, hidden, H, Hkv, D, inter, block_size, kv_format;  // kv_format: team.h's KVFormat
    const StackLayer* layers;
    float eps;
    int64_t rotary_dims;  // rotary on each head's first rotary_dims values (D: all), the rest as they are
};

struct StackStep {
    int64_t T, path;  // path: quant_gemm's PATH_* (0: the best)
    float* x;         // in: the embeddings; out: the last layer's output
    float* residual;  // out: the residual stream it adds to
    const float *cos, *sin;
    const int64_t* slots[kMaxKVGroups];
    const int64_t* tables[kMaxKVGroups];
    const int64_t *rows, *ctx;
    int64_t width, max_ctx;
    const float *cos_local, *sin_local;  // the windowed layers' own rotary tables (rope == 2), or null
};

int64_t width_of(const StackLinear& l) {
    int64_t n = 0;
    for (int64_t p = 0; p < l.nparts; p++) n += l.part[p].n;
    return n;
}

// y [T, width] = x [T, K] W^T, part by part; x quantised once per activation format.
int linear(const StackLinear& l, const float* x, int64_t T, int64_t K, float* y, int64_t path, void* acts) {
    const int64_t ldy = width_of(l);
    int64_t off = 0;
    for (int64_t p = 0; p < l.nparts; p++) {
        const StackPart& part = l.part[p];
        const float* bias = l.bias ? l.bias + off : nullptr;
        if (part.qtype == kPackedF32) {
            nanoinfer::linear_packed_f32_team(x, reinterpret_cast<const float*>(part.w), bias, y + off, ldy, T, K,
                                              part.n);
        } else {
            const int64_t prev = p == 0 ? kPackedF32 : l.part[p - 1].qtype;
            const bool quantise = prev == kPackedF32 || !nanoinfer::same_acts(int(prev), int(part.qtype));
            const int rc = nanoinfer::quant_linear_team(int(part.qtype), int(path), x, T, K, part.w, part.n,
                                                        part.repacked != 0, bias, y + off, ldy, acts, quantise);
            if (rc) return rc;
        }
        off += part.n;
    }
    return 0;
}

int64_t acts_bytes(const StackLinear& l, int64_t T, int64_t K) {
    int64_t most = 0;
    for (int64_t p = 0; p < l.nparts; p++)
        if (l.part[p].qtype != kPackedF32)
            most = std::max(most, nanoinfer::quant_acts_bytes(int(l.part[p].qtype), T, K));
    return most;
}

// A token's k or v (Hkv heads of D values) into its cache slot, in the cache's format.
void store_row(void* cache, int64_t format, int64_t slot, const float* src, int64_t Hkv, int64_t D, int64_t rot) {
    const int64_t n = Hkv * D;
    if (format == nanoinfer::KV_Q8_0) {
        Q8* dst = static_cast<Q8*>(cache) + slot * Hkv * head_stride<Q8>(D);
        for (int64_t h = 0; h < Hkv; h++) q8_store_head(src + h * D, D, dst + h * head_stride<Q8>(D), rot);
    } else if (format == nanoinfer::KV_BF16) {
        BF16* dst = static_cast<BF16*>(cache) + slot * n;
        for (int64_t i = 0; i < n; i++) store(dst, i, src[i]);
    } else {
        std::memcpy(static_cast<float*>(cache) + slot * n, src, sizeof(float) * n);
    }
}

// One buffer per calling thread, grown as needed and reused.
float* scratch(std::vector<float>& buf, int64_t n) {
    if (int64_t(buf.size()) < n) buf.resize(size_t(n));
    return buf.data();
}

}  // namespace

// Returns 0, or a quant_linear error code (< 0), or 1: a layer's shapes are inconsistent.
extern "C" int decoder_stack(const StackModel* m, const StackStep* s) {
    const int64_t T = s->T, E = m->hidden, H = m->H, Hkv = m->Hkv, D = m->D, I = m->inter;
    const int64_t QKV = (H + 2 * Hkv) * D;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const StackLayer& L = m->layers[l];
        if (width_of(L.qkv) != QKV || width_of(L.o) != E) return 1;
        if (L.kv_group < 0 || L.kv_group >= kMaxKVGroups || !s->slots[L.kv_group] || !s->tables[L.kv_group]) return 1;
        if (L.moe ? L.moe->hidden != E || L.gate_up.nparts || L.down.nparts
                  : width_of(L.gate_up) != 2 * I || width_of(L.down) != E)
            return 1;
    }
    if (T <= 0) return 0;

    // Shared buffers: h (a norm's output), qkv, q (rotated), att (attention's output),
    // proj (the o projection's output), gu (gate and up), act (silu * up); then the
    // quantised activations and the attention's work units.
    int64_t acts = 0, moe_work = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const StackLayer& L = m->layers[l];
        acts = std::max({acts, acts_bytes(L.qkv, T, E), acts_bytes(L.o, T, H * D), acts_bytes(L.gate_up, T, E),
                         acts_bytes(L.down, T, I)});
        if (L.moe) moe_work = std::max(moe_work, nanoinfer::routed_experts_bytes(*L.moe, T));
    }
    std::vector<int64_t> offset_buf(size_t(T + 1));
    int64_t* offset = offset_buf.data();
    const int64_t most_units = nanoinfer::attention_plan(s->ctx, T, 0, offset);  // no window: the most units
    const bool dense = std::any_of(m->layers, m->layers + m->num_layers, [](const StackLayer& L) { return !L.moe; });
    const int64_t DI = dense ? I : 0;  // (a model of routed layers only needs no dense MLP buffers)
    const int64_t sizes[] = {T * E, T * QKV, T * H * D, T * H * D, T * E, T * 2 * DI, T * DI, (acts + 3) / 4,
                             most_units * H * (D + 2), (moe_work + 3) / 4};
    int64_t total = 0;
    for (int64_t n : sizes) total += (n + 15) / 16 * 16;  // each 64-byte aligned within the buffer
    static thread_local std::vector<float> shared;
    float* base = scratch(shared, total + 16);
    base += (16 - (reinterpret_cast<uintptr_t>(base) / 4) % 16) % 16;
    float* parts[10];
    for (int i = 0; i < 10; i++) {
        parts[i] = base;
        base += (sizes[i] + 15) / 16 * 16;
    }
    float *h = parts[0], *qkv = parts[1], *q = parts[2], *att = parts[3], *proj = parts[4], *gu = parts[5],
          *act = parts[6], *units = parts[8];
    void* qacts = parts[7];
    void* moe_ws = parts[9];
    const int64_t kv_format = m->kv_format;
    const bool q8 = kv_format == nanoinfer::KV_Q8_0;
    const int64_t rot_k = q8 ? k_rotation(D) : 0, rot_v = q8 ? v_rotation(D) : 0;
    int rc = 0;
    int64_t planned = -1;  // the layer whose attention plan `offset` holds (planned ahead for the side prefetch)

#pragma omp parallel
    {
        static thread_local std::vector<float> own;  // this thread's attention scores, then one row's q and k
        float* sc = scratch(own, H * (s->max_ctx + D) + 2 * (H + Hkv) * D);
        float* qk = sc + H * (s->max_ctx + D);  // a row's q and k heads, rotated
        float* normed = qk + (H + Hkv) * D;     // and before, normed (q/k norms)
        for (int64_t l = 0; l < m->num_layers; l++) {
            const StackLayer& L = m->layers[l];
            // input norm; the first layer's stream is x itself, later ones add x to it
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                float *xr = s->x + t * E, *res = s->residual + t * E;
                if (l == 0) std::memcpy(res, xr, sizeof(float) * E);
                if (!L.post_norm_layout)
                    nanoinfer::rms_norm_row_f32(res, l == 0 ? nullptr : xr, L.in_norm, h + t * E, E, m->eps);
                else if (l > 0)
                    for (int64_t i = 0; i < E; i++) res[i] += xr[i];
            }
            float* branch_in = L.post_norm_layout ? s->residual : h;  // what attention and the MLP read
            int r = linear(L.qkv, branch_in, T, E, qkv, s->path, qacts);
            // q and k normed (where the model does) and rotated; k and v stored in their slots
            if (!r) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) {
                    float* row = qkv + t * QKV;
                    const int64_t RD = m->rotary_dims;
                    const bool local = L.rope == 2;
                    const float *c = (local ? s->cos_local : s->cos) + t * (RD / 2);
                    const float *sn = (local ? s->sin_local : s->sin) + t * (RD / 2);
                    const float* src = row;
                    if (L.q_norm && L.qk_norm_whole) {
                        nanoinfer::rms_norm_row_f32(row, nullptr, L.q_norm, normed, H * D, m->eps);
                        nanoinfer::rms_norm_row_f32(row + H * D, nullptr, L.k_norm, normed + H * D, Hkv * D, m->eps);
                        src = normed;
                    } else if (L.q_norm) {
                        for (int64_t hd = 0; hd < H + Hkv; hd++)
                            nanoinfer::rms_norm_row_f32(row + hd * D, nullptr, hd < H ? L.q_norm : L.k_norm,
                                                        normed + hd * D, D, m->eps);
                        src = normed;
                    }
                    if (!L.rope) {
                        std::memcpy(qk, src, sizeof(float) * (H + Hkv) * D);
                    } else if (RD == D) {
                        nanoinfer::rope_row_f32(src, c, sn, qk, H + Hkv, D);
                    } else {  // partial rotary: each head's first RD values turn, the rest pass
                        for (int64_t hd = 0; hd < H + Hkv; hd++) {
                            nanoinfer::rope_row_f32(src + hd * D, c, sn, qk + hd * D, 1, RD);
                            std::memcpy(qk + hd * D + RD, src + hd * D + RD, sizeof(float) * (D - RD));
                        }
                    }
                    if (rot_k)  // a q8_0 cache holds rotated keys: the queries turn alike (common.h)
                        for (int64_t hd = 0; hd < H; hd++) hadamard_blocks(qk + hd * D, D, rot_k);
                    std::memcpy(q + t * H * D, qk, sizeof(float) * H * D);
                    store_row(L.k_cache, kv_format, s->slots[L.kv_group][t], qk + H * D, Hkv, D, rot_k);
                    store_row(L.v_cache, kv_format, s->slots[L.kv_group][t], row + (H + Hkv) * D, Hkv, D, rot_v);
                }
#pragma omp single
                if (planned != l) nanoinfer::attention_plan(s->ctx, T, L.window, offset);
                nanoinfer::attention_team_f32(q, s->rows, L.k_cache, L.v_cache, int(kv_format), s->tables[L.kv_group], s->width, s->ctx, att,
                                              T, H, Hkv, D, m->block_size, L.window, s->max_ctx, L.scale, L.softcap,
                                              offset, units, sc);
                if (rot_v) {  // the sum of rotated values, turned back
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t hd = 0; hd < H; hd++) hadamard_blocks(att + (t * H + hd) * D, D, rot_v);
                }
                // The next layer's keys and values, fetched while this layer's GEMMs stream their
                // weights (decode-sized steps; side_prefetch.h).
                if (l + 1 < m->num_layers && T <= nanoinfer::kStreamRows) {
                    const StackLayer& next = m->layers[l + 1];
#pragma omp single
                    {
                        nanoinfer::attention_plan(s->ctx, T, next.window, offset);
                        planned = l + 1;
                    }
                    nanoinfer::attention_side_prefetch(next.k_cache, next.v_cache, int(kv_format),
                                                       s->tables[next.kv_group], s->width, s->ctx, T, Hkv, D,
                                                       m->block_size, next.window, offset);
                } else {
                    nanoinfer::side_prefetch().clear();
                }
                r = linear(L.o, att, T, H * D, proj, s->path, qacts);
            }
            if (!r) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) {
                    float* p = proj + t * E;
                    if (L.attn_out_norm) nanoinfer::rms_norm_row_f32(p, nullptr, L.attn_out_norm, p, E, m->eps);
                    float* res = s->residual + t * E;
                    if (L.post_norm_layout)
                        for (int64_t i = 0; i < E; i++) res[i] += p[i];
                    else
                        nanoinfer::rms_norm_row_f32(res, p, L.post_norm, h + t * E, E, m->eps);
                }
                r = L.moe ? nanoinfer::routed_experts_team(*L.moe, int(s->path), branch_in, T, s->x, moe_ws, nullptr, nullptr)
                          : linear(L.gate_up, branch_in, T, E, gu, s->path, qacts);
            }
            if (!r && !L.moe) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) {
                    if (L.act == 1)
                        nanoinfer::gelu_tanh_mul_row_f32(gu + t * 2 * I, act + t * I, I);
                    else
                        nanoinfer::silu_mul_row_f32(gu + t * 2 * I, act + t * I, I);
                }
                r = linear(L.down, act, T, I, s->x, s->path, qacts);
            }
            if (!r && L.mlp_out_norm) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++)
                    nanoinfer::rms_norm_row_f32(s->x + t * E, nullptr, L.mlp_out_norm, s->x + t * E, E, m->eps);
            }
            if (r) {  // the same for every thread: the codes depend on the arguments alone
#pragma omp master
                rc = r;
                break;
            }
        }
        nanoinfer::side_prefetch().clear();  // nothing left pointing into this step's cache
    }
    return rc;
}
