// Prefill matmul (Backend::matmul_prefill): y[M, out] = x[M, in] . W^T for M >= 32 activation rows on
// the tensor cores (bf16 inputs, fp32 accumulators; on Hopper warpgroup mma (wgmma), elsewhere
// mma.sync m16n8k16: both kernels below), for the ternary weights in the
// kTernaryMma layout (PQ2_0, PTQ1_0; matmul_ternary.cu). Other weights return false and the caller runs
// the GEMV tiles: the planar 2-bit layout (its lane-interleaved code order would need a permuted
// activation tile; not written yet) and the block formats (their dequantizers live in matmul.cu's
// anonymous namespace).
//
// Orientation: the weight is the mma's A operand (16 weight rows per mma, exactly the layout's tiles:
// lane (g, t) finds its A codes of rows g and g + 8 in words 2t + (step / 4) of the row block), the
// activations are B (8 activation rows per mma, k-contiguous rows = the "col" B fragment).
//
// The layout is cut for mma.m16n8k32 (integer): in k16 step s (0..7) of a block of 128, lane-quad
// position t holds the 4 codes of k = 16 s + 4t .. 4t + 3 (register q = s % 4 of word 2t + s / 4,
// bytes e = 0..3; matmul_ternary.cu). The bf16 m16n8k16 wants k 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9
// (a2, a3) from lane t instead. The mma sums over k, so any permutation of k applied to both operands
// gives the same product: within each 16-wide k group, actual k 4t + e plays the mma's k 2t + e / 2
// (e = 0, 2) or 8 + 2t + (e - 1) / 2 (e = 1, 3). Bytes 0 and 2 of a word are 16 bits apart, like the
// two halves of a bf16x2, so the codes of register q of bytes 0, 2 (bits 2q, 16 + 2q) become a0 / a1
// with one shift and mask, and those of bytes 1, 3 (bits 2q + 8, 24 + 2q) a2 / a3: no byte shuffling,
// the same 4 instructions per A register as an f16-pair layout. The activation tile is staged in the
// permuted order instead: inputs 0, 2 of a float4 go to one 4-byte piece of the bf16 row, 1, 3 to
// another (8 bf16 further on); the ldmatrix fragments then match.
//
// Arithmetic (why ~5.5e-6 NMSE from the fp32 reference, not bit-exact; measured 5.4e-6 .. 5.9e-6):
//   - activations rounded fp32 -> bf16 (nearest even, 8 significant bits): relative error <= 2^-8;
//   - weights (c - 1) * bf16(d): the fp16 scale rounded to bf16 (relative error <= 2^-8, shared by the
//     128 weights of a block), the product exact (c - 1 is -1, 0 or 1);
//   - products and sums in fp32 (mma accumulators). With a k split, the split partial tiles are added
//     in rank order through distributed shared memory (fixed order: a result depends on the data, M and
//     the shapes only; no float atomics).
// Codes become bf16 without tables: 0x4300 | c is the bf16 128 + c, minus 129 is exactly c - 1.
//
// Tiling. A CTA of 4 warps computes a BO x BX tile (weight rows x activation rows): WO x WX warps of
// 64 x 64 (4 x 8 mma tiles, 128 fp32 accumulators per thread); (WO, WX) = (2, 2): 128 x 128, or (4, 1):
// 256 x 64 (M <= 64 and other M that pad fewer rows with 64). K goes in k-tiles of 32 (2 mma k-steps).
// Per k-tile each thread loads (one k-tile ahead, in registers) its share of the activation tile
// (16-byte loads, BX x 32 fp32) and, per warp, the A code words of its 4 weight tiles (+ the block's
// scales); the activations go to a double-buffered bf16 shared tile (64-byte rows, 16-byte pieces
// XOR-swizzled by (row / 2) % 4: conflict-free ldmatrix); one __syncthreads per k-tile. The weights go
// from registers straight into the mma (each warp unpacks its own; warps sharing weight rows hit L1).
//
// Split-K: when the tiles leave SMs idle, S in {2, 4, 8} CTAs of a thread-block cluster take equal
// shares of the k-tiles; each leaves its fp32 tile in shared memory, and CTA r adds activation rows
// [r BX / S, (r + 1) BX / S) of the S tiles in rank order and stores them.
//
// Hopper (compute capability 9.x, the sm_90a build): gemm_ternary_wgmma_kernel below, with the same
// arithmetic (bf16 activations, (c - 1) bf16(d) weights, fp32 sums; the same NMSE) but wgmma.m64nNk16
// with the weights as the register A operand: 256 weight rows x 64 or 128 activation rows per CTA of 2
// warpgroups, k-tiles of 64 through 3 shared activation buffers, one barrier per 64 k that the tensor
// cores work across. H200, PTQ1_0, M = 512 (bench_cuda_ops --prefill, us, mma.sync -> wgmma, same run):
// ffn_up 5120x17408 484 -> 268, ffn_down 17408x5120 443 -> 261, ssm_in 5120x6144 181 -> 97, ssm_out
// 6144x5120 175 -> 98, attn_kv 5120x1024 51 -> 32; the 8 shapes 1927 -> 1102 (M = 64: 354 -> 320).
// Measured and left (M = 512): without the unpacking (A = raw code words) the loop ran ~4 % faster,
// without the activation staging ~10 %, so neither is the limit; waiting for all wgmmas before each
// barrier (2 buffers) was 1-9 % slower; one fence per k-tile 10 % slower with 128 rows; 64 rows per CTA
// (2 CTAs per SM, a few spilled registers) 1.5-1.75x slower; the split-K reduction costs ~5 k-tiles.
#include <cooperative_groups.h>

