// The one order in which the AVX-512 linears (bf16_linear.cpp, q4_linear.cpp) add up an output, whatever the number
// of rows, so a row's result never depends on the rows beside it (batch invariance without AMX: docs/architecture.md).
//
// Output y[m][n] = x[m] . w[n]: two float accumulators of 16 lanes, the first taking columns [64p, 64p + 32) and the
// second [64p + 32, 64p + 64) by dpbf16 for p = 0, 1, ... in turn (a last partial chunk of 32, masked, into the
// first); then first + second; then the 16 lanes summed as a tree (lane i + lane i+8, then i + i+4, i + i+2, i + i+1);
// then the bias; then one rounding to bf16 (vcvtneps2bf16).
//
// Up to 8 rows the kernels stream each weight row once and sum each output on its own (sum16). Past that they run
// this file's tiles: 3 rows of x against 4 weight rows (24 accumulators in registers), the accumulators stored and
// summed 16 outputs at a time by a transposed tree (sum16x16) that adds the same lanes in the same order.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace pagekube_dot {

constexpr int64_t kStreamRows = 8;  // up to this many rows of x, each weight row is streamed once (for_row_blocks)

// The tree sum of one vector's 16 lanes.
inline float sum16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  // lanes 0, 1: (0 + 2), (1 + 3)
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// sum16 of 16 vectors at once: out lane j = sum16(v[j]). Each step adds the same lane pairs as sum16, two or four
// vectors per shuffle, so the results are bit for bit the same.
inline __m512 sum16x16(const float* v) {  // v: 16 vectors of 16 floats
  __m512 s1[8], s2[4], s3[2];
  for (int p = 0; p < 8; ++p) {  // lane i + lane i+8: [a's 8 | b's 8]
    const __m512 a = _mm512_loadu_ps(v + 32 * p), b = _mm512_loadu_ps(v + 32 * p + 16);
    s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int q = 0; q < 4; ++q)  // i + i+4: 128-bit lane k holds vector 4q + k's 4 partial sums
    s2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int r = 0; r < 2; ++r) {  // i + i+2: lane k holds [8r + k: (0+2), (1+3); 8r + 4 + k: (0+2), (1+3)]
    const __m512d u = _mm512_castps_pd(s2[2 * r]), w = _mm512_castps_pd(s2[2 * r + 1]);
    s3[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
  }
  // i + i+1: lane 4k + t holds vector 4t + k's sum; the permute puts vector j's at lane j
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// One float to bf16 by the instruction the tiles' stores use (vcvtneps2bf16: nearest even, denormals flushed), so a
// streamed output and a tiled one round alike.
inline at::BFloat16 to_bf16(float v) {
  const __m128i h = (__m128i)_mm_cvtneps_pbh(_mm_set_ss(v));
  return at::BFloat16(static_cast<uint16_t>(_mm_extract_epi16(h, 0)), at::BFloat16::from_bits());
}

inline __mmask32 tail_mask(int64_t left) { return left >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << left) - 1); }

// Rows [0, MB) of x (stride K) against weight rows [0, NB) of w (stride K): each output's first + second accumulator
// stored at sums[i * 256 + j * 16].
template <int MB, int NB>
inline void tile(const uint16_t* x, const uint16_t* w, int64_t K, float* sums) {
  __m512 acc[MB][NB][2];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
  const int64_t full = K / 64 * 64;
  for (int64_t k = 0; k < full; k += 64)
    for (int c = 0; c < 2; ++c) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k + 32 * c);
      for (int i = 0; i < MB; ++i) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k + 32 * c);
        for (int j = 0; j < NB; ++j) acc[i][j][c] = _mm512_dpbf16_ps(acc[i][j][c], xv, wv[j]);
      }
    }
  for (int64_t k = full; k < K; k += 32) {
    const __mmask32 mask = tail_mask(K - k);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j][0] = _mm512_dpbf16_ps(acc[i][j][0], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(sums + i * 256 + j * 16, _mm512_add_ps(acc[i][j][0], acc[i][j][1]));
}

template <int MB>
void tiles(const uint16_t* x, const uint16_t* w, int64_t K, int64_t count, float* sums) {
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) tile<MB, 4>(x, w + j * K, K, sums + j * 16);
  switch (count - j) {
    case 3: tile<MB, 3>(x, w + j * K, K, sums + j * 16); break;
    case 2: tile<MB, 2>(x, w + j * K, K, sums + j * 16); break;
    case 1: tile<MB, 1>(x, w + j * K, K, sums + j * 16); break;
    default: break;
  }
}

constexpr int64_t kGroup = 16;       // weight rows per group: one transposed sum per row of x
constexpr int64_t kChunkBytes = 512 * 1024;  // rows of x per pass over the weights: what stays in L2 while they go by

// y rows [0, M), columns [n0, n1) (a thread's share). weight_rows(n, count) gives weight rows [n, n + count) as bf16
// at a stride of K (in place, or dequantized into a buffer).
template <typename WeightRows>
void tiled_linear(const uint16_t* x, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, WeightRows&& weight_rows,
                  const at::BFloat16* bias, at::BFloat16* y) {
  alignas(64) float sums[3 * 256] = {};
  const int64_t chunk = std::max<int64_t>(3, kChunkBytes / (2 * K) / 3 * 3);
  for (int64_t mc = 0; mc < M; mc += chunk) {
    const int64_t mend = std::min(M, mc + chunk);
    for (int64_t n = n0; n < n1; n += kGroup) {
      const int64_t count = std::min(kGroup, n1 - n);
      const uint16_t* w = weight_rows(n, count);
      for (int64_t m = mc; m < mend; m += 3) {
        const int64_t rows = std::min<int64_t>(3, mend - m);
        if (rows == 3) tiles<3>(x + m * K, w, K, count, sums);
        else if (rows == 2) tiles<2>(x + m * K, w, K, count, sums);
        else tiles<1>(x + m * K, w, K, count, sums);
        const __mmask16 columns = static_cast<__mmask16>((1u << count) - 1);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_maskz_loadu_epi16(columns, bias + n)), 16)) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; ++i)
          _mm256_mask_storeu_epi16(y + (m + i) * N + n, columns,
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum16x16(sums + i * 256), b)));
      }
    }
  }
}

}  // namespace pagekube_dot
