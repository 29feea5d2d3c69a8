// A sampled row's token, found in one or two passes over its logits, and certified equal to
// the token of the reference definition (nanoinfer/sampling/sampler.py: RowSampler.draw, in
// float64 PyTorch ops), or left undecided (-1) for the caller to take the reference path.
//
// The reference's token is decided by comparisons: a token's probability against min_p times
// the largest, a logit against the k-th largest, the mass before a token against top_p, and the
// cumulative probability against the row's uniform draw. Every quantity compared here is the
// reference's within a bound: the exponentials differ by a few units in the last place, and
// any two orders of summing V non-negative terms differ by at most about V units of the total
// (float64). So where each comparison here clears the bound, the reference's comparison comes
// out the same and so does its token; where one does not (about one row in 10^5 on a real
// model), the row is undecided. So is a top_p row whose drawn token ties with a neighbour in
// probability: there the reference's order is torch.topk's. Nothing is rounded toward an answer: a row is either
// provably the reference's token or sent back.
//
// Rows are independent (threads take whole rows), so a row's token never depends on the batch.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && !defined(SAMPLING_PORTABLE)  // -DSAMPLING_PORTABLE: the tests' portable build
#define SAMPLING_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // the cumulative scan's block: its sums are kept by the exp pass

// e^z for z <= 0; below -708 it is 0 (the reference's value there is below 1e-307 of the largest
// term, far inside the bound).
inline double exp_scalar(double z) { return z < -708.0 ? 0.0 : std::exp(z); }

#ifdef SAMPLING_AVX2
// e^z for z <= 0 to about 5e-16 relative: z = k ln2 + r, |r| <= ln2/2, e^r by its Taylor series
// to r^12 (evaluated in Estrin's order, for fewer dependent steps), 2^k through the exponent
// bits. Intrinsics rather than plain arithmetic: the file is compiled with -ffast-math, which
// may rearrange arithmetic but not these instructions' rounding.
inline __m256d exp4(__m256d z) {
    const __m256d lo = _mm256_set1_pd(-708.0);
    const __m256d under = _mm256_cmp_pd(z, lo, _CMP_LT_OQ);
    z = _mm256_max_pd(z, lo);
    const __m256d k = _mm256_round_pd(_mm256_mul_pd(z, _mm256_set1_pd(1.4426950408889634)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(k, _mm256_set1_pd(0.693147180369123816490), z);  // ln2's high part: exact times k
    r = _mm256_fnmadd_pd(k, _mm256_set1_pd(1.90821492927058770002e-10), r);
    auto c = [](double v) { return _mm256_set1_pd(v); };
    const __m256d r2 = _mm256_mul_pd(r, r), r4 = _mm256_mul_pd(r2, r2), r8 = _mm256_mul_pd(r4, r4);
    const __m256d p01 = _mm256_fmadd_pd(r, c(1.0), c(1.0));
    const __m256d p23 = _mm256_fmadd_pd(r, c(1.0 / 6), c(0.5));
    const __m256d p45 = _mm256_fmadd_pd(r, c(1.0 / 120), c(1.0 / 24));
    const __m256d p67 = _mm256_fmadd_pd(r, c(1.0 / 5040), c(1.0 / 720));
    const __m256d p89 = _mm256_fmadd_pd(r, c(1.0 / 362880), c(1.0 / 40320));
    const __m256d pab = _mm256_fmadd_pd(r, c(1.0 / 39916800), c(1.0 / 3628800));
    const __m256d q0 = _mm256_fmadd_pd(p23, r2, p01), q1 = _mm256_fmadd_pd(p67, r2, p45);
    const __m256d q2 = _mm256_fmadd_pd(pab, r2, p89);
    const __m256d p = _mm256_fmadd_pd(_mm256_fmadd_pd(c(1.0 / 479001600), r4, q2), r8, _mm256_fmadd_pd(q1, r4, q0));
    const __m128i ki = _mm256_cvtpd_epi32(k);
    const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(ki), _mm256_set1_epi64x(1023)), 52);
    return _mm256_andnot_pd(under, _mm256_mul_pd(p, _mm256_castsi256_pd(bits)));
}