#include <algorithm>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 128;      // 4 warps
constexpr int kKT = 32;            // k-tile (2 mma k-steps)
constexpr int kRowBytes = kKT * 2;  // a bf16 activation tile row
constexpr int kRedPad = 4;         // floats of padding per row of the split-K tile

template <int WX>
struct Tile {
  static constexpr int WO = 4 / WX;
  static constexpr int BO = 64 * WO, BX = 64 * WX;
  static constexpr int kF4 = BX * (kKT / 4) / kThreads;  // float4 activation loads per thread per k-tile
  static constexpr int kStageBytes = BX * kRowBytes;
  static constexpr int kPipeBytes = 2 * kStageBytes;
  static constexpr int kRedBytes = BX * (BO + kRedPad) * 4;
};

// Byte offset of the 16-byte piece `piece` (0..3) of activation tile row `row`.
__device__ __forceinline__ uint32_t swz(int row, int piece) {
  return static_cast<uint32_t>(row * kRowBytes + ((piece ^ ((row >> 1) & 3)) << 4));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (the low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// Code pair P (0..7) of a layout word, the codes at bits 2P and 16 + 2P -> bf16x2 ((c0 - 1) d, (c1 - 1) d).
// P = q: register q of bytes 0 and 2; P = q + 4: register q of bytes 1 and 3.
__device__ __forceinline__ uint32_t wpair(uint32_t w, int P, __nv_bfloat162 d2) {
  const uint32_t v = ((w >> (2 * P)) & 0x00030003u) | 0x43004300u;  // bf16x2 (128 + c0, 128 + c1)
  return as_u32(__hmul2(__hsub2(as_bf162(v), as_bf162(0x43014301u)), d2));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One weight of a launch: a launch covers up to kTernaryMaxGroup ternary weights that share the input x
// (matmul_prefill_group: GDN qkv | z, FFN gate | up, attention q | k | v), each weight's CTA row tiles a
// range of grid.y, so the weights' tiles fill the same waves (the H200 runs one wgmma CTA per SM: FFN
// gate and up alone take 2.06 waves each, 3 + 3; together 4.12, 5).
struct PrefillPart {
  const uint32_t* codes;   // kTernaryMma: [Np/16][nblk][16][8] words
  const uint32_t* scales;  // [Np/16][nblk][8] fp16x2 (row g, row g + 8)
  float* y;
  int64_t N;
  int tiles16;  // Np / 16
  int cta_end;  // one past this weight's last CTA row tile (blockIdx.y; group_part)
  bool y_vec;   // S > 1: y rows allow 16-byte stores
};
struct PrefillArgs {
  PrefillPart part[kTernaryMaxGroup];
  int nparts;
  const float* x;
  int64_t M, K;
  int nblk;     // K / 128
  int n_kt;     // K / 32
  int splits;   // S: CTAs of a cluster sharing the k-tiles (1: no cluster)
};

// This CTA's weight and the first of its output rows in that weight (tiles of bo rows along grid.y).
__device__ __forceinline__ void select_part(const PrefillArgs& p, int bo, PrefillPart& pt, int64_t& o0) {
  int begin;
  pt = group_part(p.part, p.nparts, static_cast<int>(blockIdx.y), begin);
  o0 = static_cast<int64_t>(static_cast<int>(blockIdx.y) - begin) * bo;
}

// Split-K: each CTA of the cluster left its fp32 tile (kBO weight rows x kBX activation rows) in shared
// memory, red[m * ld + o]; rank r adds rows [r kBX / S, (r + 1) kBX / S) of the S tiles in rank order
// (the same sum whatever the timing) and stores them (16-byte stores where y allows). Both kernels.
template <int kBO, int kBX, int kThreadsN>
__device__ __forceinline__ void reduce_split_tile(const PrefillArgs& p, const PrefillPart& pt, float* red, int ld,
                                                  int64_t x0, int64_t o0, cg::cluster_group& cluster) {
  const int S = p.splits, rows = kBX / S;
  const int rank = static_cast<int>(cluster.block_rank());
  for (int idx = static_cast<int>(threadIdx.x); idx < rows * (kBO / 4); idx += kThreadsN) {
    const int m = rank * rows + idx / (kBO / 4), o = 4 * (idx % (kBO / 4));
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int src = 0; src < S; ++src) {
      const float* other = cluster.map_shared_rank(red, src);
      const float4 v = *reinterpret_cast<const float4*>(other + m * ld + o);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    const int64_t gm = x0 + m, go = o0 + o;
    if (gm >= p.M || go >= pt.N) continue;
    float* yp = pt.y + gm * pt.N + go;
    if (pt.y_vec && go + 3 < pt.N) {
      *reinterpret_cast<float4*>(yp) = sum;
    } else {
      const float sv[4] = {sum.x, sum.y, sum.z, sum.w};
      for (int e = 0; e < 4 && go + e < pt.N; ++e) yp[e] = sv[e];
    }
  }
}

template <int WX>
__global__ void __launch_bounds__(kThreads, 1) gemm_ternary_prefill_kernel(const PrefillArgs p) {
  using T = Tile<WX>;
  constexpr int WO = T::WO, BO = T::BO, BX = T::BX;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wo = warp % WO, wx = warp / WO;  // warp tile: weight rows 64 wo.., activation rows 64 wx..
  const int split = blockIdx.x;              // == the cluster rank (cluster dims (S, 1, 1))
  PrefillPart pt;
  int64_t o0;
  select_part(p, BO, pt, o0);
  const int64_t x0 = static_cast<int64_t>(blockIdx.z) * BX;
  const int64_t K = p.K;
  const int kt0 = static_cast<int>(static_cast<int64_t>(p.n_kt) * split / p.splits);
  const int kt1 = static_cast<int>(static_cast<int64_t>(p.n_kt) * (split + 1) / p.splits);

  // this thread's activation loads: float4 c4 = tid % 8 of rows tid / 8 + 16 u (rows past M: a copy of
  // row M - 1, never stored)
  const int c4 = tid & 7;
  const float* xrow0 = p.x + std::min<int64_t>(x0 + (tid >> 3), p.M - 1) * K + 4 * c4;
  // this warp's 4 weight tiles (tiles past the padded rows: a copy of the last, never stored)
  int64_t tile[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) tile[i] = std::min<int64_t>(o0 / 16 + wo * 4 + i, pt.tiles16 - 1);

  float4 ra[T::kF4];
  uint32_t rw[4][2], rsc[4];
  auto load_tile = [&](int kt) {
#pragma unroll
    for (int u = 0; u < T::kF4; ++u) {
      const int64_t r = x0 + (tid >> 3) + 16 * u;
      const float* src = r < p.M ? xrow0 + 16 * u * K : xrow0;
      ra[u] = __ldg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(kt) * kKT));
    }
    const int b = kt >> 2, h = (kt >> 1) & 1;  // block; word 2t + h holds steps 4h .. 4h + 3 (k 64h ..)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t tb = tile[i] * p.nblk + b;
      const uint32_t* w = pt.codes + tb * 128 + g * 8 + 2 * t + h;
      rw[i][0] = __ldg(w);
      rw[i][1] = __ldg(w + 64);  // row g + 8
      rsc[i] = __ldg(pt.scales + tb * 8 + g);
    }
  };
  // float4 c4 holds the k-tile's inputs 4 c4 .. + 3 = k group c4 / 4, local k 4t' + e (t' = c4 % 4):
  // e = 0, 2 go to the group's mma k 2t', 2t' + 1 (piece 2 (c4 / 4), bytes 4t'..), e = 1, 3 to mma k
  // 8 + 2t', 9 + 2t' (piece 2 (c4 / 4) + 1). A warp's 32 4-byte stores hit 32 banks (4 rows of 64 B;
  // rows r, r + 2 differ in the swizzle's piece bit 0).
  auto store_tile = [&](int buf) {
    uint8_t* sA = smem + buf * T::kStageBytes;
    const int pc = 2 * (c4 >> 2), off = 4 * (c4 & 3);
#pragma unroll
    for (int u = 0; u < T::kF4; ++u) {
      const int r = (tid >> 3) + 16 * u;
      *reinterpret_cast<uint32_t*>(sA + swz(r, pc) + off) = pack_bf16(ra[u].x, ra[u].z);
      *reinterpret_cast<uint32_t*>(sA + swz(r, pc + 1) + off) = pack_bf16(ra[u].y, ra[u].w);
    }
  };

  float acc[4][8][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (kt0 < kt1) {
    load_tile(kt0);
    store_tile(0);
  }
  __syncthreads();
  for (int kt = kt0; kt < kt1; ++kt) {
    const int buf = (kt - kt0) & 1;
    // this k-tile's weights (registers of load_tile(kt)) before the prefetch overwrites them
    uint32_t cw[4][2];
    __nv_bfloat162 dg[4], dg8[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cw[i][0] = rw[i][0];
      cw[i][1] = rw[i][1];
      const float d0 = fp16_to_f32(static_cast<uint16_t>(rsc[i] & 0xffffu));
      const float d1 = fp16_to_f32(static_cast<uint16_t>(rsc[i] >> 16));
      dg[i] = __floats2bfloat162_rn(d0, d0);
      dg8[i] = __floats2bfloat162_rn(d1, d1);
    }
    const bool more = kt + 1 < kt1;
    if (more) load_tile(kt + 1);
    const uint32_t xBase = smem_base + buf * T::kStageBytes;
    // k-tile kt holds steps s = 2 (kt % 4) + ks (ks = 0, 1) of its block, in word 2t + (kt / 2) % 2:
    // register q = s % 4 = 2 (kt % 2) + ks
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      uint32_t a[4][4];
      const int q = 2 * (kt & 1) + ks;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // bytes 0, 2 (k 4t, 4t + 2 = mma k 2t, 2t + 1) -> a0 (row g), a1 (row g + 8); bytes 1, 3 (k 4t + 1,
        // 4t + 3 = mma k 2t + 8, 2t + 9) -> a2, a3
        a[i][0] = wpair(cw[i][0], q, dg[i]);
        a[i][1] = wpair(cw[i][1], q, dg8[i]);
        a[i][2] = wpair(cw[i][0], q + 4, dg[i]);
        a[i][3] = wpair(cw[i][1], q + 4, dg8[i]);
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        // B matrices (mma k, the permuted order): (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        uint32_t bq[4];
        const int n = wx * 64 + 16 * np + (lane & 7) + ((lane >> 4) & 1) * 8;
        ldmatrix_x4(xBase + swz(n, 2 * ks + ((lane >> 3) & 1)), bq);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          mma_bf16(acc[i][2 * np], a[i], bq[0], bq[1]);
          mma_bf16(acc[i][2 * np + 1], a[i], bq[2], bq[3]);
        }
      }
    }
    if (more) store_tile(buf ^ 1);
    __syncthreads();
  }

  // ---- epilogue. acc[i][j]: weight rows 16 i + g (e = 0, 1) and + 8 (e = 2, 3), activation rows
  // 8 j + 2 t (e = 0, 2) and + 1 (e = 1, 3), of the warp tile.
  if (p.splits == 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t o = o0 + wo * 64 + 16 * i + g + (e >= 2 ? 8 : 0);
          const int64_t m = x0 + wx * 64 + 8 * j + 2 * t + (e & 1);
          if (o < pt.N && m < p.M) pt.y[m * pt.N + o] = acc[i][j][e];
        }
    return;
  }
  // split-K: the fp32 tile [BX][BO] into shared memory (the pipeline's buffers are free after the
  // loop's last barrier), then rank r adds its rows of the S tiles in rank order.
  constexpr int LD = BO + kRedPad;
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int o = wo * 64 + 16 * i + g + (e >= 2 ? 8 : 0);
        const int m = wx * 64 + 8 * j + 2 * t + (e & 1);
        red[m * LD + o] = acc[i][j][e];
      }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  reduce_split_tile<BO, BX, kThreads>(p, pt, red, LD, x0, o0, cluster);
  cluster.sync();  // no CTA leaves while another still reads its tile
}

