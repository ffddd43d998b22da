// Linears over weights kept in a GGUF's blocks (gguf_blocks.h: Q4_1 for the bundled model's projections, Q8_0 for its
// tied lm_head), for CPUs with AVX512_BF16: y = x @ w.T (+ bias), x and y bf16, float accumulation. A decode step at
// a few sequences is bound by reading the weights: Q4_1 is 0.625 bytes per weight and Q8_0 1.0625, against bf16's 2.
// The weights are the bf16 copy's, fed straight into dpbf16 up to 8 rows of x; past 8, 16 weight rows at a time are
// dequantized into a per-thread buffer and multiplied as bf16 weights in register tiles. Every output is added up in
// dot_order.h's order, the bf16 kernel's, so a row's result depends neither on its batch nor on which kernel (blocks
// or bf16 copy) computed it. K is a multiple of 64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

#include "dot_order.h"
#include "gguf_blocks.h"
#include "row_blocks.h"

namespace {

using pagekube_blocks::kMaxBlocks;

// NR weight rows [n, n + NR) against MB rows of x. At one or two rows of x a step is bound by building each pair's
// weights (a table and two permutes per 64), so several weight rows go at once: their chains are independent, where
// one row's accumulators are a chain of dependent dpbf16s. Each output is still summed alone, in dot_order.h's order.
template <int MB, int NR, typename Format>
void block_rows(const Format& f, const uint16_t* x, const at::BFloat16* bias, at::BFloat16* y, int64_t N, int64_t n,
                int64_t m0) {
  const int64_t K = f.K;
  float s[NR][2 * kMaxBlocks];
  for (int j = 0; j < NR; ++j) f.scales(n + j, s[j]);
  // Two accumulators per output (even and odd blocks).
  __m512 acc[MB][NR][2];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 64; ++p) {
    __m512bh lo[NR], hi[NR];
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(f.bytes(n + j, p)) + 4096, _MM_HINT_T0);
      f.pair(n + j, p, s[j], lo[j], hi[j]);
    }
    for (int i = 0; i < MB; ++i) {
      const uint16_t* xr = x + (m0 + i) * K + 64 * p;
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xr), x1 = (__m512bh)_mm512_loadu_si512(xr + 32);
      for (int j = 0; j < NR; ++j) {
        acc[i][j][0] = _mm512_dpbf16_ps(acc[i][j][0], x0, lo[j]);
        acc[i][j][1] = _mm512_dpbf16_ps(acc[i][j][1], x1, hi[j]);
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const float bn = bias ? static_cast<float>(bias[n + j]) : 0.f;
    for (int i = 0; i < MB; ++i)
      y[(m0 + i) * N + n + j] = pagekube_dot::to_bf16(pagekube_dot::sum16(_mm512_add_ps(acc[i][j][0], acc[i][j][1])) + bn);
  }
}

// Weight rows [n0, n1) against MB rows of x: four at a time where MB is small enough to keep their accumulators and
// weights in registers.
template <int MB, typename Format>
void stream_rows(const Format& f, const uint16_t* x, const at::BFloat16* bias, at::BFloat16* y, int64_t N, int64_t n0,
                 int64_t n1, int64_t m) {
  constexpr int NR = MB <= 2 ? 4 : 1;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) block_rows<MB, NR>(f, x, bias, y, N, n, m);
  for (; n < n1; ++n) block_rows<MB, 1>(f, x, bias, y, N, n, m);
}

// Weight rows [n, n + count) dequantized to bf16 into `out` (count rows of K).
template <typename Format>
void dequantize_rows(const Format& f, int64_t n, int64_t count, uint16_t* out) {
  const int64_t K = f.K;
  float s[2 * kMaxBlocks];
  for (int64_t r = 0; r < count; ++r) {
    f.scales(n + r, s);
    for (int64_t p = 0; p < K / 64; ++p) {
      __m512bh lo, hi;
      f.pair(n + r, p, s, lo, hi);
      _mm512_storeu_si512(out + r * K + 64 * p, (__m512i)lo);
      _mm512_storeu_si512(out + r * K + 64 * p + 32, (__m512i)hi);
    }
  }
}

