// Linears on AMX tiles (CPUs with AMX-BF16: Sapphire Rapids and later), over a GGUF's Q4_1 blocks or over bf16
// weights, at any number of rows: one kernel for a decode step of one sequence and for a prefill of hundreds of
// tokens, so a row's result never depends on the rows beside it (the engine's batch invariance, docs/architecture.md).
//
// y = x @ w.T (+ bias) is computed transposed, tile C[n][m] = W[n] . x[m]: A tiles are 16 weight rows of 32 k (bf16
// weights straight from memory; a GGUF's Q4_1 or Q8_0 blocks dequantized into a per-thread buffer to the bf16 copy's
// values, gguf_blocks.h), B tiles are x's rows in AMX's pair layout. Every C element adds its K/32 tile products in the same
// order whatever M is (torch's AMX GEMM, measured, adds in the same order: the numbers agree with F.linear's). Two
// weight blocks and two blocks of x per pass (four C tiles), so each tile load feeds two products.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "gguf_blocks.h"

namespace pagekube_q4 {
namespace {

constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (weight block g, x block j at 2j + g); 4-5: A (the two weight blocks); 6-7: B (the two x blocks).
// 16 rows each; a C or B tile is as wide as its block of x has rows (fewer than 16 only when M is), so a step of one
// row multiplies one column, not sixteen; each C element is computed the same way at any width. Configured on each
// call and released after it: torch's own AMX GEMM (oneDNN) configures the same thread's tiles in between.
void configure_tiles(int64_t M) {
  TileConfig cfg;
  const uint16_t first = static_cast<uint16_t>(4 * std::min<int64_t>(16, M));
  const uint16_t second = static_cast<uint16_t>(4 * std::clamp<int64_t>(M - 16, 1, 16));
  const uint16_t widths[8] = {first, first, second, second, 64, 64, first, second};
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = widths[t];
  // GCC does not see ldtilecfg read the struct and drops its stores at -O3: a compiler barrier keeps them.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// x [M, K] bf16 as B tiles: [M/16 blocks][K/32 tiles][16 pairs of k][16 rows of x], each entry the two bf16 of k and
// k+1 (zeros past M): a 16 x 16 transpose of x's pairs per tile, one masked gather per tile row.
std::vector<uint32_t> pack_x(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t KT = K / 32, MB = (M + 15) / 16, pairs = K / 2;
  std::vector<uint32_t> out(MB * KT * 256);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(pairs)));
  for (int64_t mb = 0; mb < MB; ++mb) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, M - mb * 16)) - 1);
    const int* base = reinterpret_cast<const int*>(x) + mb * 16 * pairs;
    for (int64_t k = 0; k < pairs; ++k) {
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, base + k, 4);
      _mm512_storeu_si512(out.data() + (mb * KT + k / 16) * 256 + (k % 16) * 16, v);
    }
  }
  return out;
}

// Where x's B tiles are: tile t of block mb at data + mb * block_step + t * tile_step, rows `stride` bytes apart.
// One row of x (a decode step of one sequence) is its own B tile as it is (a column of pairs 4 bytes apart), so it
// is not packed: the same tile contents, without a gather per pair.
struct XTiles {
  const uint32_t* data;
  int64_t block_step, tile_step, stride;
};

XTiles x_tiles(const uint16_t* x, int64_t M, int64_t K, std::vector<uint32_t>& packed) {
  if (M == 1) return {reinterpret_cast<const uint32_t*>(x), 0, 16, 4};
  packed = pack_x(x, M, K);
  return {packed.data(), K / 32 * 256, 256, 64};
}