// Four logits as doubles, and four-lane comparisons, for float and double rows alike.
inline __m256d load4(const float* x) { return _mm256_cvtps_pd(_mm_loadu_ps(x)); }
inline __m256d load4(const double* x) { return _mm256_loadu_pd(x); }
#endif

struct Work {
    std::vector<double> e;       // the row's e^z
    std::vector<double> blocks;  // sums of e over blocks of kBlock
    std::vector<std::pair<double, int64_t>> heap;  // the largest logits: (logit, token)
    std::vector<std::pair<double, int64_t>> kept;  // candidates: (e, token)
};

struct Row {
    double temperature, min_p, top_p, u;
    int64_t top_k;
};

// What RowSampler.process does to a row before its draw: the logit bias (added in the logits'
// dtype), the penalties (float64) with the tokens sampled ahead of this row in the step
// counted in, the min_tokens bans. Pointers are 0 where a part does not apply.
struct Process {
    const float* counts;  // [V] the row's token counts, or null: no penalties
    const bool* prompt_mask;
    double repetition, frequency, presence;
    const int64_t* bias_ids;
    const float* bias_values;
    int64_t n_bias;
    const int64_t* bans;
    int64_t n_bans;
    const int64_t* ahead;
    int64_t n_ahead;

    bool any() const { return counts || n_bias || n_bans; }
};

// The row's largest logit; bad when a logit is NaN or +inf (the reference's special cases).
template <typename T>
double row_max(const T* x, int64_t V, bool& bad) {
    int64_t i = 0;
    double m = -INFINITY;
#ifdef SAMPLING_AVX2
    __m256d m0 = _mm256_set1_pd(-INFINITY), m1 = m0, b = _mm256_setzero_pd();
    const __m256d inf = _mm256_set1_pd(INFINITY);
    for (; i + 8 <= V; i += 8) {
        const __m256d a = load4(x + i), c = load4(x + i + 4);
        m0 = _mm256_max_pd(m0, a);
        m1 = _mm256_max_pd(m1, c);
        b = _mm256_or_pd(b, _mm256_or_pd(_mm256_cmp_pd(a, c, _CMP_UNORD_Q),
                                         _mm256_or_pd(_mm256_cmp_pd(a, inf, _CMP_EQ_OQ), _mm256_cmp_pd(c, inf, _CMP_EQ_OQ))));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_max_pd(m0, m1));
    m = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
    bad = _mm256_movemask_pd(b) != 0;
#else
    bad = false;
#endif
    for (; i < V; i++) {
        const double v = double(x[i]);
        bad |= std::isnan(v) || v == INFINITY;
        m = v > m ? v : m;
    }
    return m;
}

// The k largest logits (with their tokens) into w.heap, a min-heap on the logit: most logits
// are rejected by one comparison with the smallest kept.
template <typename T>
void largest(const T* x, int64_t V, int64_t k, Work& w) {
    auto& h = w.heap;
    h.clear();
    auto greater = [](const auto& a, const auto& b) { return a.first > b.first; };
    auto offer = [&](int64_t i) {
        const double v = double(x[i]);
        if (int64_t(h.size()) < k) {
            h.emplace_back(v, i);
            std::push_heap(h.begin(), h.end(), greater);
        } else if (v > h.front().first) {
            std::pop_heap(h.begin(), h.end(), greater);
            h.back() = {v, i};
            std::push_heap(h.begin(), h.end(), greater);
        }
    };
    int64_t i = 0;
    for (; i < V && int64_t(h.size()) < k; i++) offer(i);
#ifdef SAMPLING_AVX2
    for (; i + 4 <= V; i += 4) {
        if (!_mm256_movemask_pd(_mm256_cmp_pd(load4(x + i), _mm256_set1_pd(h.front().first), _CMP_GT_OQ))) continue;
        for (int64_t j = i; j < i + 4; j++) offer(j);
    }
#endif
    for (; i < V; i++) offer(i);
}

