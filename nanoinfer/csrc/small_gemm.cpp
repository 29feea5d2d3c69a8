// y = x w^T (+ bias) in fp32 for the batch sizes of decode (a few to a few dozen rows), for
// the CPU. MKL's sgemm repacks the weight on every call, which at these sizes costs more
// than the arithmetic; this streams each weight row once from memory and reuses it from L1
// for all rows of x. Used by nanoinfer/cpu_linear.py for 4..32 rows; MKL does the rest.
//
// Layouts (contiguous, row-major): x [M, K], w [N, K] (nn.Linear's), bias [N] or null, y [M, N].
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));  // the compiler maps it to what the CPU has

inline v16 load16(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline float sum16(v16 v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
#endif
}

// A tile of MT rows of x by NT rows of w: MT * NT accumulators stay in registers while k
// runs over the row in steps of 16; the remainder of K is summed one by one.
template <int MT, int NT>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0) {
    v16 acc[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) acc[i][j] = v16{};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        v16 wv[NT], xv[MT];
        for (int j = 0; j < NT; j++) wv[j] = load16(w + (n0 + j) * K + k);
        for (int i = 0; i < MT; i++) xv[i] = load16(x + (m0 + i) * K + k);
        for (int i = 0; i < MT; i++)
            for (int j = 0; j < NT; j++) acc[i][j] += xv[i] * wv[j];
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) {
            float s = sum16(acc[i][j]);
            for (int64_t kk = k; kk < K; kk++) s += x[(m0 + i) * K + kk] * w[(n0 + j) * K + kk];
            y[(m0 + i) * N + n0 + j] = s + (bias ? bias[n0 + j] : 0.f);
        }
}

// All rows of x against NT rows of w (which stay in L1 while x's rows go by).
template <int NT>
inline void rows_of_w(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                      int64_t n0) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile<4, NT>(x, w, bias, y, K, N, m, n0);
    for (; m < M; m++) tile<1, NT>(x, w, bias, y, K, N, m, n0);
}

}  // namespace

extern "C" void linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                           int64_t N) {
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * 4;
        if (n0 + 4 <= N)
            rows_of_w<4>(x, w, bias, y, M, K, N, n0);
        else
            for (int64_t n = n0; n < N; n++) rows_of_w<1>(x, w, bias, y, M, K, N, n);
    }
}
