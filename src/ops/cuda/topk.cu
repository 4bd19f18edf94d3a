// argmax and top-k over long rows (the 248320-entry vocabulary).
//
// argmax: blocks scan chunks of a row; a block's best (value, lowest index) becomes a 64-bit key
// (order-preserving value bits << 32 | ~index) and atomicMax merges the blocks. A max is exact, so the
// result does not depend on the order in which blocks finish. NaN is treated as the smallest value
// (the CPU reference skips NaN unless it sits at index 0) and -0 as +0.
//
// top_k: rounds of "sort chunks of 4096 (value, index) pairs in shared memory by a bitonic network and
// keep each chunk's first k" until one chunk per row remains. The order is total (larger value first,
// then lower index), so the result is exact: the CPU's ids and values. NaN is sorted as -inf.
//
// top_k for k <= kSmallK (the drafter's k = 16 over 7 x 248320): warp selection instead of sorting.
// A warp holds a chunk of kWarpChunk = 2048 keys of a row in registers (64 per lane; lane l holding
// positions l, l + 32, .. in the first round, 64 l .. 64 l + 63 in later ones: slot_rel) as 32-bit
// order-preserving keys (NaN as -inf, -0 as +0, 0 = empty/taken),
// and extracts its k best by k rounds of: warp max of the lanes' best keys, then the lowest position
// among the lanes holding that key (two redux ops), the winner lane emits it, marks it taken and
// rescans its 64 keys (the fallback below). The candidates [rows][chunks][k] keep the chunk's order, so among equal keys a lower
// candidate position means a lower row index, and the next round selects over them the same way
// (position tie-break, index looked up) until one chunk per row remains; that round writes ids and
// the row's values (NaN as -inf, -0 kept, like the sort path). A chunk with fewer than k real keys
// emits empty (key 0) candidates, which never reach the output since every row has n >= k real keys.
//
// The round-by-round selection is a serial chain: each round waits for the winner lane's rescan of its 64
// keys while the other 31 lanes idle (k = 16: ~1 us per round, so ~15 us per launch for the drafter's 7
// rows on the H200, S24-3). A warp first tries a threshold instead: the k-th largest of the 32 lanes'
// maxima, T, is a lower bound of the chunk's k-th key (k distinct keys are >= T, so a key below T has k
// better ones), and few keys reach it (~20 of 2048 for logits at k = 16). The lanes mark their keys >= T
// at once, the warp gathers them (positions through shared memory, keys read again) and sorts them by a
// bitonic network on (key, ~position): the first k are the chunk's top k in the same total order. When
// fewer than k lanes hold a real key (T = 0) or more than 64 keys reach T (ties at the top), the warp
// runs the round-by-round selection instead. Either way the same candidates come out.
#include <cfloat>
#include <climits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

constexpr int kArgmaxChunk = 8192;
constexpr int kSortN = 4096;
constexpr int kSortThreads = 512;

__device__ __forceinline__ uint32_t ordered_bits(float f) {
  if (f != f) return 0u;   // NaN: below everything
  if (f == 0.0f) f = 0.0f;  // -0 == +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void argmax_kernel(const float* __restrict__ x, unsigned long long* __restrict__ best, int64_t n) {
  pdl_wait();
  const int64_t m = blockIdx.y;
  const float* xr = x + m * n;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kArgmaxChunk;
  const int64_t c1 = c0 + kArgmaxChunk < n ? c0 + kArgmaxChunk : n;
  unsigned long long key = 0;
  for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
    const unsigned long long kk =
        (static_cast<unsigned long long>(ordered_bits(xr[i])) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    key = kk > key ? kk : key;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
    key = other > key ? other : key;
  }
  __shared__ unsigned long long sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) key = sh[w] > key ? sh[w] : key;
    atomicMax(best + m, key);
  }
}

__global__ void argmax_finish_kernel(const unsigned long long* __restrict__ best, int32_t* ids, int64_t M) {
  pdl_wait();
  const int64_t m = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (m < M) ids[m] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(best[m] & 0xffffffffu));
}

struct Entry {
  float v;
  int32_t i;
};

