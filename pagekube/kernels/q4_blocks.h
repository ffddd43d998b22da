// Q4_1 blocks to the bf16 weights the engine's bf16 copy holds, bf16(d*q + m), rounded as torch rounds the copy (to
// nearest even). Each block has only 16 distinct weights, so both kernels over the blocks (q4_linear.cpp, q4_amx.cpp)
// build them (one FMA over q = 0..15, one rounding) and look every nibble up with a permute: the same numbers at every
// batch size, whichever kernel runs.
//
// Layout (engine/model/layers/gguf_linears.py packs it): qs [N, K/2] bytes, where 32 bytes hold two consecutive
// blocks, byte i = q[block 2p][i] | q[block 2p+1][i] << 4; d and m [N, K/32] float16, as in the file.
#pragma once
#include <immintrin.h>
#include <cstdint>

#include <c10/util/BFloat16.h>

namespace pagekube_q4 {

// A weight row's scales and minimums as float (dr, mr: its K/32 float16 values).
inline void scales(const uint16_t* dr, const uint16_t* mr, int64_t blocks, float* d, float* m) {
  int64_t b = 0;
  for (; b + 16 <= blocks; b += 16) {
    _mm512_storeu_ps(d + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dr + b))));
    _mm512_storeu_ps(m + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mr + b))));
  }
  for (; b < blocks; ++b) {
    d[b] = _cvtsh_ss(dr[b]);
    m[b] = _cvtsh_ss(mr[b]);
  }
}

// The 64 weights of blocks 2p and 2p+1 (32 bytes at q): `lo` the first block's 32, `hi` the second's.
// d*q is exact in float, so the FMA rounds once, as numpy's d*q + m does when the converter dequantizes.
inline void dequantize64(const uint8_t* q, float d0, float m0, float d1, float m1, __m512bh& lo, __m512bh& hi) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512 w0 = _mm512_fmadd_ps(_mm512_set1_ps(d0), levels, _mm512_set1_ps(m0));
  const __m512 w1 = _mm512_fmadd_ps(_mm512_set1_ps(d1), levels, _mm512_set1_ps(m1));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // entries 0-15: block 2p, 16-31: block 2p+1
  lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x000F)), table);
  hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi16(0x0010)), table);
}

// The same linear on AMX tiles, at any number of rows (amx_linear.cpp).
void q4_amx_linear(const uint16_t* x, const uint8_t* qs, const uint16_t* dh, const uint16_t* mh,
                   const c10::BFloat16* bias, c10::BFloat16* y, int64_t M, int64_t K, int64_t N);

}  // namespace pagekube_q4
