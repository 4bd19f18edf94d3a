// CPU backend: memory, linear algebra, norms, elementwise ops, Hadamard and sampling helpers.
#include "ops/cpu/cpu_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "ops/cpu/kernels.h"
#include "prism/hadamard.h"
#include "quant/xq_emulation.h"
#include "util/error.h"

namespace dflash {

std::unique_ptr<Backend> make_cpu_backend(int n_threads) { return std::make_unique<cpu::CpuBackend>(n_threads); }

namespace cpu {

// Elementwise ops split into ranges of at most this many elements (small enough to spread a hidden-state
// row over threads, large enough that the dispatch costs little).
constexpr int64_t kElemGrain = 16384;

CpuBackend::CpuBackend(int n_threads)
    : own_pool_(n_threads > 0 ? std::make_unique<ThreadPool>(n_threads) : nullptr),
      pool_(own_pool_ ? *own_pool_ : ThreadPool::global()) {}

std::string CpuBackend::name() const { return fmt::format("cpu ({} threads)", pool_.size()); }

// ---- memory ---------------------------------------------------------------------------------------

void* CpuBackend::alloc(size_t bytes) {
  constexpr size_t kAlign = 64;
  const size_t padded = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  void* p = std::aligned_alloc(kAlign, padded);
  DFLASH_CHECK(p != nullptr, "cpu backend: out of memory allocating {} bytes", bytes);
  std::memset(p, 0, padded);
  return p;
}

void CpuBackend::release(void* ptr) { std::free(ptr); }

void CpuBackend::upload(void* dst, const void* host_src, size_t bytes) {
  if (bytes) std::memcpy(dst, host_src, bytes);
}

void CpuBackend::download(void* host_dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(host_dst, src, bytes);
}

void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

void CpuBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

// The file's bytes stay where they are (the GGUF mapping): the CPU reads weights in place.
WeightRef CpuBackend::upload_weight(const void* host_data, GgmlType type, int64_t in, int64_t out) {
  DFLASH_CHECK(host_data != nullptr, "cpu backend: upload_weight of a null pointer ({} x {} {})", out, in,
               type_name(type));
  DFLASH_CHECK(in > 0 && out > 0, "cpu backend: upload_weight with shape [{}, {}]", in, out);
  DFLASH_CHECK(type_traits(type).has_codec, "cpu backend: no codec for weight type {}", type_name(type));
  WeightRef w;
  w.data = host_data;
  w.type = type;
  w.in = in;
  w.out = out;
  w.row_bytes = row_bytes(type, in);
  return w;
}

// ---- linear algebra -------------------------------------------------------------------------------

// quant's matmul_rows: parallel over output columns, y[m][o] = dot_row(w_o, x_m) with the bits of a
// single dot_row call whatever M, the split or the thread count.
void CpuBackend::matmul(const WeightRef& w, const float* x, float* y, int64_t M) {
  DFLASH_CHECK(w.valid(), "cpu matmul: invalid weight");
  // DFLASH_CPU_XQ_PLANES=2 / 3 (a precision study; off by default, the CPU stays the fp32 reference): the
  // inputs of the weight types that the CUDA backend feeds to its integer tensor cores (ternary, Q4_K,
  // Q6_K) are rounded as that backend's activation records round them (quant/xq_emulation.h).
  static const int xq_planes = cpu_xq_planes_from_env();
  if (xq_planes != 0 && xq_rounded_type(w.type) && w.in % 128 == 0) {
    std::vector<float> xr(static_cast<size_t>(M * w.in));
    round_to_xq_planes(x, xr.data(), M * w.in, xq_planes);
    matmul_rows(w.type, w.data, w.in, w.out, xr.data(), M, y);
    return;
  }
  matmul_rows(w.type, w.data, w.in, w.out, x, M, y);
}

void CpuBackend::get_rows(const WeightRef& w, const int32_t* ids, float* y, int64_t M) {
  DFLASH_CHECK(w.valid(), "cpu get_rows: invalid weight");
  for (int64_t m = 0; m < M; ++m)
    DFLASH_CHECK(ids[m] >= 0 && ids[m] < w.out, "cpu get_rows: id {} at row {} outside [0, {})", ids[m], m, w.out);
  const auto* base = static_cast<const uint8_t*>(w.data);
  pool_.parallel_for(M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      dequantize_row(w.type, base + static_cast<size_t>(ids[m]) * w.row_bytes, y + m * w.in, w.in);
  });
}

// ---- normalisation --------------------------------------------------------------------------------

void CpuBackend::rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  pool_.parallel_for(rows, std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      float* yr = y + r * n;
      const float inv = 1.0f / std::sqrt(sum_sq_f32(xr, n) / static_cast<float>(n) + eps);
      if (w)
        for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
      else
        for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv;
    }
  });
}

