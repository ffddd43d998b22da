// Linear over a quantized checkpoint's weights (engine/quantization/packed.py), for any x86 CPU with AVX2 and
// FMA: y = x @ w.T with w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] (int4/int8) or e4m3[n, k] * scale[n, g]
// (FP8), g = k / group_size; x and y float32. A decode step is bound by reading the weights: int4 is half a byte
// per weight, FP8 one, against float32's 4. Each weight is dequantized exactly as the torch reference computes
// it: into a float buffer once per call, four rows at a time, then dotted with every row of x; at up to three
// rows of x, int weights are dequantized in registers instead. Both take each output's products in the same
// order, so a row's result does not depend on its batch. K and group_size: multiples of 8.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

// 8 int4 or int8 weights of a row from column k, as (q - zero) * scale in float32: exactly torch's reference (the
// integer difference is exact in float32, then one rounding by the multiply).
inline __m256 int8_at(const uint8_t* q, int64_t k, __m256i z, __m256 s) {
  const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi, z)), s);
}

// int4: a broadcast word and per-lane shifts, not byte shuffles (measured faster: AVX2 CPUs have few shuffle ports).
inline __m256 int4_at(const uint8_t* q, int64_t k, __m256i z, __m256 s) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);  // column i at bits 4i of its word
  uint32_t word;
  std::memcpy(&word, q + k / 2, 4);
  const __m256i qi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                      _mm256_set1_epi32(0xF));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi, z)), s);
}

// Weight row n as float32 into w[0..K).
void dequantize_row(const uint8_t* q, const float* scale, const uint8_t* zero, int64_t K, int64_t group_size,
                    int64_t bits, float* w) {
  for (int64_t g = 0; g < K / group_size; ++g) {
    const __m256i z = _mm256_set1_epi32(zero[g]);
    const __m256 s = _mm256_set1_ps(scale[g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 8)
      _mm256_storeu_ps(w + k, bits == 4 ? int4_at(q, k, z, s) : int8_at(q, k, z, s));
  }
}

// FP8 e4m3 weight row n, times its scales (one per `group_size` columns), into w[0..K). The e4m3 bits moved
// into a float32's exponent and mantissa fields read as 2^-120 times the value (normal and subnormal alike), so
// one multiply by 2^120 gives it exactly; then one multiply by the scale, as torch's `w.float() * scale`.
void dequantize_fp8_row(const uint8_t* q, const float* scale, int64_t K, int64_t group_size, float* w) {
  const __m256 two_120 = _mm256_set1_ps(1.329228e36f);  // 2^120
  const __m256i magnitude = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32(0x80);
  for (int64_t g = 0; g < K / group_size; ++g) {
    const __m256 s = _mm256_set1_ps(scale[g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 8) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
      const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, magnitude), 20),
                                           _mm256_slli_epi32(_mm256_and_si256(v, sign), 24));
      const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(bits), two_120);
      _mm256_storeu_ps(w + k, _mm256_mul_ps(value, s));
    }
  }
}

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int kNB = 4;  // weight rows per pass over x
constexpr int kMB = 3;  // rows of x per pass: kNB x kMB accumulators, 12 of AVX2's 16 registers

// Rows [m0, m0 + MB) of x against NB dequantized weight rows (w: NB rows of K), each sum over k in order.
template <int NB, int MB>
void dot_block(const float* w, const float* x, int64_t K, float* y, int64_t N, int64_t n0, int64_t m0) {
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * K + k);
      for (int i = 0; i < MB; ++i) acc[j][i] = _mm256_fmadd_ps(wv, xv[i], acc[j][i]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) y[(m0 + i) * N + n0 + j] = hsum(acc[j][i]);
}

// Every row of x against NB dequantized weight rows.
template <int NB>
void dot_all_rows(const float* w, const float* x, int64_t M, int64_t K, float* y, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + kMB <= M; m += kMB) dot_block<NB, kMB>(w, x, K, y, N, n0, m);
  if (M - m == 2) dot_block<NB, 2>(w, x, K, y, N, n0, m);
  if (M - m == 1) dot_block<NB, 1>(w, x, K, y, N, n0, m);
}

// y = x @ w.T: kNB weight rows at a time dequantized by `dequantize(n, w)`, then dotted with every row of x (each
// pass over x serves kNB weight rows, so x is read N / kNB times, from cache).
template <typename Dequantize>
at::Tensor linear(const at::Tensor& x, int64_t N, Dequantize dequantize) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kNB - 1) / kNB, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(kNB * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kNB, nb = std::min<int64_t>(kNB, N - n0);
      for (int64_t j = 0; j < nb; ++j) dequantize(n0 + j, w.data() + j * K);
      switch (nb) {
        case 4: dot_all_rows<4>(w.data(), xp, M, K, yp, N, n0); break;
        case 3: dot_all_rows<3>(w.data(), xp, M, K, yp, N, n0); break;
        case 2: dot_all_rows<2>(w.data(), xp, M, K, yp, N, n0); break;
        default: dot_all_rows<1>(w.data(), xp, M, K, yp, N, n0);
      }
    }
  });
  return y;
}