__device__ __forceinline__ bool before(const Entry& a, const Entry& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// One block sorts chunk blockIdx.x of row blockIdx.y (count entries of the row; src_idx null means the
// index is the position) and writes its first k entries to dst [rows][n_chunks][k].
__global__ void __launch_bounds__(kSortThreads)
topk_chunk_kernel(const float* __restrict__ src_v, const int32_t* __restrict__ src_i, int64_t count,
                  int64_t row_stride, float* __restrict__ dst_v, int32_t* __restrict__ dst_i, int k, int n_chunks) {
  pdl_wait();
  __shared__ Entry a[kSortN];
  const int64_t m = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kSortN;
  for (int t = threadIdx.x; t < kSortN; t += blockDim.x) {
    const int64_t g = c0 + t;
    Entry e{-INFINITY, INT_MAX};
    if (g < count) {
      float v = src_v[m * row_stride + g];
      if (v != v) v = -INFINITY;
      e.v = v;
      e.i = src_i ? src_i[m * row_stride + g] : static_cast<int32_t>(g);
    }
    a[t] = e;
  }
  __syncthreads();
  for (int size = 2; size <= kSortN; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < kSortN; t += blockDim.x) {
        const int u = t ^ stride;
        if (u > t) {
          const bool first_half = (t & size) == 0;
          const Entry x = a[t], y = a[u];
          const bool swap = first_half ? before(y, x) : before(x, y);
          if (swap) {
            a[t] = y;
            a[u] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    const int64_t o = (m * n_chunks + blockIdx.x) * k + t;
    dst_v[o] = a[t].v;
    dst_i[o] = a[t].i;
  }
}

constexpr int kSmallK = 32;
constexpr int kLanePer = 64;                 // keys per lane
constexpr int kWarpChunk = 32 * kLanePer;    // keys per warp chunk
constexpr int kSelWarps = 4;                 // warps (chunks) per block

// Order-preserving key of a value for the selection path: NaN as -inf, -0 as +0. Every value maps to
// >= 0x007fffff (-inf), so 0 marks an empty or already-taken slot.
__device__ __forceinline__ uint32_t select_key(float f) {
  if (f != f) f = -INFINITY;
  return ordered_bits(f);
}

// One level of the lane's max tree: slot j keeps the better of slots 2j and 2j + 1 (the left on ties).
// The levels are separate instantiations so that every index is a constant (a loop over the level
// size was left rolled, and the arrays went to local memory).
template <int S>
__device__ __forceinline__ void tree_level(uint32_t (&tk)[kLanePer / 2], int (&tj)[kLanePer / 2]) {
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const bool r = tk[2 * j + 1] > tk[2 * j];
    tk[j] = r ? tk[2 * j + 1] : tk[2 * j];
    tj[j] = r ? tj[2 * j + 1] : tj[2 * j];
  }
}

// The lane's best key among the slots not yet taken (bit j of taken) and its slot (the lowest slot
// among equal keys: pairs of adjacent ranges, the left one kept on ties). A tree keeps the dependent
// chain at log2(64) steps. The keys are never written after the load: a store to v[slot] would be
// turned back into dynamic indexing and move v to local memory.
__device__ __forceinline__ void lane_best(const uint32_t (&v)[kLanePer], uint64_t taken, uint32_t& bk, int& bj) {
  static_assert(kLanePer == 64, "taken is a 64-bit mask");
  uint32_t tk[kLanePer / 2];
  int tj[kLanePer / 2];
#pragma unroll
  for (int j = 0; j < kLanePer / 2; ++j) {
    const uint32_t a = (taken >> (2 * j)) & 1 ? 0u : v[2 * j];
    const uint32_t b = (taken >> (2 * j + 1)) & 1 ? 0u : v[2 * j + 1];
    const bool r = b > a;
    tk[j] = r ? b : a;
    tj[j] = r ? 2 * j + 1 : 2 * j;
  }
  tree_level<16>(tk, tj);
  tree_level<8>(tk, tj);
  tree_level<4>(tk, tj);
  tree_level<2>(tk, tj);
  tree_level<1>(tk, tj);
  bk = tk[0];
  bj = tj[0];
}

constexpr int kFastCap = 64;  // keys >= T the threshold path sorts (2 per lane); more: the rounds

// A key and its position as one value ordered like the selection: larger key first, then lower position.
// Real keys are >= 0x007fffff, so 0 is an empty slot that sorts last.
__device__ __forceinline__ uint64_t select_composite(uint32_t key, uint32_t pos) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~pos);
}

