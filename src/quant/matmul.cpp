// matmul_rows: many activation rows against a quantized weight matrix, on the thread pool.
//
// Each thread takes a contiguous range of output rows o; within it, activation rows go in tiles of
// kTileRows so one dequantized weight chunk feeds several rows. Every y value is computed by one
// dot_tile call whose arithmetic depends only on (weight row, activation row, n_in), so the result has
// the bits of dot_row whatever M, the tiling or the thread count.
#include <algorithm>

#include "quant/kernels.h"
#include "quant/thread_pool.h"
#include "util/error.h"

namespace dflash {
namespace quant_detail {

void matmul_rows_isa(Isa isa, GgmlType type, const void* W, int64_t n_in, int64_t n_out, const float* x, int64_t M,
                     float* y, ThreadPool* pool_or_null) {
  const TypeTraits* t = type_traits(static_cast<uint32_t>(type));
  DFLASH_CHECK(t != nullptr && t->has_codec, "matmul_rows: type id {} has no codec", static_cast<uint32_t>(type));
  DFLASH_CHECK(n_in >= 0 && n_in % t->block_elems == 0,
               "matmul_rows: row of {} elements is not a multiple of the {} block size {}", n_in, t->name,
               t->block_elems);
  DFLASH_CHECK(n_out >= 0 && M >= 0, "matmul_rows: negative shape n_out={} M={}", n_out, M);
  if (n_out == 0 || M == 0) return;
  const size_t rb = row_bytes(type, n_in);
  const uint8_t* w = static_cast<const uint8_t*>(W);
  ThreadPool& pool = pool_or_null != nullptr ? *pool_or_null : ThreadPool::global();
  // Ranges of output rows: enough of them to balance the threads, none so small that the hand-out costs.
  const int64_t grain = std::max<int64_t>(4, (n_out + 8 * pool.size() - 1) / (8 * pool.size()));
  pool.parallel_for(n_out, grain, [&](int64_t o_begin, int64_t o_end) {
    float out[kTileRows];
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      for (int64_t o = o_begin; o < o_end; ++o) {
        dot_tile(isa, type, w + o * rb, n_in, x + m0 * n_in, n_in, rows, out);
        for (int r = 0; r < rows; ++r) y[(m0 + r) * n_out + o] = out[r];
      }
    }
  });
}

}  // namespace quant_detail

void matmul_rows(GgmlType type, const void* W, int64_t n_in, int64_t n_out, const float* x, int64_t M, float* y) {
  quant_detail::matmul_rows_isa(quant_detail::default_isa(), type, W, n_in, n_out, x, M, y);
}

}  // namespace dflash
