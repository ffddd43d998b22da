// Paged decode attention for CPUs, bf16 caches: one query token per sequence attends over its cached context,
// reading each K/V row in place from the blocks its block table names (torch's path gathers the blocks into a
// contiguous copy first, then SDPA reads them again). A task is a sequence (or, with few sequences, one of its KV
// heads); its K/V rows are read from memory once for all its query heads. Scores and the weighted sum in float;
// output rounded to bf16.
// Built with bf16_linear.cpp by pagekube/kernels/cpu_ops.py; kernels/reference.py is the reference in the tests.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

using pagekube_vec::exp16;

constexpr int64_t MAX_DIM = 256;

struct Task {  // one sequence, KV heads [kv0, kv1)
  const uint16_t *q, *k, *v;  // q: the sequence's query heads; k, v: the caches (head kvh of token row r at
  uint16_t* out;              // r * row_stride + kvh * D from a block's start)
  const int32_t* table;
  int64_t ctx, G, D, BS, row_stride, kv0, kv1;
  float scale;
};

// Lane i of the result: the sum of d[i]'s 16 lanes (a transpose-and-add tree: ~3 instructions per vector,
// where a horizontal sum of each costs 8).
inline __m512 sum16(const __m512* d) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit segment: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per segment: that segment's sum of d[4i], d[4i+1], d[4i+2], d[4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The next group's rows (the task's KV heads of 16 tokens) while this group computes: blocks sit anywhere in the
// cache, so the hardware prefetcher sees no stream across them (the decode step's attention: 1.24 -> 0.84 ms per
// layer at 32 sequences of 512 tokens in one micro-benchmark run).
inline void prefetch_group(const uint16_t* cache, const int64_t* rows, int64_t i0, int64_t ctx, int64_t bytes) {
  for (int64_t i = i0; i < std::min<int64_t>(i0 + 16, ctx); ++i)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cache + rows[i]) + b, _MM_HINT_T0);
}

inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// One task with head_dim = 16 * V (a compile-time size: q and the accumulators live in registers), in chunks of
// 32 dims (the last one half when V is odd). Tokens go in groups of 16, every head of the task over each group,
// so a group's rows (all KV heads of a token are adjacent) are read from memory once and in order: per head, a
// third of each row at a stride (GQA) read slower than the hardware prefetcher's streams. q . k: vdpbf16ps on the
// bf16 rows as they are, 16 dots summed at once. Weighted V sum: a 32-bit lane holds dims 2i (low half) and 2i+1
// (high half), made floats by one shift or mask, so even and odd dims accumulate apart, interleaved at the end.
template <int V>
void attend(const Task& t, float* scores, int64_t* rows, __m512* acc) {
  constexpr int C = (V + 1) / 2;
  constexpr bool half = V % 2;
  const auto mask16 = [](int c) { return half && c == C - 1 ? (__mmask32)0xFFFF : ~(__mmask32)0; };
  const auto mask32 = [](int c) { return half && c == C - 1 ? (__mmask16)0xFF : (__mmask16)0xFFFF; };
  const int64_t h0 = t.kv0 * t.G, nh = (t.kv1 - t.kv0) * t.G, ctx = t.ctx;
  for (int64_t b = 0, i = 0; i < ctx; ++b)  // each token's row, per block: no division per token
    for (int64_t r = 0, base = static_cast<int64_t>(t.table[b]) * t.BS * t.row_stride; r < t.BS && i < ctx; ++r)
      rows[i++] = base + r * t.row_stride;

  for (int64_t i0 = 0; i0 < ctx; i0 += 16) {  // scores[h][i] = q_h . k_i * scale
    const int64_t n = std::min<int64_t>(16, ctx - i0);
    prefetch_group(t.k + (t.kv0 * t.D), rows, i0 + 16, ctx, (t.kv1 - t.kv0) * t.D * 2);
    for (int64_t h = 0; h < nh; ++h) {
      const uint16_t* qh = t.q + (h0 + h) * t.D;
      const int64_t koff = (t.kv0 + h / t.G) * t.D;
      __m512bh q[C];
      for (int c = 0; c < C; ++c) q[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask16(c), qh + 32 * c);
      __m512 d[16];
      for (int r = 0; r < 16; ++r) {  // past the context: the last row again, not stored
        const uint16_t* k = t.k + rows[i0 + std::min<int64_t>(r, n - 1)] + koff;
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
          dot = _mm512_dpbf16_ps(dot, q[c], (__m512bh)_mm512_maskz_loadu_epi16(mask16(c), k + 32 * c));
        d[r] = dot;
      }
      _mm512_mask_storeu_ps(scores + h * ctx + i0, first(n), _mm512_mul_ps(sum16(d), _mm512_set1_ps(t.scale)));
    }
  }
  for (int64_t h = 0; h < nh; ++h) {  // softmax over the context, 16 scores at a time (unnormalized: see below)
    float* sh = scores + h * ctx;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < ctx; c += 16)
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first(ctx - c), sh + c));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < ctx; c += 16) {
      const __mmask16 m = first(ctx - c);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sh + c), top)));
      _mm512_mask_storeu_ps(sh + c, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    for (int c = 0; c < 2 * C; ++c) acc[h * 2 * C + c] = _mm512_setzero_ps();
    acc[nh * 2 * C + h] = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  }
  const __m512i odd_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i0 = 0; i0 < ctx; i0 += 16) {  // out_h = sum_i p[h][i] v_i, then / sum
    const int64_t n = std::min<int64_t>(16, ctx - i0);
    prefetch_group(t.v + (t.kv0 * t.D), rows, i0 + 16, ctx, (t.kv1 - t.kv0) * t.D * 2);
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t voff = (t.kv0 + h / t.G) * t.D;
      __m512 even[C], odd[C];
      for (int c = 0; c < C; ++c) even[c] = acc[h * 2 * C + c], odd[c] = acc[h * 2 * C + C + c];
      for (int64_t i = i0; i < i0 + n; ++i) {
        const uint16_t* v = t.v + rows[i] + voff;
        const __m512 p = _mm512_set1_ps(scores[h * ctx + i]);
        for (int c = 0; c < C; ++c) {
          const __m512i x = _mm512_maskz_loadu_epi32(mask32(c), v + 32 * c);
          even[c] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), even[c]);
          odd[c] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_and_si512(x, odd_half)), odd[c]);
        }
      }
      for (int c = 0; c < C; ++c) acc[h * 2 * C + c] = even[c], acc[h * 2 * C + C + c] = odd[c];
    }
  }
  for (int64_t h = 0; h < nh; ++h) {  // round to bf16 and interleave: dim 2i low, 2i+1 high
    const __m512 inv = acc[nh * 2 * C + h];
    for (int c = 0; c < C; ++c) {
      const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[h * 2 * C + c], inv)));
      const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[h * 2 * C + C + c], inv)));
      _mm512_mask_storeu_epi32(t.out + (h0 + h) * t.D + 32 * c, mask32(c),
                               _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
    }
  }
}