// The largest logit below kth (-inf if none).
template <typename T>
double largest_below(const T* x, int64_t V, double kth) {
    double below = -INFINITY;
    int64_t i = 0;
#ifdef SAMPLING_AVX2
    const __m256d k = _mm256_set1_pd(kth), none = _mm256_set1_pd(-INFINITY);
    __m256d b = none;
    for (; i + 4 <= V; i += 4) {
        const __m256d a = load4(x + i);
        b = _mm256_max_pd(b, _mm256_blendv_pd(none, a, _mm256_cmp_pd(a, k, _CMP_LT_OQ)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, b);
    below = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
#endif
    for (; i < V; i++) {
        const double v = double(x[i]);
        if (v < kth) below = v > below ? v : below;
    }
    return below;
}

// The sum of the e at or above floor, and those (e, token) themselves.
double mass_from(const double* e, int64_t V, double floor) {
    double s = 0.0;
    int64_t i = 0;
#ifdef SAMPLING_AVX2
    const __m256d f = _mm256_set1_pd(floor);
    __m256d acc = _mm256_setzero_pd();
    for (; i + 4 <= V; i += 4) {
        const __m256d a = _mm256_loadu_pd(e + i);
        acc = _mm256_add_pd(acc, _mm256_and_pd(a, _mm256_cmp_pd(a, f, _CMP_GE_OQ)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, acc);
    s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < V; i++) s += e[i] >= floor ? e[i] : 0.0;
    return s;
}

void collect_from(const double* e, int64_t V, double floor, std::vector<std::pair<double, int64_t>>& out) {
    int64_t i = 0;
#ifdef SAMPLING_AVX2
    const __m256d f = _mm256_set1_pd(floor);
    for (; i + 4 <= V; i += 4) {
        if (!_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(e + i), f, _CMP_GE_OQ))) continue;
        for (int64_t j = i; j < i + 4; j++)
            if (e[j] >= floor && e[j] > 0.0) out.emplace_back(e[j], j);
    }
#endif
    for (; i < V; i++)
        if (e[i] >= floor && e[i] > 0.0) out.emplace_back(e[i], i);
}

// e[i] = exp((x[i] - m) / T) for i in [0, V), blocks[b] = the sum over block b. Returns the sum.
template <typename T>
double exp_pass(const T* x, int64_t V, double m, double inv_t, double* e, double* blocks) {
    double total = 0.0;
    for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
        const int64_t b1 = std::min(V, b0 + kBlock);
        int64_t i = b0;
        double s = 0.0;
#ifdef SAMPLING_AVX2
        __m256d acc0 = _mm256_setzero_pd(), acc1 = acc0;
        const __m256d mv = _mm256_set1_pd(m), iv = _mm256_set1_pd(inv_t);
        for (; i + 8 <= b1; i += 8) {
            const __m256d v0 = exp4(_mm256_mul_pd(_mm256_sub_pd(load4(x + i), mv), iv));
            const __m256d v1 = exp4(_mm256_mul_pd(_mm256_sub_pd(load4(x + i + 4), mv), iv));
            _mm256_storeu_pd(e + i, v0);
            _mm256_storeu_pd(e + i + 4, v1);
            acc0 = _mm256_add_pd(acc0, v0);
            acc1 = _mm256_add_pd(acc1, v1);
        }
        alignas(32) double lanes[4];
        _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
        s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
        for (; i < b1; i++) {
            e[i] = exp_scalar((double(x[i]) - m) * inv_t);
            s += e[i];
        }
        blocks[b0 / kBlock] = s;
        total += s;
    }
    return total;
}

