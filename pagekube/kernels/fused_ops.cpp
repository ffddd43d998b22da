// Fused small ops of a bf16 decoder layer on the CPU. At decode batch sizes each of these is a handful of torch ops
// on a few KB (RMSNorm is 8, RoPE + the cache write about 20), so a step pays for dispatch, not for the data:
// one pass each here. Float math, one bf16 rounding per output; the torch path (engine/model.py) is the reference
// in the tests. Built with the other sources by pagekube/kernels/cpu_ops.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>

#include "vec_math.h"

namespace {

using pagekube_vec::exp16;
using pagekube_vec::load16;
using pagekube_vec::store16;

inline float f(const at::BFloat16 v) { return static_cast<float>(v); }

void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what, ": contiguous bf16 only");
}

// RMSNorm of each row, as transformers computes it: normalize in float, round to bf16, multiply by the weight.
// With `residual`, first residual += x (rounded to bf16, in place), then normalize the sum: the decoder's
// "add the sublayer's output, normalize for the next one" in one pass.
void norm_rows(const at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* w, at::BFloat16* out, int64_t rows,
               int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16* xr = x + r * dim;
      at::BFloat16* src = residual ? residual + r * dim : const_cast<at::BFloat16*>(xr);
      if (residual)
        for (int64_t i = 0; i < dim; ++i) src[i] = at::BFloat16(f(src[i]) + f(xr[i]));
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) ss += f(src[i]) * f(src[i]);
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      at::BFloat16* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = at::BFloat16(f(w[i]) * f(at::BFloat16(f(src[i]) * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16(x, "rms_norm"), check_bf16(weight, "rms_norm");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "rms_norm: weight size");
  at::Tensor out = at::empty_like(x);
  norm_rows(x.const_data_ptr<at::BFloat16>(), nullptr, weight.const_data_ptr<at::BFloat16>(),
            out.data_ptr<at::BFloat16>(), x.numel() / dim, dim, static_cast<float>(eps));
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_bf16(x, "add_rms_norm"), check_bf16(residual, "add_rms_norm"), check_bf16(weight, "add_rms_norm");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim && residual.sizes() == x.sizes(), "add_rms_norm: shapes");
  at::Tensor out = at::empty_like(x);
  norm_rows(x.const_data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(), weight.const_data_ptr<at::BFloat16>(),
            out.data_ptr<at::BFloat16>(), x.numel() / dim, dim, static_cast<float>(eps));
  return out;
}

// silu(gate) * up for gate_up = [gate | up] along the last dim (the MLP's fused projection).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_bf16(gate_up, "silu_and_mul");
  const int64_t two = gate_up.size(-1), d = two / 2, rows = gate_up.numel() / two;
  TORCH_CHECK(two % 2 == 0, "silu_and_mul: even last dim");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const at::BFloat16* in = gate_up.const_data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16 *gate = in + r * two, *up = gate + d;
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(o + r * d + i, _mm512_mul_ps(silu, load16(up + i)));
      }
      for (; i < d; ++i) {
        const float g = f(gate[i]);
        o[r * d + i] = at::BFloat16(g / (1.f + std::exp(-g)) * f(up[i]));
      }
    }
  });
  return out;
}

// Rotary embedding of q and k (transformers' rotate_half layout) straight out of the fused qkv projection, with
// k and v stored at their cache slots (slot = block * block_size + offset; -1 skips the token). Returns the
// rotated q, [tokens, heads, head_dim]. cos/sin: [tokens, head_dim] (any leading broadcast dims of size 1).
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  check_bf16(qkv, "rope_write_kv"), check_bf16(k_cache, "rope_write_kv"), check_bf16(v_cache, "rope_write_kv");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.to(at::kLong).contiguous();
  check_bf16(c, "rope_write_kv cos"), check_bf16(s, "rope_write_kv sin");
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * D && k_cache.size(2) == kv_heads &&
              k_cache.sizes() == v_cache.sizes() && c.numel() == T * D && s.numel() == T * D && slots.numel() == T &&
              D % 2 == 0, "rope_write_kv: shapes");
  const int64_t cap = k_cache.numel() / (kv_heads * D), half = D / 2, width = qkv.size(1);
  at::Tensor q = at::empty({T, heads, D}, qkv.options());
  const at::BFloat16 *in = qkv.const_data_ptr<at::BFloat16>(), *cp = c.const_data_ptr<at::BFloat16>(),
                     *sp = s.const_data_ptr<at::BFloat16>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  at::BFloat16 *qp = q.data_ptr<at::BFloat16>(), *kp = k_cache.data_ptr<at::BFloat16>(),
               *vp = v_cache.data_ptr<at::BFloat16>();
  auto rotate = [&](const at::BFloat16* x, const at::BFloat16* ct, const at::BFloat16* st, at::BFloat16* y) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = f(x[i]), b = f(x[i + half]);
      y[i] = at::BFloat16(a * f(ct[i]) - b * f(st[i]));
      y[i + half] = at::BFloat16(b * f(ct[i + half]) + a * f(st[i + half]));
    }
  };
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const at::BFloat16 *row = in + t * width, *ct = cp + t * D, *st = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * D, ct, st, qp + (t * heads + h) * D);
      if (slot[t] < 0) continue;
      TORCH_CHECK(slot[t] < cap, "rope_write_kv: slot ", slot[t], " outside the cache");
      for (int64_t h = 0; h < kv_heads; ++h) {
        at::BFloat16* dst = kp + (slot[t] * kv_heads + h) * D;
        rotate(row + (heads + h) * D, ct, st, dst);
        std::copy_n(row + (heads + kv_heads + h) * D, D, vp + (slot[t] * kv_heads + h) * D);
      }
    }
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagekube_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int heads, int kv_heads) -> Tensor");
}
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_write_kv", &rope_write_kv);
}
