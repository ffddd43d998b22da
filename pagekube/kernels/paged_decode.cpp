// Paged decode attention for CPUs, bf16 caches: one query token per sequence attends over its cached context,
// reading each K/V row in place from the blocks its block table names (torch's path gathers the blocks into a
// contiguous copy first, then SDPA reads them again). One task per (sequence, KV head): that head's K/V rows are
// read once for all the query heads of its GQA group. Scores and the weighted sum in float; output rounded to bf16.
// Built with bf16_linear.cpp by pagekube/kernels/cpu_ops.py; kernels/reference.py is the reference in the tests.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t MAX_DIM = 256;

inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 float (bf16 is the top half of a float)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
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
  const int64_t G = H / KVH, V = D / 16;
  at::Tensor out = at::empty_like(qc);
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.const_data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int32_t* tp = tables.const_data_ptr<int32_t>();
  const int32_t* lp = lens.const_data_ptr<int32_t>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> qv(G * V), acc(G * V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, kvh = task % KVH, ctx = lp[s];
      const int32_t* table = tp + s * MB;
      TORCH_CHECK(ctx >= 1 && ctx <= MB * BS, "paged_decode_attention: context length out of its block table");
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < V; ++j)
          qv[g * V + j] = _mm512_mul_ps(load16(qp + (s * H + kvh * G + g) * D + j * 16), _mm512_set1_ps(sc));
      scores.resize(G * ctx);
      auto row = [&](const uint16_t* cache, int64_t t) {
        return cache + ((static_cast<int64_t>(table[t / BS]) * BS + t % BS) * KVH + kvh) * D;
      };
      for (int64_t t = 0; t < ctx; ++t) {  // q . k for every query head of the group, K row read once
        const uint16_t* k = row(kp, t);
        __m512 kv[MAX_DIM / 16];
        for (int64_t j = 0; j < V; ++j) kv[j] = load16(k + j * 16);
        for (int64_t g = 0; g < G; ++g) {
          __m512 dot = _mm512_mul_ps(qv[g * V], kv[0]);
          for (int64_t j = 1; j < V; ++j) dot = _mm512_fmadd_ps(qv[g * V + j], kv[j], dot);
          scores[g * ctx + t] = _mm512_reduce_add_ps(dot);
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the context
        float* sg = scores.data() + g * ctx;
        float mx = sg[0];
        for (int64_t t = 1; t < ctx; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) sum += (sg[t] = std::exp(sg[t] - mx));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
        for (int64_t j = 0; j < V; ++j) acc[g * V + j] = _mm512_setzero_ps();
      }
      for (int64_t t = 0; t < ctx; ++t) {  // weighted sum of V rows, each read once
        const uint16_t* v = row(vp, t);
        __m512 vv[MAX_DIM / 16];
        for (int64_t j = 0; j < V; ++j) vv[j] = load16(v + j * 16);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * ctx + t]);
          for (int64_t j = 0; j < V; ++j) acc[g * V + j] = _mm512_fmadd_ps(p, vv[j], acc[g * V + j]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < V; ++j)
          _mm256_storeu_si256((__m256i*)(op + (s * H + kvh * G + g) * D + j * 16),
                              (__m256i)_mm512_cvtneps_pbh(acc[g * V + j]));
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