// The token at which the running sum of e (in index order) first exceeds u * total, or -1 when
// the reference's cumulative sum could fall on the other side of the threshold.
int64_t scan(const double* e, const double* blocks, int64_t V, double total, double u, double margin) {
    const double thr = u * total;
    double c = 0.0;
    int64_t b = 0;
    const int64_t nb = (V + kBlock - 1) / kBlock;
    while (b < nb && c + blocks[b] <= thr - margin) c += blocks[b++];
    for (int64_t i = b * kBlock; i < V; i++) {
        const double next = c + e[i];
        if (next > thr) {
            if (thr - c <= margin || next - thr <= margin) return -1;
            return i;
        }
        c = next;
    }
    return -1;  // the threshold at the total: the reference's "last token with any mass" case
}

// top_p over candidates (e, token), sorted here by e descending: the kept prefix (a token stays
// while the mass before it is below top_p) and the draw from it; -1 when undecided.
int64_t nucleus(std::vector<std::pair<double, int64_t>>& kept, double total, const Row& r, double margin) {
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    const double limit = r.top_p * total;
    const int64_t count = int64_t(kept.size());
    double c = 0.0;
    int64_t n = count;
    for (int64_t i = 0; i < count; i++) {
        // c: the mass before token i; the reference keeps i while that is below top_p
        if (i > 0 && c >= limit) {
            n = i;
            break;
        }
        c += kept[i].first;
    }
    // the reference's mass before the first dropped token (or before the first token of no mass,
    // past the candidates) and before the last kept one must clear top_p
    if (std::abs(c - limit) <= margin) return -1;
    double before_last = c - kept[n - 1].first;
    if (n > 1 && limit - before_last <= margin) return -1;
    const double kept_total = c;
    const double thr = r.u * kept_total;
    double run = 0.0;
    for (int64_t j = 0; j < n; j++) {
        const double next = run + kept[j].first;
        if (next > thr) {
            if (thr - run <= margin || next - thr <= margin) return -1;
            // The reference orders the kept tokens by torch.topk: tokens of equal probability in
            // its order, which can hold the picked place only if one of them ties (or, through
            // the exponentials' rounding, nearly ties) with the picked token. Elsewhere a tie
            // moves nothing: swapping equal values changes no cumulative sum.
            const double e = kept[j].first, tol = 1e-12 * e;
            if ((j > 0 && kept[j - 1].first - e <= tol) || (j + 1 < count && e - kept[j + 1].first <= tol)) return -1;
            return kept[j].second;
        }
        run = next;
    }
    return -1;
}

