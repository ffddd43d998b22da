// GGUF blocks of 32 weights to the bf16 weights the engine's bf16 copy holds, rounded as torch rounds the copy (to
// nearest even), so the kernels over the blocks (gguf_linear.cpp, amx_linear.cpp) compute with the same numbers as
// the kernels over the copy, at every batch size.
//
// Q4_1 (the bundled model's linears): w = d*q + m, q in 0..15. A block has only 16 distinct weights, so they are
// built once (one FMA over q = 0..15, one rounding) and every nibble is looked up with a permute. Layout
// (engine/model/layers/gguf_linears.py packs it): qs [N, K/2] bytes, where 32 bytes hold two consecutive blocks,
// byte i = q[block 2p][i] | q[block 2p+1][i] << 4; d and m [N, K/32] float16, as in the file.
//
// Q8_0 (the bundled model's tied embedding, so its lm_head): w = d*q, q in -128..127. Layout as in the file, split:
// qs [N, K] int8, d [N, K/32] float16.
//
// A format gives a weight row's scales as float (`scales`) and then the 64 weights of its blocks 2p and 2p+1
// (`pair`); `bytes(n, p)` is where those blocks start, for prefetching.
#pragma once
#include <immintrin.h>
#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pagekube_blocks {

constexpr int64_t kMaxBlocks = 1024;  // K <= 32768: a row's scales fit a stack buffer of 2 * kMaxBlocks floats

// n float16 values to float.
inline void halfs_to_floats(const uint16_t* h, int64_t n, float* out) {
  int64_t b = 0;
  for (; b + 16 <= n; b += 16)
    _mm512_storeu_ps(out + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + b))));
  for (; b < n; ++b) out[b] = _cvtsh_ss(h[b]);
}

struct Q4_1 {
  const uint8_t* qs;
  const uint16_t *dh, *mh;
  int64_t K;

  int64_t row_bytes() const { return K / 2; }
  const uint8_t* bytes(int64_t n, int64_t p) const { return qs + n * (K / 2) + 32 * p; }
  // s: the row's K/32 scales d, then its K/32 minimums m.
  void scales(int64_t n, float* s) const {
    halfs_to_floats(dh + n * (K / 32), K / 32, s);
    halfs_to_floats(mh + n * (K / 32), K / 32, s + K / 32);
  }
  // d*q is exact in float, so the FMA rounds once, as numpy's d*q + m does when the converter dequantizes.
  void pair(int64_t n, int64_t p, const float* s, __m512bh& lo, __m512bh& hi) const {
    const float *d = s + 2 * p, *m = s + K / 32 + 2 * p;
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes(n, p))));
    const __m512 w0 = _mm512_fmadd_ps(_mm512_set1_ps(d[0]), levels, _mm512_set1_ps(m[0]));
    const __m512 w1 = _mm512_fmadd_ps(_mm512_set1_ps(d[1]), levels, _mm512_set1_ps(m[1]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // entries 0-15: block 2p, 16-31: block 2p+1
    lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x000F)), table);
    hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi16(0x0010)), table);
  }
};

struct Q8_0 {
  const int8_t* qs;
  const uint16_t* dh;
  int64_t K;

  int64_t row_bytes() const { return K; }
  const int8_t* bytes(int64_t n, int64_t p) const { return qs + n * K + 64 * p; }
  void scales(int64_t n, float* s) const { halfs_to_floats(dh + n * (K / 32), K / 32, s); }
  // d*q is exact in float (11 by 8 significant bits), as the converter's float32 weights are; one rounding to bf16.
  void pair(int64_t n, int64_t p, const float* s, __m512bh& lo, __m512bh& hi) const {
    const int8_t* q = bytes(n, p);
    __m512 w[4];
    for (int i = 0; i < 4; ++i)
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)))),
                           _mm512_set1_ps(s[2 * p + i / 2]));
    lo = _mm512_cvtne2ps_pbh(w[1], w[0]);  // the second argument is the low half
    hi = _mm512_cvtne2ps_pbh(w[3], w[2]);
  }
};

}  // namespace pagekube_blocks

namespace pagekube_q4 {

// The linears over the blocks on AMX tiles, at any number of rows (amx_linear.cpp).
void q4_1_amx_linear(const uint16_t* x, const pagekube_blocks::Q4_1& w, const c10::BFloat16* bias, c10::BFloat16* y,
                     int64_t M, int64_t N);
void q8_0_amx_linear(const uint16_t* x, const pagekube_blocks::Q8_0& w, const c10::BFloat16* bias, c10::BFloat16* y,
                     int64_t M, int64_t N);

}  // namespace pagekube_q4
