// AVX-512 helpers shared by the CPU extension's sources: 16 bf16 <-> 16 floats, and e^x for 16 floats.
#pragma once
#include <immintrin.h>

namespace pagekube_vec {

// bf16 is a float's top half; the store rounds to nearest even, as at::BFloat16 does.
inline __m512 load16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store16(void* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }

// e^x: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error ~2e-7, far below
// bf16's 4e-3), times 2^n by scalef. A scalar std::exp per element is not vectorized without -ffast-math.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 e = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(e, n);
}

}  // namespace pagekube_vec