template <int V>
void attend_dispatch(int64_t vecs, const Task& t, float* scores, int64_t* rows, __m512* acc) {  // head_dim/16
  if constexpr (V > 1) {
    if (vecs < V) return attend_dispatch<V - 1>(vecs, t, scores, rows, acc);
  }
  attend<V>(t, scores, rows, acc);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "paged_decode_attention: bf16 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "paged_decode_attention: shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: int32 block tables and context lengths");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t S = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= MAX_DIM, "paged_decode_attention: head_dim % 16, <= 256");
  TORCH_CHECK(H % KVH == 0 && tables.size(0) == S && lens.size(0) == S, "paged_decode_attention: heads or batch");
  const int64_t G = H / KVH;
  at::Tensor out = at::empty_like(qc);
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.const_data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int32_t* tp = tables.const_data_ptr<int32_t>();
  const int32_t* lp = lens.const_data_ptr<int32_t>();
  // A task is a sequence's KV heads, all of them when there are sequences enough to keep every thread busy;
  // with fewer, each KV head is a task of its own.
  const int64_t split = S >= 2 * at::get_num_threads() ? 1 : KVH, per = KVH / split;

  at::parallel_for(0, S * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> rows;
    std::vector<__m512> acc(per * G * (MAX_DIM / 16 + 1));  // per head: even and odd accumulators, then 1 / sum
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / split, kv0 = task % split * per, ctx = lp[s];
      TORCH_CHECK(ctx >= 1 && ctx <= MB * BS, "paged_decode_attention: context length out of its block table");
      scores.resize(per * G * ctx);
      rows.resize(ctx);
      const Task t{qp + s * H * D, kp, vp, op + s * H * D, tp + s * MB, ctx, G, D, BS, KVH * D, kv0, kv0 + per,
                   static_cast<float>(scale)};
      attend_dispatch<MAX_DIM / 16>(D / 16, t, scores.data(), rows.data(), acc.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekube_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