// ---- Hopper: warpgroup mma (wgmma), weights from registers -----------------------------------------
// A CTA of 2 warpgroups computes 256 weight rows x BN activation rows (BN = 64 or 128): warpgroup w
// owns weight rows 128 w .. + 127 as two m64 blocks, each a wgmma.m64nBNk16 whose A (the weights)
// comes from registers, unpacked exactly as above (the wgmma A fragment of warp i of the warpgroup is
// the mma.m16n8k16 A fragment of rows 16 i.., so the same k permutation applies), and whose B (the
// activations) is read from shared memory through a descriptor. k-tiles of 64: the bf16 activation
// tile row is one 128-byte swizzle atom (16-byte piece c of row n at piece c ^ (n % 8), rows 128 bytes
// apart, 8-row groups 1024 bytes apart), the k16 step s starts 32 s bytes into it. Per k-tile: the
// threads load the next k-tile's fp32 activations and code words into registers, issue the 4 k16 steps
// x 2 blocks asynchronously (two commit groups), convert the loaded activations into the next of 3
// buffers, wait for all wgmmas but the newest group and meet at one __syncthreads.
// (The compute_90 PTX pass compiles the kernel body out, leaving these helpers unreferenced there.)
#pragma nv_diag_suppress 177
constexpr int kWgThreads = 256;  // 2 warpgroups
constexpr int kWgKT = 64;        // k-tile: 64 bf16 = one 128-byte swizzle atom per activation row
constexpr int kWgBO = 256;       // weight rows per CTA (2 warpgroups x 2 m64 blocks)

