// RMSNorm over the last dimension, one pass a row, for models served in GGUF blocks on the CPU (gpu_runtime/quant/
// norm.py). torch's rms_norm on a CPU is a composite of some ten operators (pow, mean, add, rsqrt, two muls and
// their allocations); at batch 1 their dispatch costs more than the arithmetic, on 2 of every ~45 operators a
// decoder layer runs. Built into the quantized-matmul kernel's library (gpu_runtime/quant/kernel.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1,
              "tokend rms_norm: float32 x and a float32 [size] weight");
  const int64_t size = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == size, "tokend rms_norm: x's last dimension must be ", size);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, xc.numel() / size, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* v = xp + row * size;
      float* o = op + row * size;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < size; ++i) squares += v[i] * v[i];
      const float inverse_rms = 1.f / std::sqrt(squares / static_cast<float>(size) + epsilon);
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) o[i] = wp[i] * (v[i] * inverse_rms);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokend_quant, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokend_quant, CPU, m) { m.impl("rms_norm", &rms_norm_rows); }
