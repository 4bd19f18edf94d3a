// The CPU reference backend (see ops/backend.h for each op's contract).
//
// fp32 math on quant's thread pool (parallel over output columns, heads or rows, never inside a
// reduction). Each output row is computed from that row's inputs with a reduction
// order fixed by the op's sizes, so M rows at once give the same bits as M calls of one row.
// The ops are split over files by family: cpu_backend.cpp (memory, linear algebra, norms,
// elementwise, hadamard, sampling), cpu_attention.cpp (rope, attention), cpu_gdn.cpp (Gated DeltaNet).
#pragma once

#include <memory>

#include "ops/backend.h"
#include "quant/thread_pool.h"

namespace dflash::cpu {

class CpuBackend final : public Backend {
 public:
  // n_threads <= 0: share the process-wide pool (DFLASH_THREADS or all cores); else a private pool of
  // that many threads for the non-matmul ops. matmul always runs on quant's matmul_rows (global pool).
  explicit CpuBackend(int n_threads);
  std::string name() const override;

  void* alloc(size_t bytes) override;
  void release(void* ptr) override;
  void upload(void* dst, const void* host_src, size_t bytes) override;
  void download(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}
  WeightRef upload_weight(const void* host_data, GgmlType type, int64_t in, int64_t out) override;

  void matmul(const WeightRef& w, const float* x, float* y, int64_t M) override;
  void get_rows(const WeightRef& w, const int32_t* ids, float* y, int64_t M) override;

  void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) override;
  void l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, float scale) override;
  void rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t rows, int64_t n,
                      float eps) override;

  void add(const float* a, const float* b, float* y, int64_t n) override;
  void swiglu(const float* gate, const float* up, float* y, int64_t n) override;
  void mul_sigmoid(const float* x, const float* gate, float* y, int64_t n) override;
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                 int64_t cols) override;
  void scatter_rows(float* dst, int64_t dst_stride, int64_t dst_rows, const int32_t* idx, const float* src,
                    int64_t src_stride, int64_t M, int64_t cols) override;

  void hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n, int64_t block,
                bool inverse) override;

  void rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                 float theta) override;
  void attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out, int64_t M,
                 int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) override;

  void gdn_conv(const float* x, float* state, float* state_before, const float* w, float* y, int64_t M, int64_t C,
                int64_t K) override;
  void gdn_gates(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M,
                 int64_t n_v_heads) override;
  void gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const float* state_in, float* state, float* out, float* snapshots, int64_t M, const GdnShape& shape) override;
  void gdn_prepare_recurrent(const GdnRawInputs& in, float* state, float* out, const GdnPrepared* prepared,
                             int64_t M, const GdnShape& shape) override;
  void gdn_apply_rows_batch(std::span<const GdnApplyJob> jobs, int64_t M, const GdnShape& shape) override;
  void gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                   float* state, float* out, int64_t M, const GdnShape& shape) override;

  void argmax(const float* x, int32_t* ids, int64_t M, int64_t n) override;
  void top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k) override;

  // cpu_dflash.cpp
  void dflash_conv(const float* x, const float* base, const float* d, int64_t d_stride, const float* res, float* y,
                   int64_t M, int64_t C, int64_t K, int64_t group) override;
  void selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary, const float* g,
                     int32_t* out, int64_t rows, int64_t top_k, int64_t rank) override;

  ThreadPool& pool() { return pool_; }

 private:
  // gdn_recurrent in place on `state`; deltas: null, or [M, Hv, head_v] receives each row's update.
  void recurrence(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                  float* out, float* snapshots, float* deltas, int64_t M, const GdnShape& shape);

  std::unique_ptr<ThreadPool> own_pool_;
  ThreadPool& pool_;
};

}  // namespace dflash::cpu