template <int BN>
struct WgTile {
  static constexpr int kF4 = BN * (kWgKT / 4) / kWgThreads;  // float4 activation loads per thread per k-tile
  static constexpr int kStageBytes = BN * 128;
  static constexpr int kLD = kWgBO + kRedPad;
  static constexpr int kRedBytes = BN * kLD * 4;
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per thread per m64 block
  static constexpr int kMinBlocks = BN == 64 ? 2 : 1;
};

__device__ __forceinline__ void wgmma_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, "
      "1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
      : "memory");
}

__device__ __forceinline__ void wgmma_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, "
      "1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
      : "memory");
}

template <int BN>
__device__ __forceinline__ void wgmma_bn(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (BN == 64) {
    wgmma_n64(d, a, desc);
  } else {
    wgmma_n128(d, a, desc);
  }
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// st.shared (generic proxy) before wgmma reads the tile (async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keeps the compiler from moving accumulator reads or writes across the wgmma fences and waits
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor: K-major B, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3ffffu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

#pragma nv_diag_default 177

template <int BN, bool kOneFence>
__global__ void __launch_bounds__(kWgThreads, WgTile<BN>::kMinBlocks) gemm_ternary_wgmma_kernel(const PrefillArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgTile<BN>;
  extern __shared__ uint8_t smem_raw[];
  // the swizzle atoms need 1024-byte alignment (the launch adds 1 KB)
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t sbase = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (sbase - raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wi = warp & 3;
  const int split = blockIdx.x;  // == the cluster rank (cluster dims (S, 1, 1))
  PrefillPart pt;
  int64_t o0;
  select_part(p, kWgBO, pt, o0);
  const int64_t x0 = static_cast<int64_t>(blockIdx.z) * BN;
  const int64_t K = p.K;
  const int kt0 = static_cast<int>(static_cast<int64_t>(p.n_kt) * split / p.splits);
  const int kt1 = static_cast<int>(static_cast<int64_t>(p.n_kt) * (split + 1) / p.splits);

  // activation loads: float4 c4 = tid % 16 of tile rows tid / 16 + 16 u (rows past M: a copy of row M - 1)
  const int c4 = tid & 15, r0 = tid >> 4;
  const float* xrow0 = p.x + std::min<int64_t>(x0 + r0, p.M - 1) * K + 4 * c4;
  // this warp's weight tiles: block b of warpgroup wg, rows 16 wi.. (past the padded rows: the last tile)
  int64_t tile[2];
#pragma unroll
  for (int b = 0; b < 2; ++b) tile[b] = std::min<int64_t>(o0 / 16 + (2 * wg + b) * 4 + wi, pt.tiles16 - 1);

  float4 ra[T::kF4];
  uint32_t rw[2][2], rsc[2];
  auto load_act = [&](int kt) {
#pragma unroll
    for (int u = 0; u < T::kF4; ++u) {
      const int64_t r = x0 + r0 + 16 * u;
      const float* src = r < p.M ? xrow0 + 16 * u * K : xrow0;
      ra[u] = __ldg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(kt) * kWgKT));
    }
  };
  auto load_w = [&](int kt) {
    const int blk = kt >> 1, h = kt & 1;  // k-tile kt: steps 4h .. 4h + 3 of block blk, word 2t + h
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int64_t tb = tile[b] * p.nblk + blk;
      const uint32_t* w = pt.codes + tb * 128 + g * 8 + 2 * t + h;
      rw[b][0] = __ldg(w);
      rw[b][1] = __ldg(w + 64);  // row g + 8
      rsc[b] = __ldg(pt.scales + tb * 8 + g);
    }
  };
  // float4 c4 = k 4 c4 .. + 3 of the k-tile: k16 group s = c4 / 4, local k 4t' + e (t' = c4 % 4); e = 0, 2
  // play the group's mma k 2t', 2t' + 1 (piece 2s, bytes 4t'..), e = 1, 3 mma k 8 + 2t', 9 + 2t' (piece
  // 2s + 1). A warp covers rows 2i, 2i + 1, whose swizzles differ in bit 0: its 32 stores hit 32 banks.
  auto store_act = [&](int buf) {
    uint8_t* sA = smem + buf * T::kStageBytes;
    const int pc = 2 * (c4 >> 2), off = 4 * (c4 & 3);
#pragma unroll
    for (int u = 0; u < T::kF4; ++u) {
      const int r = r0 + 16 * u;
      uint8_t* row = sA + r * 128 + off;
      *reinterpret_cast<uint32_t*>(row + ((pc ^ (r & 7)) << 4)) = pack_bf16(ra[u].x, ra[u].z);
      *reinterpret_cast<uint32_t*>(row + (((pc + 1) ^ (r & 7)) << 4)) = pack_bf16(ra[u].y, ra[u].w);
    }
  };

  float acc[2][T::kAcc];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int e = 0; e < T::kAcc; ++e) acc[b][e] = 0.0f;

  // Three activation buffers: k-tile kt's wgmmas read buffer kt % 3 while the threads fill (kt + 1) % 3;
  // the barrier that ends k-tile kt waits for all wgmmas but kt's second half (wait_group 1), so the
  // tensor cores have work queued across it, and buffer (kt + 2) % 3 = (kt - 1) % 3 is free to fill next.
  if (kt0 < kt1) {
    load_act(kt0);
    load_w(kt0);
    store_act(0);
  }
  fence_proxy_async();
  __syncthreads();
  int buf = 0;
  for (int kt = kt0; kt < kt1; ++kt) {
    const int nbuf = buf == 2 ? 0 : buf + 1;
    if (kt + 1 < kt1) load_act(kt + 1);  // stored once this k-tile's wgmmas are issued
    uint32_t cw[2][2];
    __nv_bfloat162 dg[2], dg8[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      cw[b][0] = rw[b][0];
      cw[b][1] = rw[b][1];
      const float d0 = fp16_to_f32(static_cast<uint16_t>(rsc[b] & 0xffffu));
      const float d1 = fp16_to_f32(static_cast<uint16_t>(rsc[b] >> 16));
      dg[b] = __floats2bfloat162_rn(d0, d0);
      dg8[b] = __floats2bfloat162_rn(d1, d1);
    }
    if (kt + 1 < kt1) load_w(kt + 1);
    const uint32_t xb = sbase + static_cast<uint32_t>(buf * T::kStageBytes);
    // k16 step s of the k-tile = register q = s of the words. bytes 0, 2 (k 4t, 4t + 2 = mma k 2t, 2t + 1)
    // -> a0 (row g), a1 (row g + 8); bytes 1, 3 (k 4t + 1, 4t + 3 = mma k 2t + 8, 2t + 9) -> a2, a3.
    if constexpr (kOneFence) {  // all 4 steps' A, one fence, 8 wgmmas back to back
      uint32_t a[4][2][4];
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          a[s][b][0] = wpair(cw[b][0], s, dg[b]);
          a[s][b][1] = wpair(cw[b][1], s, dg8[b]);
          a[s][b][2] = wpair(cw[b][0], s + 4, dg[b]);
          a[s][b][3] = wpair(cw[b][1], s + 4, dg8[b]);
        }
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint64_t desc = sw128_desc(xb + 32 * s);
#pragma unroll
        for (int b = 0; b < 2; ++b) wgmma_bn<BN>(acc[b], a[s][b], desc);
        if (s == 1) wgmma_commit();
      }
    } else {  // step by step: the unpacking of step s + 1 overlaps the wgmmas of step s
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t a[2][4];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          a[b][0] = wpair(cw[b][0], s, dg[b]);
          a[b][1] = wpair(cw[b][1], s, dg8[b]);
          a[b][2] = wpair(cw[b][0], s + 4, dg[b]);
          a[b][3] = wpair(cw[b][1], s + 4, dg8[b]);
        }
        wgmma_fence();
        const uint64_t desc = sw128_desc(xb + 32 * s);