// Bitonic sort into descending order of the warp's kN (32 or 64) values: element e = 32 h + lane is c[h]
// of that lane. Partners at distance < 32 are other lanes (shuffles), at 32 the lane's other element.
template <int kN>
__device__ __forceinline__ void warp_sort_desc(uint64_t (&c)[kN / 32], int lane) {
  static_assert(kN == 32 || kN == 64, "one or two values per lane");
#pragma unroll
  for (int size = 2; size <= kN; size <<= 1) {
#pragma unroll
    for (int d = size >> 1; d > 0; d >>= 1) {
      if (d == 32) {  // (kN = 64, size = 64: the last merge, descending): the lane's pair in order
        if (c[0] < c[1]) {
          const uint64_t t = c[0];
          c[0] = c[1];
          c[1] = t;
        }
        continue;
      }
#pragma unroll
      for (int h = 0; h < kN / 32; ++h) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, c[h], d);
        const int e = 32 * h + lane;
        const bool lower = (e & d) == 0, desc = (e & size) == 0;
        const bool keep_max = lower == desc;
        c[h] = keep_max ? (other > c[h] ? other : c[h]) : (other < c[h] ? other : c[h]);
      }
    }
  }
}

// Chunk-relative position of slot j of a lane. The first round reads the row striped (lane + 32 j: coalesced;
// the logits' order is the vocabulary's, so the lanes' maxima spread). The later rounds read candidates
// [chunks][k], each chunk's best first: striped, lanes l and l + 16 would hold every chunk's best (k = 16)
// and the threshold would be a rank-8 key that ~100 keys reach. Blocked (64 consecutive per lane) a lane
// holds whole chunks, and its maximum is the best of 4 chunks'. Ties go by position either way.
template <bool kFromX>
__device__ __forceinline__ uint32_t slot_rel(int lane, int j) {
  return kFromX ? static_cast<uint32_t>(j) * 32u + static_cast<uint32_t>(lane)
                : static_cast<uint32_t>(lane) * kLanePer + static_cast<uint32_t>(j);
}