// Rows of x (M <= kMB) against NB int weight rows from n0, dequantized in registers 8 columns at a time (no
// buffer: a step of a few rows is bound by dequantizing, not by reading x). NB rows at once give NB independent
// FMA chains (one accumulator's chain alone waits on the FMA latency). Each sum takes the same products in the
// same order as dot_block's, so a row's result is bit-identical to the buffered path's (batch invariance).
template <int NB, int MB, int BITS>
void int_rows_fused(const uint8_t* q, int64_t row_bytes, const float* scale, const uint8_t* zero, int64_t groups,
                    int64_t K, int64_t group_size, const float* x, float* y, int64_t N, int64_t n0) {
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i z[NB];
    __m256 s[NB];
    for (int j = 0; j < NB; ++j) {
      z[j] = _mm256_set1_epi32(zero[(n0 + j) * groups + g]);
      s[j] = _mm256_set1_ps(scale[(n0 + j) * groups + g]);
    }
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 8) {
      for (int j = 0; j < NB; ++j) {
        const uint8_t* row = q + (n0 + j) * row_bytes;
        const __m256 w = BITS == 4 ? int4_at(row, k, z[j], s[j]) : int8_at(row, k, z[j], s[j]);
        for (int i = 0; i < MB; ++i) acc[j][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i * K + k), acc[j][i]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) y[i * N + n0 + j] = hsum(acc[j][i]);
}

// Weight rows [n0, n0 + nb) (nb <= kNB) against every row of x (M <= kMB), in registers.
template <int BITS>
void int_block_fused(int64_t M, int64_t nb, const uint8_t* q, int64_t row_bytes, const float* scale,
                     const uint8_t* zero, int64_t groups, int64_t K, int64_t group_size, const float* x, float* y,
                     int64_t N, int64_t n0) {
#define PAGEKUBE_FUSED(NB, MB) \
  int_rows_fused<NB, MB, BITS>(q, row_bytes, scale, zero, groups, K, group_size, x, y, N, n0)
  if (nb == kNB) {
    if (M == 3) PAGEKUBE_FUSED(kNB, 3); else if (M == 2) PAGEKUBE_FUSED(kNB, 2); else PAGEKUBE_FUSED(kNB, 1);
    return;
  }
  for (int64_t j = 0; j < nb; ++j, ++n0) {  // the last rows, one at a time
    if (M == 3) PAGEKUBE_FUSED(1, 3); else if (M == 2) PAGEKUBE_FUSED(1, 2); else PAGEKUBE_FUSED(1, 1);
  }
#undef PAGEKUBE_FUSED
}

void check_x_and_scale(const at::Tensor& x, const at::Tensor& scale, int64_t N, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 8 == 0 && group_size % 8 == 0 && K % group_size == 0, "K and group_size: multiples of 8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == N &&
                  scale.size(1) == K / group_size, "scale: contiguous float32 [N, K / group_size]");
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t group_size) {
  const int64_t N = weight.size(0), K = x.size(1);
  check_x_and_scale(x, scale, N, group_size);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.size(1) == K,
              "weight: the e4m3 bytes as contiguous uint8 [N, K]");
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t groups = K / group_size;
  return linear(x, N, [&](int64_t n, float* w) { dequantize_fp8_row(wp + n * K, sp + n * groups, K, group_size, w); });
}

at::Tensor int_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                      int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  const int64_t N = packed.size(0), K = x.size(1);
  check_x_and_scale(x, scale, N, group_size);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) * 8 == K * bits,
              "packed: contiguous uint8 [N, K * bits / 8]");
  TORCH_CHECK(zero.scalar_type() == at::kByte && zero.is_contiguous() && zero.sizes() == scale.sizes(),
              "zero: contiguous uint8 like scale");
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  const int64_t groups = K / group_size, row_bytes = K * bits / 8;
  const int64_t M = x.size(0);
  if (M >= 1 && M <= kMB) {  // a decode step of up to three sequences: dequantize in registers
    at::Tensor y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, (N + kNB - 1) / kNB, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kNB, nb = std::min<int64_t>(kNB, N - n0);
        if (bits == 4)
          int_block_fused<4>(M, nb, qp, row_bytes, sp, zp, groups, K, group_size, xp, yp, N, n0);
        else
          int_block_fused<8>(M, nb, qp, row_bytes, sp, zp, groups, K, group_size, xp, yp, N, n0);
      }
    });
    return y;
  }
  return linear(x, N, [&](int64_t n, float* w) {
    dequantize_row(qp + n * row_bytes, sp + n * groups, zp + n * groups, K, group_size, bits, w);
  });
}

}  // namespace

TORCH_LIBRARY(pagekube_int, m) {
  m.def("int_linear(Tensor input, Tensor packed, Tensor scale, Tensor zero, int bits, int group_size) -> Tensor");
  m.def("fp8_linear(Tensor input, Tensor weight, Tensor scale, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagekube_int, CPU, m) {
  m.impl("int_linear", &int_linear);
  m.impl("fp8_linear", &fp8_linear);
}