// A C tile (16 weight rows x 16 rows of x, float) to y's bf16 rows, with the bias: one gather per row of x.
void store(const float* c, const at::BFloat16* bias, at::BFloat16* y, int64_t M, int64_t N, int64_t n0, int64_t m0) {
  if (n0 >= N) return;
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __mmask16 cols = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_maskz_loadu_epi16(cols, bias + n0)), 16)) : _mm512_setzero_ps();
  for (int64_t i = 0; i < 16 && m0 + i < M; ++i) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + i, 4), b);
    _mm256_mask_storeu_epi16(y + (m0 + i) * N + n0, cols, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// bf16 weights [N, K] (N a multiple of 32): A tiles read in place, 16 rows at a stride of K.
struct Bf16Weights {
  const uint16_t* w;
  int64_t K;

  void begin(int64_t, bool) {}
  const uint16_t* tile(int64_t n0, int64_t t) { return w + n0 * K + 32 * t; }
  int64_t block_offset() const { return 16 * K; }  // from weight block 0's tile to block 1's
  int64_t stride() const { return 2 * K; }
};

// A GGUF's blocks (gguf_blocks.h: Q4_1 or Q8_0): weight rows [n0, n0 + 32) dequantized into A tiles (zeros past N).
// With up to 32 rows of x (one pass) each pair of k tiles goes into one of two 4 KB buffers (L1) while the pair
// before it multiplies; with more, the whole block pair is dequantized once and every pair of x blocks reads it.
template <typename Format>
struct BlockWeights {
  const Format& f;
  int64_t N;
  std::vector<uint16_t>& a;
  float* s;  // [32][2 K/32] the 32 rows' scales as float (Format::scales)
  int64_t n0 = 0;
  bool one_pass = true;

  int64_t K() const { return f.K; }
  // Blocks 2p and 2p+1 of the 32 rows into `out`: block g's tile h at out + g * gstride + h * 512.
  void dequantize_pair(int64_t p, uint16_t* out, int64_t gstride) {
    for (int64_t r = 0; r < 32; ++r) {
      uint16_t* row = out + (r / 16) * gstride + (r % 16) * 32;
      __m512bh lo, hi;
      if (n0 + r < N) {
        // the next 32 rows' same bytes
        _mm_prefetch(reinterpret_cast<const char*>(f.bytes(n0 + r, p)) + 32 * f.row_bytes(), _MM_HINT_T0);
        f.pair(n0 + r, p, s + r * 2 * (K() / 32), lo, hi);
      } else {
        lo = hi = (__m512bh)_mm512_setzero_si512();
      }
      _mm512_storeu_si512(row, (__m512i)lo);
      _mm512_storeu_si512(row + 512, (__m512i)hi);
    }
  }
  void begin(int64_t first_row, bool single_pass) {
    n0 = first_row, one_pass = single_pass;
    for (int64_t r = 0; r < 32 && n0 + r < N; ++r) f.scales(n0 + r, s + r * 2 * (K() / 32));
    if (!one_pass)
      for (int64_t p = 0; p < K() / 64; ++p) dequantize_pair(p, a.data() + 2 * p * 512, K() / 32 * 512);
    else
      dequantize_pair(0, a.data(), 2 * 512);
  }
  const uint16_t* tile(int64_t, int64_t t) {
    if (!one_pass) return a.data() + t * 512;
    const int64_t p = t / 2;
    if (t % 2 == 0 && t + 2 < K() / 32) dequantize_pair(p + 1, a.data() + (p + 1) % 2 * 4 * 512, 2 * 512);
    return a.data() + p % 2 * 4 * 512 + t % 2 * 512;
  }
  int64_t block_offset() const { return one_pass ? 2 * 512 : K() / 32 * 512; }
  int64_t stride() const { return 64; }
};

// Weight rows [32 np, 32 np + 32) against x's blocks [mb0, mb1) of 16 rows.
template <typename Weights>
void multiply(Weights& w, const XTiles& xt, const at::BFloat16* bias, at::BFloat16* y, int64_t M,
              int64_t K, int64_t N, int64_t np, int64_t mb0, int64_t mb1) {
  const int64_t KT = K / 32, n0 = np * 32;
  alignas(64) float c[256];
  w.begin(n0, mb1 - mb0 <= 2);
  for (int64_t mb = mb0; mb < mb1; mb += 2) {
    const uint32_t* b0 = xt.data + mb * xt.block_step;
    const uint32_t* b1 = b0 + xt.block_step;
    const bool two = mb + 1 < mb1;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < KT; ++t) {
      const uint16_t* a0 = w.tile(n0, t);
      _tile_loadd(4, a0, w.stride());
      _tile_loadd(5, a0 + w.block_offset(), w.stride());
      _tile_loadd(6, b0 + t * xt.tile_step, xt.stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, b1 + t * xt.tile_step, xt.stride);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c, 64);
    store(c, bias, y, M, N, n0, mb * 16);
    _tile_stored(1, c, 64);
    store(c, bias, y, M, N, n0 + 16, mb * 16);
    if (two) {
      _tile_stored(2, c, 64);
      store(c, bias, y, M, N, n0, (mb + 1) * 16);
      _tile_stored(3, c, 64);
      store(c, bias, y, M, N, n0 + 16, (mb + 1) * 16);
    }
  }
}

