// Linear over weights kept in GGUF's Q4_1 blocks (w = d*q + m per 32 weights, q in 0..15), for CPUs
// with AVX512_BF16: y = x @ w.T (+ bias), x and y bf16, float accumulation. A decode step at a few sequences is
// bound by reading the weights, and Q4_1 is 0.625 bytes per weight against bf16's 2. The weights are the bf16 copy's
// (q4_blocks.h), looked up per block and fed straight into dpbf16 up to 8 rows of x; past 8, 16 weight rows at a time
// are dequantized into a per-thread buffer and multiplied as bf16 weights in register tiles. Every output is added up
// in dot_order.h's order, the bf16 kernel's, so a row's result depends neither on its batch nor on which of the two
// kernels (blocks or bf16 copy) computed it. K is a multiple of 64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <vector>

#include "dot_order.h"
#include "q4_blocks.h"
#include "row_blocks.h"

namespace {

constexpr int64_t kMaxBlocks = 1024;  // K <= 32768: the per-row scales live on the stack

// One weight row against MB rows of x.
template <int MB>
void q4_row(const uint16_t* x, const uint8_t* qs, const uint16_t* dh, const uint16_t* mh, const at::BFloat16* bias,
            at::BFloat16* y, int64_t K, int64_t N, int64_t n, int64_t m0) {
  const int64_t KB = K / 32;
  float d[kMaxBlocks], mn[kMaxBlocks];
  pagekube_q4::scales(dh + n * KB, mh + n * KB, KB, d, mn);
  // Two accumulators per x row (even and odd blocks): one would be a chain of dependent dpbf16s.
  __m512 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint8_t* qr = qs + n * (K / 2);
  for (int64_t p = 0; p < K / 64; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(qr + 32 * p + 4096), _MM_HINT_T0);
    __m512bh lo, hi;
    pagekube_q4::dequantize64(qr + 32 * p, d[2 * p], mn[2 * p], d[2 * p + 1], mn[2 * p + 1], lo, hi);
    for (int i = 0; i < MB; ++i) {
      const uint16_t* xr = x + (m0 + i) * K + 64 * p;
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_loadu_si512(xr), lo);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], (__m512bh)_mm512_loadu_si512(xr + 32), hi);
    }
  }
  const float bn = bias ? static_cast<float>(bias[n]) : 0.f;
  for (int i = 0; i < MB; ++i)
    y[(m0 + i) * N + n] = pagekube_dot::to_bf16(pagekube_dot::sum16(_mm512_add_ps(acc[i][0], acc[i][1])) + bn);
}

// Weight rows [n, n + count) dequantized to bf16 into `out` (count rows of K).
void dequantize_rows(const uint8_t* qs, const uint16_t* dh, const uint16_t* mh, int64_t K, int64_t n, int64_t count,
                     uint16_t* out) {
  const int64_t KB = K / 32;
  float d[kMaxBlocks], mn[kMaxBlocks];
  for (int64_t r = 0; r < count; ++r) {
    pagekube_q4::scales(dh + (n + r) * KB, mh + (n + r) * KB, KB, d, mn);
    const uint8_t* qr = qs + (n + r) * (K / 2);
    for (int64_t p = 0; p < K / 64; ++p) {
      __m512bh lo, hi;
      pagekube_q4::dequantize64(qr + 32 * p, d[2 * p], mn[2 * p], d[2 * p + 1], mn[2 * p + 1], lo, hi);
      _mm512_storeu_si512(out + r * K + 64 * p, (__m512i)lo);
      _mm512_storeu_si512(out + r * K + 64 * p + 32, (__m512i)hi);
    }
  }
}

template <int MB>
void q4_rows(const uint16_t* x, const uint8_t* qs, const uint16_t* dh, const uint16_t* mh, const at::BFloat16* bias,
             at::BFloat16* y, int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t m) {
  for (int64_t n = n0; n < n1; ++n) q4_row<MB>(x, qs, dh, mh, bias, y, K, N, n, m);
}

at::Tensor q4_1_linear(const at::Tensor& input, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       const c10::optional<at::Tensor>& bias_opt, bool amx) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2, "q4_1_linear: x must be 2-D bf16");
  const int64_t M = input.size(0), K = input.size(1), N = qs.size(0);
  TORCH_CHECK(K % 64 == 0 && K / 32 <= kMaxBlocks, "q4_1_linear: K must be a multiple of 64, at most 32768");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2, "q4_1_linear: qs [N, K/2] uint8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.size(0) == N && m.size(0) == N &&
              d.size(1) == K / 32 && m.size(1) == K / 32, "q4_1_linear: d, m [N, K/32] float16");
  const at::Tensor x = input.contiguous(), q = qs.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const at::Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.const_data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(mc.const_data_ptr());
  const at::BFloat16* bp = bias.defined() ? bias.const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (amx) {
    pagekube_q4::q4_amx_linear(xp, qp, dp, mp, bp, yp, M, K, N);
    return y;
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (M > pagekube_dot::kStreamRows) {
      thread_local std::vector<uint16_t> buffer;
      buffer.resize(pagekube_dot::kGroup * K);
      pagekube_dot::tiled_linear(xp, M, K, N, n0, n1, [&](int64_t n, int64_t count) {
        dequantize_rows(qp, dp, mp, K, n, count, buffer.data());
        return static_cast<const uint16_t*>(buffer.data());
      }, bp, yp);
      return;
    }
    pagekube_rows::for_row_blocks(M, [&](auto mb, int64_t m) {
      q4_rows<decltype(mb)::value>(xp, qp, dp, mp, bp, yp, K, N, n0, n1, m);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekube_cpu, m) {
  m.def("q4_1_linear(Tensor input, Tensor qs, Tensor d, Tensor m, Tensor? bias, bool amx=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) { m.impl("q4_1_linear", &q4_1_linear); }