template <typename Format>
void block_linear(const Format& f, const uint16_t* x, const at::BFloat16* bias, at::BFloat16* y, int64_t M, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (M > pagekube_dot::kStreamRows) {
      thread_local std::vector<uint16_t> buffer;
      buffer.resize(pagekube_dot::kGroup * f.K);
      pagekube_dot::tiled_linear(x, M, f.K, N, n0, n1, [&](int64_t n, int64_t count) {
        dequantize_rows(f, n, count, buffer.data());
        return static_cast<const uint16_t*>(buffer.data());
      }, bias, y);
      return;
    }
    pagekube_rows::for_row_blocks(M, [&](auto mb, int64_t m) {
      stream_rows<decltype(mb)::value>(f, x, bias, y, N, n0, n1, m);
    });
  });
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); }

// x, bias and the result, checked; `run` computes y from them.
template <typename Run>
at::Tensor linear(const char* name, const at::Tensor& input, int64_t N, const c10::optional<at::Tensor>& bias_opt,
                  Run&& run) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2, name, ": x must be 2-D bf16");
  const int64_t K = input.size(1);
  TORCH_CHECK(K % 64 == 0 && K / 32 <= kMaxBlocks, name, ": K must be a multiple of 64, at most 32768");
  const at::Tensor x = input.contiguous();
  const at::Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : at::Tensor();
  at::Tensor y = at::empty({input.size(0), N}, x.options());
  run(bits(x), bias.defined() ? bias.const_data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(),
      input.size(0), K);
  return y;
}

void check_scales(const char* name, const at::Tensor& s, int64_t N, int64_t K) {
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 2 && s.size(0) == N && s.size(1) == K / 32, name,
              ": scales must be [N, K/32] float16");
}

at::Tensor q4_1_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& dq, const at::Tensor& mq,
                       const c10::optional<at::Tensor>& bias, bool amx) {
  const at::Tensor qs = q.contiguous(), d = dq.contiguous(), m = mq.contiguous();
  const int64_t N = qs.size(0);
  return linear("q4_1_linear", input, N, bias, [&](const uint16_t* x, const at::BFloat16* b, at::BFloat16* y,
                                                   int64_t M, int64_t K) {
    TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2,
                "q4_1_linear: qs must be [N, K/2] uint8");
    check_scales("q4_1_linear", d, N, K);
    check_scales("q4_1_linear", m, N, K);
    const pagekube_blocks::Q4_1 f{qs.const_data_ptr<uint8_t>(), bits(d), bits(m), K};
    if (amx) return pagekube_q4::q4_1_amx_linear(x, f, b, y, M, N);
    block_linear(f, x, b, y, M, N);
  });
}

at::Tensor q8_0_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& dq,
                       const c10::optional<at::Tensor>& bias, bool amx) {
  const at::Tensor qs = q.contiguous(), d = dq.contiguous();
  const int64_t N = qs.size(0);
  return linear("q8_0_linear", input, N, bias, [&](const uint16_t* x, const at::BFloat16* b, at::BFloat16* y,
                                                   int64_t M, int64_t K) {
    TORCH_CHECK(qs.scalar_type() == at::kChar && qs.dim() == 2 && qs.size(1) == K,
                "q8_0_linear: qs must be [N, K] int8");
    check_scales("q8_0_linear", d, N, K);
    const pagekube_blocks::Q8_0 f{qs.const_data_ptr<int8_t>(), bits(d), K};
    if (amx) return pagekube_q4::q8_0_amx_linear(x, f, b, y, M, N);
    block_linear(f, x, b, y, M, N);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekube_cpu, m) {
  m.def("q4_1_linear(Tensor input, Tensor qs, Tensor d, Tensor m, Tensor? bias, bool amx=False) -> Tensor");
  m.def("q8_0_linear(Tensor input, Tensor qs, Tensor d, Tensor? bias, bool amx=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
}