#pragma unroll
        for (int b = 0; b < 2; ++b) wgmma_bn<BN>(acc[b], a[b], desc);
        if (s == 1) wgmma_commit();
      }
    }
    wgmma_commit();
    if (kt + 1 < kt1) store_act(nbuf);  // its last readers, k-tile kt - 2's wgmmas, are done
    fence_proxy_async();
    wgmma_wait1();  // k-tile kt's second half may still run across the barrier
    __syncthreads();
    buf = nbuf;
  }
  wgmma_wait0();
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int e = 0; e < T::kAcc; ++e) reg_fence(acc[b][e]);
  __syncthreads();  // every warpgroup's wgmmas are done with the buffers (the split-K tile reuses them)

  // ---- epilogue. acc[b][4 j + e]: weight row 64 (2 wg + b) + 16 wi + g (+ 8 for e >= 2), activation row
  // 8 j + 2 t (+ 1 for odd e), of the CTA tile.
  if (p.splits == 1) {
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t o = o0 + 64 * (2 * wg + b) + 16 * wi + g + (e >= 2 ? 8 : 0);
          const int64_t m = x0 + 8 * j + 2 * t + (e & 1);
          if (o < pt.N && m < p.M) pt.y[m * pt.N + o] = acc[b][4 * j + e];
        }
    return;
  }
  // split-K: as in the mma.sync kernel (the pipeline buffers are free after the loop's last barrier)
  constexpr int LD = T::kLD;
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int o = 64 * (2 * wg + b) + 16 * wi + g + (e >= 2 ? 8 : 0);
        const int m = 8 * j + 2 * t + (e & 1);
        red[m * LD + o] = acc[b][4 * j + e];
      }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  reduce_split_tile<kWgBO, BN, kWgThreads>(p, pt, red, LD, x0, o0, cluster);
  cluster.sync();  // no CTA leaves while another still reads its tile