template <typename T>
int64_t draw_row(const T* x, int64_t V, const Row& r, Work& w) {
    bool bad = false;
    const double m = row_max(x, V, bad);
    if (bad || m == -INFINITY) return -1;  // NaN, +inf, or every token banned (the reference's error)
    const double inv_t = 1.0 / r.temperature;
    // The bound on the difference between any cumulative sum here and the reference's, in units of
    // the total (about 3.5e-10 at 49k tokens): 32 times the worst case of V rounding errors.
    const double delta = 32.0 * double(V + 64) * DBL_EPSILON;
    // min_p keeps probs >= min_p * max: the largest token's e is 1, so e >= min_p. Within 1e-10
    // of the floor, the reference's comparison could go either way.
    bool unsure = false;
    auto survives_min_p = [&](double e) {
        if (r.min_p <= 0.0) return true;
        unsure |= std::abs(e - r.min_p) <= 1e-10 * r.min_p;
        return e >= r.min_p;
    };
    auto& kept = w.kept;
    kept.clear();
    if (r.top_k > 0 && r.top_k < V) {
        // The reference keeps z >= z(kth): z = (x - m) / T rises with x, so the same tokens as
        // x >= kth, unless a smaller logit's z rounds to z(kth) (checked: a gap far wider).
        largest(x, V, r.top_k, w);
        const double kth = w.heap.front().first;
        if (kth == -INFINITY) return -1;
        const double below = largest_below(x, V, kth);
        if (below != -INFINITY && kth - below <= 1e-13 * (std::abs(kth - m) + std::abs(below - m))) return -1;
        // every logit at kth or above (the heap holds k of them; ties with kth may be more)
        int64_t i = 0;
        auto keep = [&](int64_t j) {
            const double v = double(x[j]);
            if (v < kth) return;
            const double e = exp_scalar((v - m) * inv_t);
            if (survives_min_p(e)) kept.emplace_back(e, j);
        };
#ifdef SAMPLING_AVX2
        for (const __m256d kv = _mm256_set1_pd(kth); i + 4 <= V; i += 4)
            if (_mm256_movemask_pd(_mm256_cmp_pd(load4(x + i), kv, _CMP_GE_OQ)))
                for (int64_t j = i; j < i + 4; j++) keep(j);
#endif
        for (; i < V; i++) keep(i);
        if (unsure) return -1;
        double total = 0.0;
        for (const auto& [e, i] : kept) total += e;
        const double margin = delta * total;
        if (r.top_p < 1.0) return nucleus(kept, total, r, margin);
        // the reference's cumulative sum runs in token order, as kept is
        const double thr = r.u * total;
        double c = 0.0;
        for (const auto& [e, i] : kept) {
            const double next = c + e;
            if (next > thr) return (thr - c <= margin || next - thr <= margin) ? -1 : i;
            c = next;
        }
        return -1;
    }
    w.e.resize(V);
    w.blocks.resize((V + kBlock - 1) / kBlock);
    double* e = w.e.data();
    double total = exp_pass(x, V, m, inv_t, e, w.blocks.data());
    if (r.min_p > 0.0) {
        total = 0.0;
        for (int64_t b = 0; b * kBlock < V; b++) {
            double s = 0.0;
            for (int64_t i = b * kBlock; i < std::min(V, (b + 1) * kBlock); i++) {
                if (!survives_min_p(e[i])) e[i] = 0.0;
                s += e[i];
            }
            w.blocks[b] = s;
            total += s;
        }
        if (unsure) return -1;
    }
    const double margin = delta * total;
    if (r.top_p >= 1.0) return scan(e, w.blocks.data(), V, total, r.u, margin);
    // The kept prefix is among the largest: the 64 largest logits if they hold more than top_p
    // of the mass with room to spare, else every e above a floor lowered 16-fold until they do.
    const double target = r.top_p * total + 4.0 * margin;
    largest(x, V, std::min<int64_t>(64, V), w);
    double mass = 0.0;
    for (const auto& [v, i] : w.heap) mass += e[i];
    if (mass > target) {
        for (const auto& [v, i] : w.heap) kept.emplace_back(e[i], i);
    } else {
        double floor = e[w.heap.front().second];
        while (floor > 1e-300) {
            floor /= 16.0;
            if (mass_from(e, V, floor) > target) break;
        }
        collect_from(e, V, floor, kept);
    }
    return nucleus(kept, total, r, margin);
}

// out = the processed row, in float64 (RowSampler.process).
template <typename T>
void process(const T* x, int64_t V, const Process& p, double* out) {
    auto biased = [&](int64_t i) {  // the logit after the bias, in the logits' dtype
        T v = x[i];
        for (int64_t j = 0; j < p.n_bias; j++)
            if (p.bias_ids[j] == i) v = T(v + T(p.bias_values[j]));
        return double(v);
    };
    auto penalised = [&](double v, bool in_prompt, float count) {
        if (p.repetition != 1.0 && (in_prompt || count > 0.f)) v = v > 0 ? v / p.repetition : v * p.repetition;
        return v - (double(float(p.frequency) * count) + p.presence * (count > 0.f ? 1.0 : 0.0));
    };
    for (int64_t i = 0; i < V; i++) out[i] = double(x[i]);
    for (int64_t j = 0; j < p.n_bias; j++) out[p.bias_ids[j]] = biased(p.bias_ids[j]);
    if (p.counts) {
        for (int64_t i = 0; i < V; i++) out[i] = penalised(out[i], p.prompt_mask[i], p.counts[i]);
        for (int64_t j = 0; j < p.n_ahead; j++) {  // a token sampled ahead: its count plus its times ahead
            const int64_t t = p.ahead[j];
            float count = p.counts[t];
            for (int64_t l = 0; l < p.n_ahead; l++) count += p.ahead[l] == t ? 1.f : 0.f;
            out[t] = penalised(biased(t), p.prompt_mask[t], count);
        }
    }
    for (int64_t j = 0; j < p.n_bans; j++) out[p.bans[j]] = -INFINITY;
}

}  // namespace

