// A Mixture-of-Experts layer's expert products on the CPU: rows grouped by expert, each group times its expert's
// matrix, every expert's matrix streamed from memory once for all of its rows.
//
// x is [assignments, k], sorted by expert (counts[e] rows for expert e, in order); w is [experts, n, k] (each
// expert's matrix as nn.Linear stores it); y[r, :] = x[r, :] w[e]^T for the expert e of row r. A decode step gives
// each expert a few rows, where a GEMM library packs the whole matrix for every call: here each output column's
// weights are read once and multiplied with every row of the group while they sit in L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <vector>

namespace {

constexpr int64_t kColumns = 4;  // output columns computed together: each row of x is loaded once for four

// y[r * ldy + col] = dot(x[r * k ...], w_row) for r < rows.
inline void rows_dot(const float* x, int64_t rows, int64_t k, const float* w_row, float* y, int64_t ldy,
                     int64_t col) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < k; ++i) acc += xr[i] * w_row[i];
    y[r * ldy + col] = acc;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four columns at once (w_rows: four consecutive rows of the expert's matrix), k a multiple of 8.
inline void rows_dot4(const float* x, int64_t rows, int64_t k, const float* w_rows, float* y, int64_t ldy,
                      int64_t col) {
  const float* w0 = w_rows;
  const float* w1 = w_rows + k;
  const float* w2 = w_rows + 2 * k;
  const float* w3 = w_rows + 3 * k;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      const __m256 xv = _mm256_loadu_ps(xr + i);
      a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + i), a0);
      a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + i), a1);
      a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2 + i), a2);
      a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3 + i), a3);
    }
    float* yr = y + r * ldy + col;
    yr[0] = hsum(a0);
    yr[1] = hsum(a1);
    yr[2] = hsum(a2);
    yr[3] = hsum(a3);
  }
}
#endif

torch::Tensor grouped_matmul(const torch::Tensor& x, const torch::Tensor& counts, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), "grouped_matmul: x [a, k], w [e, n, k]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "grouped_matmul: float32");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == w.size(0), "grouped_matmul: one count per expert");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto cc = counts.to(torch::kLong).contiguous();
  const int64_t k = x.size(1), n = w.size(1), experts = w.size(0);
  auto y = torch::empty({x.size(0), n}, x.options());
  // The experts that have rows: their first row and row count.
  std::vector<int64_t> which, first, rows;
  const int64_t* count = cc.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e] > 0) {
      which.push_back(e);
      first.push_back(start);
      rows.push_back(count[e]);
    }
    start += count[e];
  }
  TORCH_CHECK(start == x.size(0), "grouped_matmul: the counts must add up to x's rows");
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  const bool blocked = k % 8 == 0 && n % kColumns == 0;
#else
  const bool blocked = false;
#endif
  const int64_t step = blocked ? kColumns : 1;
  const int64_t per_expert = n / step;
  const int64_t work = static_cast<int64_t>(which.size()) * per_expert;  // an item: an expert's column(s)
  at::parallel_for(0, work, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / per_expert, col = (item % per_expert) * step;
      const float* w_row = wp + (which[g] * n + col) * k;
      const float* xg = xp + first[g] * k;
      float* yg = yp + first[g] * n;
#if defined(__AVX2__) && defined(__FMA__)
      if (blocked) {
        rows_dot4(xg, rows[g], k, w_row, yg, n, col);
        continue;
      }
#endif
      rows_dot(xg, rows[g], k, w_row, yg, n, col);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(tokend_moe, m) { m.def("grouped_matmul(Tensor x, Tensor counts, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokend_moe, CPU, m) { m.impl("grouped_matmul", &grouped_matmul); }