#else
  __trap();  // launched for compute capability 9.x only, which runs the sm_90a build
#endif
}

int sm_count() {
  const int n = current_sm_count();
  return n > 0 ? n : 132;
}

// The launch's weights: parts in grid.y order, each weight's row tiles of bo rows; returns the total
// number of row tiles (grid.y), or -1 past the grid's limit.
int64_t fill_parts(PrefillArgs& p, const DevWeight* const* ws, float* const* ys, int n, int64_t bo) {
  int64_t ty = 0;
  p.nparts = n;
  for (int k = 0; k < n; ++k) {
    PrefillPart& pt = p.part[k];
    pt.codes = reinterpret_cast<const uint32_t*>(ws[k]->data);
    pt.scales = reinterpret_cast<const uint32_t*>(ws[k]->scales);
    pt.y = ys[k];
    pt.N = ws[k]->out;
    pt.tiles16 = static_cast<int>(padded_rows(ws[k]->out) / 16);
    pt.y_vec = ws[k]->out % 4 == 0 && reinterpret_cast<uintptr_t>(ys[k]) % 16 == 0;
    ty += (ws[k]->out + bo - 1) / bo;
    if (ty > 65535) return -1;
    pt.cta_end = static_cast<int>(ty);
  }
  return ty;
}

template <int WX>
bool launch_ternary(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M, cudaStream_t s) {
  using T = Tile<WX>;
  const DevWeight& w = *ws[0];
  PrefillArgs p{};
  const int64_t tiles_x = (M + T::BX - 1) / T::BX, tiles_o = fill_parts(p, ws, ys, n, T::BO);
  if (tiles_x > 65535 || tiles_o < 0) return false;
  p.x = x;
  p.M = M;
  p.K = w.in;
  p.nblk = static_cast<int>(w.in / 128);
  p.n_kt = static_cast<int>(w.in / kKT);
  // k split: the S in {1, 2, 4, 8} whose CTAs fill the waves best (2 CTAs per SM), each share keeping
  // >= 16 k-tiles (512 inputs); a larger S must gain > 5 % to be taken (its reduction costs).
  const int64_t slots = 2 * static_cast<int64_t>(sm_count()), base = tiles_x * tiles_o;
  int S = 1;
  double best = 0;
  for (int c = 1; c <= 8; c *= 2) {
    if (c > 1 && p.n_kt / c < 16) break;
    const int64_t ctas = base * c, waves = (ctas + slots - 1) / slots;
    const double eff = static_cast<double>(ctas) / static_cast<double>(waves * slots);
    if (eff > best * 1.05) {
      best = eff;
      S = c;
    }
  }
  p.splits = S;
  const int smem = S == 1 ? T::kPipeBytes : std::max(T::kPipeBytes, T::kRedBytes);
  auto kernel = gemm_ternary_prefill_kernel<WX>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(tiles_o), static_cast<unsigned>(tiles_x));
  if (launch_ex(kernel, grid, dim3(kThreads), static_cast<size_t>(smem), s, dim3(S, 1, 1), false, p) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. no room for the cluster: the caller's GEMV path computes it instead
    return false;
  }
  return true;
}

