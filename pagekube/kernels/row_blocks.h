// Row blocks for the small-batch linears: f(std::integral_constant<int, MB>{}, m) for rows [m, m + MB) of x, eight
// at a time and then the remainder as one block. MB is a compile-time size, so a kernel's loops over it unroll and
// its MB accumulators stay in registers.
#pragma once
#include <cstdint>
#include <type_traits>

namespace pagekube_rows {

template <int MB, typename F>
void remainder(int64_t rows, int64_t m, F& f) {
  if constexpr (MB > 0) {
    if (rows == MB) return f(std::integral_constant<int, MB>{}, m);
    remainder<MB - 1>(rows, m, f);
  }
}

template <typename F>
void for_row_blocks(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) f(std::integral_constant<int, 8>{}, m);
  remainder<7>(M - m, m, f);
}

}  // namespace pagekube_rows