void CpuBackend::l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, float scale) {
  pool_.parallel_for(rows, std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      float* yr = y + r * n;
      const float inv = 1.0f / std::sqrt(sum_sq_f32(xr, n) + eps);
      for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * scale;
    }
  });
}

void CpuBackend::rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t rows, int64_t n,
                                float eps) {
  pool_.parallel_for(rows, std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      const float* zr = z + r * n;
      float* yr = y + r * n;
      const float inv = 1.0f / std::sqrt(sum_sq_f32(xr, n) / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i] * silu(zr[i]);
    }
  });
}

// ---- elementwise ----------------------------------------------------------------------------------

void CpuBackend::add(const float* a, const float* b, float* y, int64_t n) {
  pool_.parallel_for(n, kElemGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = a[i] + b[i];
  });
}

void CpuBackend::swiglu(const float* gate, const float* up, float* y, int64_t n) {
  pool_.parallel_for(n, kElemGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = silu(gate[i]) * up[i];
  });
}

void CpuBackend::mul_sigmoid(const float* x, const float* gate, float* y, int64_t n) {
  pool_.parallel_for(n, kElemGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = x[i] * sigmoid(gate[i]);
  });
}

void CpuBackend::copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                           int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    std::memmove(dst + r * dst_stride, src + r * src_stride, static_cast<size_t>(cols) * sizeof(float));
}

void CpuBackend::scatter_rows(float* dst, int64_t dst_stride, int64_t dst_rows, const int32_t* idx, const float* src,
                              int64_t src_stride, int64_t M, int64_t cols) {
  for (int64_t m = 0; m < M; ++m) {
    DFLASH_CHECK(idx[m] >= 0 && idx[m] < dst_rows, "cpu scatter_rows: row {} goes to index {}, outside 0..{}", m,
                 idx[m], dst_rows - 1);
    std::memmove(dst + idx[m] * dst_stride, src + m * src_stride, static_cast<size_t>(cols) * sizeof(float));
  }
}

// ---- prism Hadamard -------------------------------------------------------------------------------

// The permutation belongs to the forward direction only (ssm_out's input); an inverse with a
// permutation is a caller bug.
void CpuBackend::hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                          int64_t block, bool inverse) {
  DFLASH_CHECK(!(inverse && perm), "cpu hadamard: a permutation is only defined for the forward transform");
  pool_.parallel_for(rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (inverse)
        prism::hadamard_inverse_row(x + r * n, signs, y + r * n, n, block);
      else
        prism::hadamard_forward_row(x + r * n, signs, perm, y + r * n, n, block);
    }
  });
}

// ---- sampling helpers -----------------------------------------------------------------------------

void CpuBackend::argmax(const float* x, int32_t* ids, int64_t M, int64_t n) {
  DFLASH_CHECK(n > 0, "cpu argmax: empty rows");
  pool_.parallel_for(M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * n;
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i)
        if (xr[i] > xr[best]) best = i;  // strict: the lowest index wins a tie
      ids[m] = static_cast<int32_t>(best);
    }
  });
}

void CpuBackend::top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k) {
  DFLASH_CHECK(k > 0 && k <= n, "cpu top_k: k = {} outside [1, {}]", k, n);
  pool_.parallel_for(M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<int32_t> idx(static_cast<size_t>(n));
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * n;
      std::iota(idx.begin(), idx.end(), 0);
      // Larger value first; equal values by lower index (a strict weak order, so the result is unique).
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [xr](int32_t a, int32_t b) {
        return xr[a] > xr[b] || (xr[a] == xr[b] && a < b);
      });
      for (int64_t j = 0; j < k; ++j) {
        ids[m * k + j] = idx[j];
        vals[m * k + j] = xr[idx[j]];
      }
    }
  });
}

}  // namespace cpu
}  // namespace dflash