// One warp selects the k best of chunk (blockIdx.x * kSelWarps + warp) of row blockIdx.y. Sources:
// kFromX: the row x[m * n + ..] itself (count = row_stride = n); else candidates src_k / src_i
// [rows][row_stride] with count valid per row. Outputs: ids non-null (the last round, one chunk per row):
// ids / vals [rows][k] with vals read back from x; else candidates dst_k / dst_i [rows][n_chunks][k].
template <bool kFromX>
__global__ void __launch_bounds__(kSelWarps * 32)
topk_select_kernel(const float* __restrict__ x, int64_t n, const uint32_t* __restrict__ src_k,
                   const int32_t* __restrict__ src_i, int64_t count, int64_t row_stride, uint32_t* __restrict__ dst_k,
                   int32_t* __restrict__ dst_i, int32_t* __restrict__ ids, float* __restrict__ vals, int k,
                   int n_chunks) {
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int chunk = static_cast<int>(blockIdx.x) * kSelWarps + static_cast<int>(threadIdx.x >> 5);
  if (chunk >= n_chunks) return;  // the whole warp leaves together
  const int64_t m = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(chunk) * kWarpChunk;
  uint32_t v[kLanePer];
#pragma unroll
  for (int j = 0; j < kLanePer; ++j) {
    const int64_t g = c0 + slot_rel<kFromX>(lane, j);
    uint32_t key = 0;
    if (g < count) key = kFromX ? select_key(x[m * n + g]) : src_k[m * row_stride + g];
    v[j] = key;
  }
  uint64_t taken = 0;
  uint32_t bk;
  int bj;
  lane_best(v, taken, bk, bj);
  // Positions stay below 2^32 - 1: count <= INT32_MAX (the backend checks n), plus one chunk of padding.
  const uint32_t base = static_cast<uint32_t>(c0);
  // The r-th best of the chunk (key wk at position wp): the row's output at the last round, else the
  // next round's candidate. Positions past count (padding) give id -1.
  const auto emit = [&](int r, uint32_t wk, uint32_t wp) {
    int32_t idx = -1;
    if (wp < count) idx = kFromX ? static_cast<int32_t>(wp) : src_i[m * row_stride + wp];
    if (ids) {
      ids[m * k + r] = idx;
      const float f = idx >= 0 ? x[m * n + idx] : -INFINITY;
      vals[m * k + r] = f != f ? -INFINITY : f;
    } else {
      const int64_t o = (m * n_chunks + chunk) * k + r;
      dst_k[o] = wk;
      dst_i[o] = idx;
    }
  };

  // The threshold path (the file's header): T = the k-th largest lane maximum.
  __shared__ uint32_t cand_rel[kSelWarps][kFastCap];  // chunk-relative positions of the keys >= T
  uint64_t lane_max[1] = {static_cast<uint64_t>(bk)};
  warp_sort_desc<32>(lane_max, lane);
  const uint32_t T = static_cast<uint32_t>(__shfl_sync(0xffffffffu, lane_max[0], k - 1));
  if (T != 0) {
    uint64_t mask = 0;  // bit j: slot j holds a key >= T
#pragma unroll
    for (int j = 0; j < kLanePer; ++j) mask |= static_cast<uint64_t>(v[j] >= T) << j;
    const int mine = __popcll(mask);
    int incl = mine;  // inclusive prefix sum of the lanes' counts
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    if (total <= kFastCap) {  // warp-uniform
      uint32_t* rel = cand_rel[threadIdx.x >> 5];
      for (int off = incl - mine; mask != 0; ++off) {
        const int j = __ffsll(static_cast<long long>(mask)) - 1;
        mask &= mask - 1;
        rel[off] = slot_rel<kFromX>(lane, j);
      }
      __syncwarp();
      uint64_t c[2] = {0, 0};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 32 * h + lane;
        if (e < total) {  // read the key again (the registers cannot be indexed by a run-time slot)
          const uint32_t p = static_cast<uint32_t>(c0) + rel[e];
          const uint32_t key = kFromX ? select_key(x[m * n + p]) : src_k[m * row_stride + p];
          c[h] = select_composite(key, p);
        }
      }
      if (total <= 32) {
        uint64_t c1[1] = {c[0]};
        warp_sort_desc<32>(c1, lane);
        c[0] = c1[0];
      } else {
        warp_sort_desc<64>(c, lane);
      }
      // lane r emits the r-th best (total >= k: k lanes' maxima are >= T)
      if (lane < k) emit(lane, static_cast<uint32_t>(c[0] >> 32), ~static_cast<uint32_t>(c[0]));
      return;
    }
  }
  // The rounds (the fallback): ties at the top, or fewer than k lanes with a real key.
  for (int r = 0; r < k; ++r) {
    const uint32_t wk = __reduce_max_sync(0xffffffffu, bk);
    const uint32_t cand = bk == wk ? base + slot_rel<kFromX>(lane, bj) : 0xffffffffu;
    const uint32_t wp = __reduce_min_sync(0xffffffffu, cand);
    if (cand == wp) {  // exactly one lane: positions are distinct
      emit(r, wk, wp);
      taken |= 1ull << bj;
      lane_best(v, taken, bk, bj);
    }
  }
}