// tokens[r] for R rows, each described by kInts int64 and kDoubles float64 arguments (in the
// order below; nanoinfer/kernels/sampling.py writes them): its logits (float32, or float64),
// its processing, its temperature (> 0), top_k (0: off), min_p (0: off), top_p (1: off) and
// uniform draw u in [0, 1). tokens[r] = -1 where the row must take the reference path.
constexpr int64_t kInts = 12, kDoubles = 7;
extern "C" void sample_draw(const int64_t* ints, const double* doubles, int64_t R, int64_t V, int64_t* tokens,
                            int64_t threads) {
#pragma omp parallel num_threads(threads > 0 ? int(threads) : 1) if (R > 1)
    {
        Work w;
        std::vector<double> processed;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            const int64_t* a = ints + r * kInts;
            const double* d = doubles + r * kDoubles;
            const Row row{d[0], d[1], d[2], d[3], a[2]};
            const Process p{reinterpret_cast<const float*>(a[3]), reinterpret_cast<const bool*>(a[4]), d[4], d[5], d[6],
                            reinterpret_cast<const int64_t*>(a[5]), reinterpret_cast<const float*>(a[6]), a[7],
                            reinterpret_cast<const int64_t*>(a[8]), a[9], reinterpret_cast<const int64_t*>(a[10]), a[11]};
            const bool f64 = a[1] != 0;
            if (p.any()) {
                processed.resize(V);
                if (f64)
                    process(reinterpret_cast<const double*>(a[0]), V, p, processed.data());
                else
                    process(reinterpret_cast<const float*>(a[0]), V, p, processed.data());
                tokens[r] = draw_row(processed.data(), V, row, w);
            } else {
                tokens[r] = f64 ? draw_row(reinterpret_cast<const double*>(a[0]), V, row, w)
                                : draw_row(reinterpret_cast<const float*>(a[0]), V, row, w);
            }
        }
    }
}

// For G rows of log-probabilities (float32, as torch.log_softmax gives them): ranks[g] = 1 + the
// number above chosen[g], and top[g] = the n largest's tokens, largest first, as torch.topk
// orders them. tied[g] = 1 where that order is not certain (two of the n + 1 largest equal, or
// a NaN): torch.topk's order among equal values is its own, so the caller asks it.
extern "C" void top_logprobs(const float* lp, int64_t G, int64_t V, const float* chosen, int64_t n, int64_t* ranks,
                             int64_t* top, int32_t* tied, int64_t threads) {
#pragma omp parallel num_threads(threads > 0 ? int(threads) : 1) if (G > 1)
    {
        Work w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            const float* x = lp + g * V;
            const float c = chosen[g];
            int64_t above = 0, i = 0;
            bool bad = false;
#ifdef SAMPLING_AVX2
            const __m256 cv = _mm256_set1_ps(c);
            for (; i + 8 <= V; i += 8) {
                const __m256 a = _mm256_loadu_ps(x + i);
                above += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(a, cv, _CMP_GT_OQ)));
                bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0;
            }
#endif
            for (; i < V; i++) {
                above += x[i] > c;
                bad |= std::isnan(x[i]);
            }
            ranks[g] = above + 1;
            tied[g] = bad || std::isnan(c);
            if (n <= 0 || tied[g]) continue;
            const int64_t k = std::min(n + 1, V);
            largest(x, V, k, w);
            std::sort(w.heap.begin(), w.heap.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
            for (int64_t j = 0; j + 1 < k; j++) tied[g] |= w.heap[j].first == w.heap[j + 1].first;
            for (int64_t j = 0; j < std::min(n, V); j++) top[g * n + j] = w.heap[j].second;
        }
    }
}
