// bf16 linear for CPUs with AVX512_BF16: y = x @ w.T (+ bias), bf16 in and out, float accumulation, every output
// added up in dot_order.h's order at any number of rows (batch invariance). A decode step multiplies a few token rows
// by every weight matrix, so its cost is reading the weights: up to 8 rows each weight row is read once and dotted
// with every row of x (x stays in L1), faster than torch's bf16 GEMM (docs/benchmarks.md); past 8, register tiles.
// Built on first use by pagekube/kernels/cpu_ops.py, which falls back to F.linear (also the tests' reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "dot_order.h"
#include "row_blocks.h"

namespace {

// One weight row against MB rows of x, in dot_order.h's order. MB is a compile-time size so the loops unroll and
// the accumulators stay in registers; one weight row at a time measured faster than several (more concurrent streams
// per thread read slower), as did a prefetch 8 KB ahead, into the rows that come next (a prefetch never faults, so
// running past the last row is harmless). Measurements in docs/benchmarks.md.
template <int MB>
void row(const uint16_t* x, const uint16_t* w, const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t N,
         int64_t n, int64_t m) {
  __m512 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint16_t* wr = w + n * K;
  const int64_t full = K / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + k + 4096), _MM_HINT_T0);
    for (int c = 0; c < 2; ++c) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * c);
      for (int i = 0; i < MB; ++i)
        acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)_mm512_loadu_si512(x + (m + i) * K + k + 32 * c), wv);
    }
  }
  for (int64_t k = full; k < K; k += 32) {  // the last columns, masked where fewer than 32 are left
    const __mmask32 mask = pagekube_dot::tail_mask(K - k);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
    for (int i = 0; i < MB; ++i)
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m + i) * K + k), wv);
  }
  const float b = bias ? static_cast<float>(bias[n]) : 0.f;
  for (int i = 0; i < MB; ++i)
    y[(m + i) * N + n] = pagekube_dot::to_bf16(pagekube_dot::sum16(_mm512_add_ps(acc[i][0], acc[i][1])) + b);
}

template <int MB>
void rows(const uint16_t* x, const uint16_t* w, const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1, int64_t m) {
  for (int64_t n = n0; n < n1; ++n) row<MB>(x, w, bias, y, K, N, n, m);
}

at::Tensor bf16_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1), "bf16_linear: shapes");
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const at::Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  const at::BFloat16* bp = bias.defined() ? bias.const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Threads split the weight rows (torch's pool, so torch.set_num_threads applies); x is read by all of them.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (M > pagekube_dot::kStreamRows) {
      pagekube_dot::tiled_linear(xp, M, K, N, n0, n1, [&](int64_t n, int64_t) { return wp + n * K; }, bp, yp);
      return;
    }
    pagekube_rows::for_row_blocks(M, [&](auto mb, int64_t m) {
      rows<decltype(mb)::value>(xp, wp, bp, yp, K, N, n0, n1, m);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(pagekube_cpu, m) { m.def("bf16_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
