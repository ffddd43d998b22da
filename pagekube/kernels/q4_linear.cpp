// Small-batch linear over weights kept in GGUF's Q4_1 blocks (w = d*q + m per 32 weights, q in 0..15), for CPUs
// with AVX512_BF16: y = x @ w.T (+ bias), x and y bf16, float accumulation. A decode step at a few sequences is
// bound by reading the weights, and Q4_1 is 0.625 bytes per weight against bf16's 2. The weights are exact (d*q + m
// in float; a bf16 copy rounds them), so results equal the bf16 kernel's to bf16 rounding.
//
// Layout (engine/gguf_linears.py packs it): qs [N, K/2] bytes, where 32 bytes hold two consecutive blocks, byte i =
// q[block 2p][i] | q[block 2p+1][i] << 4; d and m [N, K/32] float16, as in the file. K is a multiple of 64.
// A nibble becomes a bf16 by bit pattern: 0x4300 | q is the bf16 of 128 + q. So each block's dot is
// d * dot(x, q + 128) and the constant is folded into the minimum: + (m - 128 d) * sum(x over the block).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "row_blocks.h"

namespace {

constexpr int64_t kMaxBlocks = 1024;  // K <= 32768: the per-row scales live on the stack

// One weight row against MB rows of x. xsum: [M, K/32] per-block sums of x (float).
template <int MB>
void q4_row(const uint16_t* x, const float* xsum, const uint8_t* qs, const uint16_t* dh, const uint16_t* mh,
            const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t N, int64_t n, int64_t m0) {
  const int64_t KB = K / 32;
  alignas(64) float d[kMaxBlocks], mb[kMaxBlocks];  // d, and m - 128 d, as float
  const uint16_t* dr = dh + n * KB;
  const uint16_t* mr = mh + n * KB;
  int64_t b = 0;
  for (; b + 16 <= KB; b += 16) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dr + b)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mr + b)));
    _mm512_store_ps(d + b, dv);
    _mm512_store_ps(mb + b, _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dv, mv));
  }
  for (; b < KB; ++b) {
    d[b] = _cvtsh_ss(dr[b]);
    mb[b] = _cvtsh_ss(mr[b]) - 128.f * d[b];
  }

  // Two accumulators per x row (even and odd blocks): one would be a chain of dependent FMAs.
  __m512 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  const uint8_t* qr = qs + n * (K / 2);
  for (int64_t p = 0; p < K / 64; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(qr + 32 * p + 4096), _MM_HINT_T0);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + 32 * p)));
    const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, low, bf16_128, 0xEA);  // (w & 0xF) | 0x4300
    const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), bf16_128);
    const __m512 d0 = _mm512_set1_ps(d[2 * p]), d1 = _mm512_set1_ps(d[2 * p + 1]);
    for (int i = 0; i < MB; ++i) {
      const uint16_t* xr = x + (m0 + i) * K + 64 * p;
      const __m512 t0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xr), lo);
      const __m512 t1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xr + 32), hi);
      acc[i][0] = _mm512_fmadd_ps(t0, d0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(t1, d1, acc[i][1]);
    }
  }
  const float bn = bias ? static_cast<float>(bias[n]) : 0.f;
  for (int i = 0; i < MB; ++i) {
    const float* s = xsum + (m0 + i) * KB;
    __m512 t = _mm512_add_ps(acc[i][0], acc[i][1]);
    int64_t c = 0;
    for (; c + 16 <= KB; c += 16) t = _mm512_fmadd_ps(_mm512_load_ps(mb + c), _mm512_loadu_ps(s + c), t);
    float tail = bn;
    for (; c < KB; ++c) tail += mb[c] * s[c];
    y[(m0 + i) * N + n] = at::BFloat16(_mm512_reduce_add_ps(t) + tail);
  }
}

template <int MB>
void q4_rows(const uint16_t* x, const float* xsum, const uint8_t* qs, const uint16_t* dh, const uint16_t* mh,
             const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t m) {
  for (int64_t n = n0; n < n1; ++n) q4_row<MB>(x, xsum, qs, dh, mh, bias, y, K, N, n, m);
}

at::Tensor q4_1_linear(const at::Tensor& input, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       const c10::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2, "q4_1_linear: x must be 2-D bf16");
  const int64_t M = input.size(0), K = input.size(1), N = qs.size(0);
  TORCH_CHECK(K % 64 == 0 && K / 32 <= kMaxBlocks, "q4_1_linear: K must be a multiple of 64, at most 32768");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2, "q4_1_linear: qs [N, K/2] uint8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.size(0) == N && m.size(0) == N &&
              d.size(1) == K / 32 && m.size(1) == K / 32, "q4_1_linear: d, m [N, K/32] float16");
  const at::Tensor x = input.contiguous(), q = qs.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const at::Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : at::Tensor();
  // Per-block sums of x (as the dot products see it: bf16 values, float sums), for the minimum's term.
  const at::Tensor xsum = x.view({M, K / 32, 32}).to(at::kFloat).sum(-1).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const float* sp = xsum.const_data_ptr<float>();
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.const_data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(mc.const_data_ptr());
  const at::BFloat16* bp = bias.defined() ? bias.const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    pagekube_rows::for_row_blocks(M, [&](auto mb, int64_t m) {
      q4_rows<decltype(mb)::value>(xp, sp, qp, dp, mp, bp, yp, K, N, n0, n1, m);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekube_cpu, m) {
  m.def("q4_1_linear(Tensor input, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) { m.impl("q4_1_linear", &q4_1_linear); }