int cc_major() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return 0;
  return v;
}

template <int BN, bool kOneFence>
bool launch_wgmma(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M, cudaStream_t s) {
  using T = WgTile<BN>;
  const DevWeight& w = *ws[0];
  PrefillArgs p{};
  const int64_t tiles_x = (M + BN - 1) / BN, tiles_o = fill_parts(p, ws, ys, n, kWgBO);
  if (tiles_x > 65535 || tiles_o < 0) return false;
  p.x = x;
  p.M = M;
  p.K = w.in;
  p.nblk = static_cast<int>(w.in / 128);
  p.n_kt = static_cast<int>(w.in / kWgKT);
  auto kernel = gemm_ternary_wgmma_kernel<BN, kOneFence>;
  // The shared memory of the largest config (the split-K tile); then how many CTAs (S = 1) or
  // clusters of S run at once (a GPC holds whole clusters only: on the H200 30 clusters of 4 = 120
  // CTAs, not 132), cached per S.
  constexpr int kPipe = 3 * T::kStageBytes, kSmemMax = std::max(kPipe, T::kRedBytes) + 1024;
  static int slots_cache[4] = {0, 0, 0, 0};  // per log2 S; 0: not yet asked, -1: none fit
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  auto smem_of = [&](int S) { return (S == 1 ? kPipe : std::max(kPipe, T::kRedBytes)) + 1024; };
  auto slots_of = [&](int S, int l2) {
    if (slots_cache[l2] != 0) return slots_cache[l2];
    int n = 0;
    if (S == 1) {
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWgThreads, smem_of(1)) != cudaSuccess) n = 0;
      n *= sm_count();
    } else {
      cudaLaunchConfig_t q{};
      q.gridDim = dim3(static_cast<unsigned>(S), 1, 1);
      q.blockDim = dim3(kWgThreads);
      q.dynamicSmemBytes = static_cast<size_t>(smem_of(S));
      cudaLaunchAttribute a[1];
      a[0].id = cudaLaunchAttributeClusterDimension;
      a[0].val.clusterDim.x = static_cast<unsigned>(S);
      a[0].val.clusterDim.y = 1;
      a[0].val.clusterDim.z = 1;
      q.attrs = a;
      q.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &q) != cudaSuccess) n = 0;
      n *= S;
    }
    (void)cudaGetLastError();
    slots_cache[l2] = n > 0 ? n : -1;
    return slots_cache[l2];
  };
  // k split S in {1, 2, 4, 8}: the least waves x (k-tiles per CTA + the cluster reduction's cost, ~5
  // k-tiles for every S: fitted to the H200's times of the 27B shapes at M = 512 for S = 1, 2, 4, 8 with
  // the real cluster slots), each share keeping >= 8 k-tiles.
  const int64_t base = tiles_x * tiles_o;
  constexpr double kRedCost = 5.0;
  int S = 0;
  double best = 0;
  for (int c = 1, l2 = 0; c <= 8; c *= 2, ++l2) {
    if (c > 1 && p.n_kt / c < 8) break;
    const int slots = slots_of(c, l2);
    if (slots <= 0) continue;
    const int64_t waves = (base * c + slots - 1) / slots;
    const double cost = static_cast<double>(waves) * (static_cast<double>(p.n_kt) / c + (c > 1 ? kRedCost : 0.0));
    if (S == 0 || cost < best) {
      best = cost;
      S = c;
    }
  }
  if (S == 0) return false;
  p.splits = S;
  const int smem = smem_of(S);
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(tiles_o), static_cast<unsigned>(tiles_x));
  if (launch_ex(kernel, grid, dim3(kWgThreads), static_cast<size_t>(smem), s, dim3(S, 1, 1), false, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace

bool launch_matmul_prefill_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                                 cudaStream_t s) {
  if (n < 1 || n > kTernaryMaxGroup || M <= 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  for (int k = 0; k < n; ++k) {
    const DevWeight& w = *ws[k];
    if (w.layout != Layout::kTernaryMma) return false;  // planar 2-bit and block formats: the GEMV tiles
    if (w.out <= 0 || w.in <= 0 || w.in != ws[0]->in || w.in % 128 != 0 ||
        reinterpret_cast<uintptr_t>(w.data) % 4 != 0 || reinterpret_cast<uintptr_t>(w.scales) % 4 != 0 ||
        w.in / kKT > (int64_t{1} << 30))
      return false;
  }
  // Activation tiles of 64 rows when they pad fewer rows than 128 would (M <= 64, M % 128 in 1..64).
  const int64_t waste64 = (M + 63) / 64 * 64 - M, waste128 = (M + 127) / 128 * 128 - M;
  if (cc_major() == 9) {  // wgmma (the sm_90a build; other GPUs run the mma.sync kernel)
    // (one fence per k-tile measured faster with 64 rows, 2 CTAs per SM; step by step with 128)
    return waste64 < waste128 ? launch_wgmma<64, true>(ws, ys, n, x, M, s) : launch_wgmma<128, false>(ws, ys, n, x, M, s);
  }
  return waste64 < waste128 ? launch_ternary<1>(ws, ys, n, x, M, s) : launch_ternary<2>(ws, ys, n, x, M, s);
}

bool launch_matmul_prefill(const DevWeight& w, const float* x, float* y, int64_t M, cudaStream_t s) {
  const DevWeight* one[1] = {&w};
  float* const ys[1] = {y};
  return launch_matmul_prefill_group(one, ys, 1, x, M, s);
}

}  // namespace dflash::cuda