void launch_top_k_small(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k, void* scratch,
                        cudaStream_t s) {
  const int64_t max_chunks = (n + kWarpChunk - 1) / kWarpChunk;
  const size_t cap = static_cast<size_t>(M) * max_chunks * k;
  uint32_t* bk[2];
  int32_t* bi[2];
  char* p = static_cast<char*>(scratch);
  bk[0] = reinterpret_cast<uint32_t*>(p);
  bi[0] = reinterpret_cast<int32_t*>(p + cap * 4);
  bk[1] = reinterpret_cast<uint32_t*>(p + cap * 8);
  bi[1] = reinterpret_cast<int32_t*>(p + cap * 12);
  const uint32_t* cur_k = nullptr;
  const int32_t* cur_i = nullptr;
  int64_t count = n;
  int which = 0;
  while (true) {
    // count shrinks each round: ceil(count / 2048) * k < count while count > 2048 (k <= 32).
    const int64_t chunks = (count + kWarpChunk - 1) / kWarpChunk;
    const bool last = chunks == 1;
    uint32_t* dk = last ? nullptr : bk[which];
    int32_t* di = last ? nullptr : bi[which];
    int32_t* oi = last ? ids : nullptr;
    float* ov = last ? vals : nullptr;
    const dim3 grid(ceil_div_u(chunks, kSelWarps), static_cast<unsigned>(M));
    if (cur_k == nullptr)
      launch_pdl(topk_select_kernel<true>, grid, kSelWarps * 32, 0, s, x, n, cur_k, cur_i, count, count, dk, di, oi,
                 ov, static_cast<int>(k), static_cast<int>(chunks));
    else
      launch_pdl(topk_select_kernel<false>, grid, kSelWarps * 32, 0, s, x, n, cur_k, cur_i, count, count, dk, di,
                 oi, ov, static_cast<int>(k), static_cast<int>(chunks));
    if (last) break;
    cur_k = bk[which];
    cur_i = bi[which];
    count = chunks * k;
    which ^= 1;
  }
}

}  // namespace

size_t argmax_scratch_bytes(int64_t M) { return static_cast<size_t>(M) * sizeof(unsigned long long); }

void launch_argmax(const float* x, int32_t* ids, int64_t M, int64_t n, void* scratch, cudaStream_t s) {
  if (M <= 0) return;
  auto* best = static_cast<unsigned long long*>(scratch);
  cudaMemsetAsync(best, 0, argmax_scratch_bytes(M), s);
  launch_pdl(argmax_kernel, dim3(ceil_div_u(n, kArgmaxChunk), static_cast<unsigned>(M)), 256, 0, s, x, best, n);
  launch_pdl(argmax_finish_kernel, ceil_div_u(M, 128), 128, 0, s, best, ids, M);
}

// Two ping-pong candidate buffers of M * ceil(n / kSortN) * k entries each.
// (k <= kSmallK: the same of M * ceil(n / kWarpChunk) * k (key, index) entries each.)
size_t topk_scratch_bytes(int64_t M, int64_t n, int64_t k) {
  const int64_t per = k <= kSmallK ? kWarpChunk : kSortN;
  const int64_t chunks = (n + per - 1) / per;
  return 2 * static_cast<size_t>(M) * chunks * k * (sizeof(float) + sizeof(int32_t)) + 256;
}

void launch_top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k, void* scratch,
                  cudaStream_t s) {
  if (M <= 0) return;
  if (k <= kSmallK) {
    launch_top_k_small(x, ids, vals, M, n, k, scratch, s);
    return;
  }
  const int64_t max_chunks = (n + kSortN - 1) / kSortN;
  const size_t cap = static_cast<size_t>(M) * max_chunks * k;
  float* bv[2];
  int32_t* bi[2];
  char* p = static_cast<char*>(scratch);
  bv[0] = reinterpret_cast<float*>(p);
  bi[0] = reinterpret_cast<int32_t*>(p + cap * 4);
  bv[1] = reinterpret_cast<float*>(p + cap * 8);
  bi[1] = reinterpret_cast<int32_t*>(p + cap * 12);
  const float* cur_v = x;
  const int32_t* cur_i = nullptr;
  int64_t count = n, stride = n;
  int which = 0;
  while (true) {
    const int64_t chunks = (count + kSortN - 1) / kSortN;
    const bool last = chunks == 1;
    float* dv = last ? vals : bv[which];
    int32_t* di = last ? ids : bi[which];
    launch_pdl(topk_chunk_kernel, dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(M)), kSortThreads, 0, s, 
        cur_v, cur_i, count, stride, dv, di, static_cast<int>(k), static_cast<int>(chunks));
    if (last) break;
    cur_v = bv[which];
    cur_i = bi[which];
    count = chunks * k;
    stride = chunks * k;
    which ^= 1;
  }
}

}  // namespace dflash::cuda