// Every weight row pair of [p0, p1) against x, x's rows in chunks of kChunkBlocks blocks: a chunk's B tiles (up to
// 512 rows) stay in L2 while every weight pair passes over them (Q4_1 blocks are dequantized once per chunk).
constexpr int64_t kChunkBlocks = 32;

template <typename Weights>
void multiply_all(Weights& w, const XTiles& xt, const at::BFloat16* bias, at::BFloat16* y, int64_t M,
                  int64_t K, int64_t N, int64_t p0, int64_t p1) {
  const int64_t MB = (M + 15) / 16;
  for (int64_t mb0 = 0; mb0 < MB; mb0 += kChunkBlocks)
    for (int64_t np = p0; np < p1; ++np) multiply(w, xt, bias, y, M, K, N, np, mb0, std::min(MB, mb0 + kChunkBlocks));
}

bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}

at::Tensor bf16_amx_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_amx_linear: bf16 only");
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1), "bf16_amx_linear: shapes");
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0, "bf16_amx_linear: K and N must be multiples of 32");
  TORCH_CHECK(amx_ready(), "bf16_amx_linear: Linux refused this process the AMX tile state");
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  const at::Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<uint32_t> packed;
  const XTiles xt = x_tiles(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), M, K, packed);
  Bf16Weights weights{reinterpret_cast<const uint16_t*>(w.const_data_ptr()), K};
  const at::BFloat16* bp = bias.defined() ? bias.const_data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles(M);
    Bf16Weights mine = weights;
    multiply_all(mine, xt, bp, y.data_ptr<at::BFloat16>(), M, K, N, p0, p1);
    _tile_release();
  });
  return y;
}

template <typename Format>
void block_amx_linear(const uint16_t* x, const Format& f, const at::BFloat16* bias, at::BFloat16* y, int64_t M,
                      int64_t N) {
  TORCH_CHECK(amx_ready(), "GGUF block linear: Linux refused this process the AMX tile state");
  if (M == 0) return;
  const int64_t K = f.K;
  std::vector<uint32_t> packed;
  const XTiles xt = x_tiles(x, M, K, packed);
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles(M);
    thread_local std::vector<uint16_t> a;
    thread_local std::vector<float> scale_buffer;
    a.resize(std::max<int64_t>(2 * K / 32 * 512, 8 * 512));
    scale_buffer.resize(32 * 2 * (K / 32));
    BlockWeights<Format> weights{f, N, a, scale_buffer.data()};
    multiply_all(weights, xt, bias, y, M, K, N, p0, p1);
    _tile_release();
  });
}

}  // namespace

void q4_1_amx_linear(const uint16_t* x, const pagekube_blocks::Q4_1& w, const at::BFloat16* bias, at::BFloat16* y,
                     int64_t M, int64_t N) {
  block_amx_linear(x, w, bias, y, M, N);
}

void q8_0_amx_linear(const uint16_t* x, const pagekube_blocks::Q8_0& w, const at::BFloat16* bias, at::BFloat16* y,
                     int64_t M, int64_t N) {
  block_amx_linear(x, w, bias, y, M, N);
}

}  // namespace pagekube_q4

TORCH_LIBRARY_FRAGMENT(pagekube_cpu, m) { m.def("bf16_amx_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(pagekube_cpu, CPU, m) { m.impl("bf16_amx_linear", &pagekube_q4::bf16_amx_linear); }
