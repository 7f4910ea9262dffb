// drvsoftmax long rows on sm_90+: a thread-block cluster per row, every byte read once.
//
// A cluster of CS CTAs (2..16, chosen at launch; grid = rows * CS, cluster dims (CS, 1, 1))
// works on one row.  CTA `rank` owns chunks [rank * K * B, (rank + 1) * K * B) of the row
// (B = SMX_CBLOCK threads, K = R + Q chunks per thread); thread t owns chunks
// rank * K * B + k * B + t: its first R (a template parameter, 0 or a few) in registers,
// the other Q in dynamic shared memory.  Registers take part of a slice where shared
// memory alone would leave room for one CTA per SM (two CTAs overlap one's loads with the
// other's reductions and stores).
//   LOAD    the R register chunks by the register tier's LOAD, then every other chunk a
//           thread owns to dynamic shared memory, raw, all in flight, in parts (X::PARTS),
//           so that PAIR starts on the first part of the slice while the rest still
//           arrives: in the cluster tier on sm_90 (SMX_CL_BULK) each part's whole visible
//           chunks by one bulk copy per operand (thread 0, completing on the part's
//           mbarrier; the slice's layout in shared memory is its layout in the row), in the
//           coop tier (and the cluster tier beyond sm_90) by cp.async (16 bytes a thread,
//           no registers held, a commit group a part); the few others (a row's first and
//           last chunk, strided rows, a mask off the 16-byte grid) through the register
//           tier's LOAD or cp.async;
//   PAIR    the thread's (max, sum) over its chunks (the register tier's VALUES), merged
//           over the warp, the CTA, then the cluster: each CTA stores its pair into every
//           CTA's shared memory (st.async through distributed shared memory, completing on
//           the receiver's mbarrier; SmxClusterX), and every warp merges the CS pairs it
//           received in the same order, so every CTA holds the same row statistics;
//   STORE   y of the thread's chunks from shared memory (VALUES again, the tier's STORE).
// Backward: dy and y held in shared memory alike; the pair is the dot product sum(dy * y).
// Streamed forward (smx_fwd_cluster_stream, rows no cluster holds on chip): the slice is
// as long as the row needs (smx_slice_steps), its steps past the registers and shared
// memory read in PAIR and read again in STORE, last first, while L2 still holds them (a
// cluster of 16 takes a row, so the rows in flight at once are few).
// x-held forward (smx_fwd_cluster_xs, 16-bit x with a hiding mask): shared memory holds x
// alone; PAIR reads the mask from global memory and leaves x there with its hidden
// elements -inf, so that STORE needs no mask (smx_xs_pair_step).
//
// The dynamic shared memory size tells the kernel Q: Q * B * (bytes of a chunk of every
// operand held).  Q is a multiple of SMX_CL_U (chunks a thread handles per step), maybe 0.
//
// The cluster kernels' bodies exist for sm_90+ only (clusters and distributed shared
// memory); on older architectures they compile empty and the planner never picks them there.
//
// The coop tier (every architecture): the same slice, LOAD, PAIR and STORE, in G ordinary
// blocks that are all resident at once (a cooperative launch guarantees it or fails).
// Grid (G, groups): block (rank, g) holds slice `rank` of rows g, g + groups, ... one row
// per wave; every block runs every wave (blocks of rows past the end take part in the
// barriers only).  The pairs travel through global memory, in the output itself: after
// its slice is on chip, each block writes its pair (8 bytes) into the first elements of
// its slice of the output row (elements it alone reads or writes, whose x it already holds
// or never needs: in place is safe), a grid barrier, every warp reads the G pairs of its
// row and merges them in the same order, a second grid barrier (no block overwrites a pair
// before all have read it), then STORE.  The planner gives every block at least one chunk
// of the row (at least 16 bytes: room for the pair).  With G = 1 (a row per block) there
// is nothing to exchange: no barrier at all.
//
// Compiled after softmax_fwd.cu and softmax_bwd.cu (the kernel set's main source includes
// the three in that order): it uses their row, LOAD, VALUES and STORE steps.
#include "softmax_common.cuh"

#define SMX_CBLOCK 256  // threads of a cluster- or coop-tier block (_plan.BLOCK)

// The x-held forward (smx_fwd_cluster_xs): CTAs per SM its registers are held to (two, up
// to 128 registers: at three, 80, the fp16 kernel spilled 24 bytes; it takes 117-120), and
// steps of PAIR whose mask is read ahead of the step worked on (in registers; H100, rows of
// 1M keys: 1 / 2 / 4 / 8 steps 65 / 71 / 75 / 72% of copy with a padding mask, see _plan.py).
#define SMX_XS_BLOCKS 2
#define SMX_XS_AHEAD 4
#define SMX_CL_U 4  // chunks per thread per step of PAIR and STORE
// The slice is loaded in X::PARTS parts, each a commit group (and in the cluster tier an
// mbarrier) of whole steps of U chunks: part g covers steps [smx_part_begin<P>(g),
// smx_part_begin<P>(g + 1)).  The cluster tier's LOAD, forward and backward: 1, the whole
// chunks of each part by one bulk copy per operand (cp.async.bulk, issued by thread 0);
// 0, a 16-byte cp.async per chunk and thread.  H100, the benchmark's long shapes (16-bit
// 2^29 elements, fp32 2^28), speed against per-thread copies in 4 parts (best of two
// rounds; the mean over fp16, bf16 and fp32; a variant's two rounds differ by up to 7%):
//   parts, bulk          fwd 64K / 256K / 1M     fwd+bool [rows,Sk] 64K..1M   bwd 64K / 256K / 1M
//   8, per-thread        0.98 / 0.99 / 0.97      0.97 / 0.98 / 0.97          0.97 / 0.98 / 0.96
//   16, per-thread       0.98 / 0.98 / 0.97      0.98 / 0.97 / 0.96          0.96 / 0.95 / 0.95
//   4, bulk              (half those sizes: bwd 0.91-1.00 at 64K / 256K, fwd 0.95-1.04)
//   8, bulk (kept)       1.02 / 1.01 / 1.02      0.98 / 0.97 / 1.01          1.04 / 1.05 / 0.97
//   16, bulk             0.97 / 0.97 / 0.98      0.94 / 0.92 / 0.98          0.95 / 0.96 / 0.98
// (a [1,Sk] padding mask: 8 bulk 1.00 / 1.00 / 1.03).  The coop tier keeps 4 parts of
// cp.async (its blocks reuse shared memory wave after wave), and so does the cluster tier
// beyond sm_90 (SMX_CL_BULK 0), where nothing was measured and the bulk forward's spans
// held more registers than the 16-bit forward with a 1-byte mask has: with NVRTC 13.5 it
// spilled 8 bytes on sm_100 and 40 (fp16) / 16 (bf16) on sm_120; 13.0 none.
#ifndef SMX_CL_PARTS
#define SMX_CL_PARTS 8  // parts where bulk copies load them
#endif
static_assert(SMX_CL_PARTS >= 1 && SMX_CL_PARTS <= 16, "SMX_CL_PARTS: 1 to 16 parts (a bit each in LOAD's mask)");
#define SMX_CP_PARTS 4  // parts where each thread's cp.async loads them
#ifndef SMX_CL_BULK  // the cluster tier's LOAD by bulk copies, forward and backward
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define SMX_CL_BULK 0
#else
#define SMX_CL_BULK 1
#endif
#endif

extern __shared__ __align__(16) unsigned char smx_cl_dyn[];

__device__ __forceinline__ smx_u32 smx_smem_addr(const void* p) {
  smx_u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ smx_u32 smx_dyn_smem_size() {
  smx_u32 n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}
// Asynchronous copies global -> shared (sm_80+): 16 bytes (L1 bypassed, L2 prefetch of
// the 256-byte sector group) or B = 4 / 8 bytes, to a shared address (smx_smem_addr: a
// slice's base once, offsets added to it).  Before sm_80 (the coop tier on sm_75) they are
// plain loads and stores through registers, and commits and waits do nothing.
__device__ __forceinline__ void smx_cp16a(smx_u32 dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
  const uint4 v = smx_ld16(src);
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#endif
}
template <int B> __device__ __forceinline__ void smx_cp_small_a(smx_u32 dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(B) : "memory");
#else
  Bytes<B> b;
  smx_load_bytes<B>(b, src);
#pragma unroll
  for (int i = 0; i < B / 4; ++i) asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst + 4 * i), "r"(b.w[i]) : "memory");
#endif
}
// B bytes (4 .. 64) from a min(B, 16)-aligned address.
template <int B> __device__ __forceinline__ void smx_cp_bytes_a(smx_u32 dst, const void* src) {
  if (B >= 16) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) smx_cp16a(dst + 16 * i, (const char*)src + 16 * i);
  } else {
    smx_cp_small_a<(B < 16 ? B : 8)>(dst, src);
  }
}
__device__ __forceinline__ void smx_cp16(void* dst, const void* src) { smx_cp16a(smx_smem_addr(dst), src); }
template <int B> __device__ __forceinline__ void smx_cp_bytes(void* dst, const void* src) {
  smx_cp_bytes_a<B>(smx_smem_addr(dst), src);
}
template <int P> __device__ __forceinline__ int smx_part_begin(int g, int steps) { return g * steps / P; }
__device__ __forceinline__ void smx_cp_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most G of this thread's committed groups are still in flight.
template <int G> __device__ __forceinline__ void smx_cp_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(G) : "memory");
#endif
}
// Wait until at most K groups are in flight, K < P known at run time only.
template <int P> __device__ __forceinline__ void smx_cp_wait_upto(int k) {
  if constexpr (P <= 1) {
    smx_cp_wait<0>();
  } else {
    if (k >= P - 1)
      smx_cp_wait<P - 1>();
    else
      smx_cp_wait_upto<P - 1>(k);
  }
}
template <int P> __device__ __forceinline__ void smx_cp_wait_parts_after(int g) {  // part g of P has landed
  smx_cp_wait_upto<P>(P - 1 - g);
}

// Bulk copies (sm_90+): a span of whole chunks of a slice, global -> this CTA's shared
// memory in one instruction (the copy engine; 16-byte aligned ends, a multiple of 16
// bytes), completing its bytes on an mbarrier armed for them by the issuing thread's
// arrival (smx_mbar_expect); every thread waits on that mbarrier's first phase
// (smx_mbar_wait0; the cluster's exchange waits on its own mbarrier alike).
__device__ __forceinline__ void smx_bulk_g2s(smx_u32 dst, const void* src, smx_u32 bytes, smx_u32 bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#endif
}
__device__ __forceinline__ void smx_mbar_init1(smx_u32 bar) {  // one arrival a phase
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void smx_mbar_expect(smx_u32 bar, smx_u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void smx_mbar_wait0(smx_u32 bar) {
#if __CUDA_ARCH__ >= 900
  smx_u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(bar)
                 : "memory");
  } while (!done);
#endif
}
// The chunks [a, b) of a part of a slice (its chunks [pa, pb); cq: the slice's first chunk
// in shared memory) that arrive by bulk copies: those whole and wholly visible, [c0, c1),
// where MB > 0 also the mask's (MB bytes a chunk, at element c * N - ofs of row `m`) all
// of them or none: none where one of the mask's ends in global or shared memory would be
// off a 16-byte boundary.  Every other chunk takes the per-thread path.
struct SmxSpan {
  int a, b;
};
template <int MB, typename S>
__device__ __forceinline__ SmxSpan smx_bulk_span(int pa, int pb, int c0, int c1, int cq, const S* m, int ofs) {
  SmxSpan r;
  r.a = max(pa, c0);
  r.b = max(r.a, min(pb, c1));
  if (MB > 0 && r.b > r.a) {
    const smx_u64 at = (smx_u64)(m + ((smx_i64)r.a * (MB / (int)sizeof(S)) - ofs));
    if (((at | (smx_u64)((r.b - r.a) * MB) | (smx_u64)((r.a - cq) * MB)) & 15u) != 0) r.b = r.a;
  }
  return r;
}
// LOAD's bulk copies of a slice whose shared memory holds operands A (AB bytes a chunk,
// at shared address sa, row ga) and, where BB > 0, B (sb, gb), both in the row's layout
// (chunk c at element c * N - ofs of its row, at (c - cq) chunks into its slots): thread 0
// arms each part's mbarrier for its span's bytes and issues them.  Bit g of the result:
// part g's span is not empty (its whole visible chunks come by bulk copy).
template <int N, int AB, int BB, class X, typename TA, typename TB>
__device__ __forceinline__ int smx_bulk_parts(const X& xc, int steps, int cq, int c0, int c1, int ofs, smx_u32 sa,
                                              const TA* ga, smx_u32 sb, const TB* gb) {
  int bulk = 0;
#pragma unroll 1
  for (int g = 0; g < X::PARTS; ++g) {
    enum { STEP = SMX_CL_U * SMX_CBLOCK };  // chunks a step
    const SmxSpan sp = smx_bulk_span<BB>(cq + smx_part_begin<X::PARTS>(g, steps) * STEP,
                                         cq + smx_part_begin<X::PARTS>(g + 1, steps) * STEP, c0, c1, cq, gb, ofs);
    const int n = sp.b - sp.a;
    if (n > 0) bulk |= 1 << g;
    if (threadIdx.x == 0) {
      const smx_u32 bar = xc.part_bar(g);
      smx_mbar_expect(bar, (smx_u32)(n * (AB + BB)));
      if (n > 0) {
        smx_bulk_g2s(sa + (sp.a - cq) * AB, ga + (sp.a * N - ofs), n * AB, bar);
        if (BB > 0) smx_bulk_g2s(sb + (sp.a - cq) * BB, gb + (sp.a * N - ofs), n * BB, bar);
      }
    }
  }
  return bulk;
}

// (m, s) pairs: merged over the 32 lanes of a warp with a butterfly (each step combines the
// same two partial results in every lane, and the merge is commutative: every lane ends
// with the same bits).
__device__ __forceinline__ void smx_warp_pair_merge(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    smx_pair_merge(m, s, m2, s2);
  }
}
__device__ __forceinline__ float smx_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------------------------
// Exchanges: how the blocks of a row share their pairs.  `merge<SUM>(m, s, pair, ...)`
// takes the block's pair in `pair` (shared, 2 floats, written by thread 0 before the call)
// and returns the row's pair in every thread; the other arguments place the block's slice
// in the output row: its base, element stride, the row's `ofs` (as FwdRow::ofs), chunks
// per block, and whether the row exists.  `finish()` runs when the block is done with the
// row.  Sums (backward) use m = 0 throughout: the merge then adds.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ smx_u32 smx_cluster_rank() {
  smx_u32 r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ smx_u32 smx_cluster_size() {
  smx_u32 r;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
// The cluster's exchange, one way and without a fence: lanes 0..CS-1 of warp 0 (each
// holding the CTA's pair) store it into slot `rank` of CTA lane's `slots`, by st.async
// that completes its 8 bytes on that CTA's mbarrier; every thread waits on its own CTA's
// mbarrier (armed for CS * 8 bytes) and then reads the CS slots in the same order.
// The mbarrier is initialised and armed by thread 0 at the start; the cluster barrier
// arrived at there (relaxed, after the init fence) is waited on just before the first
// remote store, so that no CTA stores into a peer's mbarrier before the peer has
// initialised it, and the wait costs nothing by then.  No CTA writes into another after
// that CTA has received all CS pairs (it receives exactly one from each), and a CTA leaves
// only once it has received them all: nothing is left to wait for at the end.
// (barrier.cluster.arrive.release compiles to a GPU-scope memory barrier: measured slow.)
struct SmxClusterShared {
  smx_u64 bar;
  smx_u64 parts[SMX_CL_PARTS];  // the slice's bulk copies, a part each (SmxClusterX::BULK)
  float slots[16][2];
};
__device__ __forceinline__ smx_u32 smx_mapa(smx_u32 a, smx_u32 rank) {
  smx_u32 ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
  return ra;
}
struct SmxClusterX {
  enum { INTERIOR = 1 };  // the forward's interior steps take the folded path (smx_fwd_slice)
  // The slice's whole chunks land by bulk copies (smx_bulk_span), forward and backward.
  enum { BULK = SMX_CL_BULK, PARTS = BULK ? SMX_CL_PARTS : SMX_CP_PARTS };
  smx_u32 cs, rank;
  SmxClusterShared* sh;
  // Blocks sharing a row, for a slice that streams what shared memory does not hold.
  __device__ __forceinline__ int blocks() const { return (int)cs; }
  // Thread 0 initialises and arms the mbarriers (the exchange's, the parts' with one
  // arrival each: thread 0's, in LOAD); every thread arrives at the cluster barrier, and
  // with BULK waits for the parts' mbarriers to be initialised before anyone waits on them.
  __device__ __forceinline__ void start() const {
    if (threadIdx.x == 0) {
      const smx_u32 b = smx_smem_addr(&sh->bar);
      smx_mbar_init1(b);
      smx_mbar_expect(b, cs * 8u);
#pragma unroll
      for (int g = 0; BULK && g < PARTS; ++g) smx_mbar_init1(part_bar(g));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    if (BULK) __syncthreads();
  }
  __device__ __forceinline__ smx_u32 part_bar(int g) const { return smx_smem_addr(&sh->parts[g]); }
  template <bool SUM, typename T>
  __device__ __forceinline__ void merge(float& m, float& s, const float*, T*, smx_i64, int, int, bool) const {
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    const smx_u32 lane = threadIdx.x & 31;
    if (threadIdx.x < cs) {  // warp 0, whose lanes hold the CTA's pair
      const smx_u32 dst = smx_mapa(smx_smem_addr(&sh->slots[rank][0]), threadIdx.x);
      const smx_u32 bar = smx_mapa(smx_smem_addr(&sh->bar), threadIdx.x);
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(dst),
                   "r"(__float_as_uint(m)), "r"(__float_as_uint(s)), "r"(bar)
                   : "memory");
    }
    smx_mbar_wait0(smx_smem_addr(&sh->bar));
    m = SUM ? 0.0f : -SMX_INF;
    s = 0.0f;
    if (lane < cs) {
      m = sh->slots[lane][0];
      s = sh->slots[lane][1];
    }
    if (SUM) {
      s = smx_warp_sum(s);
    } else {
      smx_warp_pair_merge(m, s);
    }
  }
  __device__ __forceinline__ void finish() const {}
};
#endif

// The coop tier's grid barrier, on the workspace the driver gives every cooperative
// launch: {u32 size; u32 barrier;} at the address held in %envreg1 (high 32 bits) and
// %envreg2 (low 32 bits).  Thread 0 of each block arrives once, after the block's
// __syncthreads: a gpu-scope fence (releasing what the block wrote before, through the
// barrier's cumulativity) and one atomic add.  Block (0, 0) adds 2^31 - (n - 1), the
// others 1: once all n have arrived the word has grown by exactly 2^31, its top bit
// flipped and its low bits as before.  Each arriving thread polls with acquire loads until
// the top bit differs from the one its add saw, then the block's __syncthreads passes that
// on to its other threads.
__device__ __forceinline__ smx_u32* smx_grid_barrier_word() {
  smx_u32 lo, hi;
  asm volatile("mov.u32 %0, %%envreg2;" : "=r"(lo));
  asm volatile("mov.u32 %0, %%envreg1;" : "=r"(hi));
  return (smx_u32*)(((smx_u64)hi << 32) | lo) + 1;
}
__device__ __forceinline__ void smx_grid_sync() {
  __syncthreads();
  if (threadIdx.x == 0) {
    smx_u32* word = smx_grid_barrier_word();
    const smx_u32 n = gridDim.x * gridDim.y;
    const smx_u32 add = (blockIdx.x | blockIdx.y) == 0 ? 0x80000000u - (n - 1u) : 1u;
    smx_u32 seen, now;
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], %2;" : "=r"(seen) : "l"(word), "r"(add) : "memory");
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
    } while (((now ^ seen) & 0x80000000u) == 0u);
  }
  __syncthreads();
}
// Elements of the output that hold one pair: 8 bytes.
template <int B> __device__ __forceinline__ smx_u32 smx_ld_relaxed(const void* p) {
  if (B == 4) {
    smx_u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  unsigned short h;
  asm volatile("ld.relaxed.gpu.global.u16 %0, [%1];" : "=h"(h) : "l"(p) : "memory");
  return h;
}
template <typename T>
__device__ __forceinline__ void smx_pair_put(T* row, smx_i64 st, int j, float m, float s) {
  const smx_u32 w[2] = {__float_as_uint(m), __float_as_uint(s)};
#pragma unroll
  for (int k = 0; k < 8 / (int)sizeof(T); ++k) {
    const smx_u32 v = sizeof(T) == 4 ? w[k] : (w[k >> 1] >> (16 * (k & 1))) & 0xffffu;
    smx_write_bits<sizeof(T)>(row + (smx_i64)(j + k) * st, v);
  }
}
template <typename T>
__device__ __forceinline__ void smx_pair_get(const T* row, smx_i64 st, int j, float& m, float& s) {
  smx_u32 w[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < 8 / (int)sizeof(T); ++k) {
    const smx_u32 v = smx_ld_relaxed<sizeof(T)>(row + (smx_i64)(j + k) * st);
    if (sizeof(T) == 4) {
      w[k] = v;
    } else {
      w[k >> 1] |= v << (16 * (k & 1));
    }
  }
  m = __uint_as_float(w[0]);
  s = __uint_as_float(w[1]);
}

// The coop exchange: the pair of block `rank` lives in the output elements
// max(0, rank * chunks_per_block * N - ofs) .. + 8 bytes of its row.
struct SmxCoopX {
  // (no bulk copies: its blocks reuse their shared memory wave after wave)
  enum { INTERIOR = 0, PARTS = SMX_CP_PARTS, BULK = 0 };
  __device__ __forceinline__ int blocks() const { return 0; }  // slices never stream here
  template <bool SUM, typename T>
  __device__ __forceinline__ void merge(float& m, float& s, const float* pair, T* out, smx_i64 st, int ofs, int cpb,
                                        bool act) const {
    enum { N = Chunk<T>::N };
    const int g = (int)gridDim.x;
    if (g == 1) {  // a row per block: nothing to exchange, no barrier
      __syncthreads();
      m = pair[0];
      s = pair[1];
      return;  // (thread 0 writes `pair` again only after a later __syncthreads)
    }
    if (act && threadIdx.x == 0) smx_pair_put<T>(out, st, max(0, (int)blockIdx.x * cpb * N - ofs), pair[0], pair[1]);
    smx_grid_sync();
    m = SUM ? 0.0f : -SMX_INF;
    s = 0.0f;
    if (act) {
#pragma unroll 1
      for (int i = threadIdx.x & 31; i < g; i += 32) {
        float m2, s2;
        smx_pair_get<T>(out, st, max(0, i * cpb * N - ofs), m2, s2);
        if (SUM) {
          s += s2;
        } else {
          smx_pair_merge(m, s, m2, s2);
        }
      }
    }
    if (SUM) {
      s = smx_warp_sum(s);
    } else {
      smx_warp_pair_merge(m, s);
    }
    smx_grid_sync();  // every block has read every pair: STORE may overwrite them
  }
  __device__ __forceinline__ void finish() const {}
};

// ---------------------------------------------------------------------------------
// The interior of a row in the cluster tier's forward: steps of K chunks per thread
// that are all whole and visible (a step of the slice lies in [c0, c1)) need no per-element
// checks (the lean kernels of softmax_fwd.cu fold alike, without a mask).  For 16-bit x
// with no additive mask and 0 < scale * log2e < inf, the scale also
// folds into STORE's exponent FMA (the max of x * scale is scale * max(x): rounding is
// monotonic), as does its 1 / sum into the exponent: y = 2^(x * scale * log2e - max * log2e
// - log2(sum)).  What that changes (ex2 / lg2 approximations, about 2^-22 relative) is far
// below a 16-bit output's resolution; fp32 rows keep the exact path.  The folded STORE's
// shift max * log2e + log2(sum) is one rounded float: off by up to half a spacing of floats
// at |max * log2e|.  Rows whose max reaches SMX_FOLD_MAX store through the exact path:
// below it the shift is off by less than 2^-13, about 2^-14 relative.  PAIR's terms are
// exact (smx_term), except with a hiding mask: there the mask is applied to x's 16-bit bits
// (hidden: -inf) before the max and the conversion, the max is taken on pairs of 16-bit
// values, and the terms fold alike (one FMA each) where a step's max is below SMX_FOLD_MAX
// (exact above): the sum is off by less than 2^-14 relative, an output by less than 2^-13.
// (SmxFold, SMX_FOLD_MAX, SmxNegInf2, smx_neg_inf_where, smx_max2 and smx_fold_max:
// softmax_fwd.cu.)
// The raw chunk with its hidden elements made -inf in x's own bits.  Masks of one-byte
// elements take four elements a word: bit 7 of each byte of w | ((w & 0x7f..) + 0x7f..)
// is set where the byte is nonzero, and prmt's sign mode spreads it over a 16-bit half.
template <typename T, class M>
__device__ __forceinline__ void smx_fold_hide(Chunk<T>& c, const MaskChunk<M, Chunk<T>::N>& m) {
  enum { N = Chunk<T>::N };
  if constexpr (sizeof(typename M::S) == 1) {
    smx_u32 t[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) t[i] = m.b.w[i] | ((m.b.w[i] & 0x7f7f7f7fu) + 0x7f7f7f7fu);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      smx_u32 h;
      asm("prmt.b32 %0, %1, 0, %2;" : "=r"(h) : "r"(t[i >> 1]), "r"((i & 1) ? 0xbbaau : 0x9988u));
      c.w[i] = smx_neg_inf_where<T>(c.w[i], h);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (m.e[e] != 0) c.e[e].bits = (smx_u16)SmxNegInf2<T>::V;
  }
}
// The step's chunks with their hidden elements -inf (smx_fold_hide).
template <typename T, class M, int K>
__device__ __forceinline__ void smx_fold_hidden(Chunk<T> (&c)[K], const Chunk<T> (&cx)[1][K],
                                                const MaskChunk<M, Chunk<T>::N> (&cm)[1][K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    c[k] = cx[0][k];
    smx_fold_hide<T, M>(c[k], cm[0][k]);
  }
}
// The terms of a step's chunks, a sum per chunk: one FMA a term (FMA: exp2(x * scale * log2e -
// ml), ml = max * log2e one rounded float) or exact (smx_term).
template <bool FMA, typename T, int K>
__device__ __forceinline__ void smx_fold_terms(float (&t)[K], const Chunk<T> (&c)[K], float scale, float sl, float mu,
                                               float ml) {
  enum { N = Chunk<T>::N };
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float u[N];
    smx_chunk_f32<T>(c[k], u);
    t[k] = 0.0f;
    // (x * scale overflowing to +inf, x finite, makes the row NaN, as the general path does)
#pragma unroll
    for (int e = 0; e < N; ++e) t[k] += FMA ? smx_exp2(fmaf(u[e], sl, -ml)) : smx_term(u[e] * scale, mu);
  }
}
// PAIR of a folded interior step with a hiding mask: merged into (m, s).  Where the step's
// max is below SMX_FOLD_MAX, each term takes one FMA, off by less than 2^-14 relative (as
// the folded STORE's); above it the exact terms.  smx_fold_pair_chunks: on the step's
// chunks with their hidden elements already -inf (smx_fold_hidden); smx_fold_pair_hidden:
// from the raw chunks and the mask.
template <typename T, int K>
__device__ __forceinline__ void smx_fold_pair_chunks(float& m, float& s, const Chunk<T> (&c)[K], float scale,
                                                     float sl) {
  const float mx = smx_fold_max<T, K>(c) * scale;
  const float mu = smx_max_use(mx);
  float t[K];  // a sum per chunk, then over the chunks
  if (fabsf(mu) < SMX_FOLD_MAX) {
    smx_fold_terms<true, T, K>(t, c, scale, sl, mu, mu * SMX_LOG2E);
  } else {
    smx_fold_terms<false, T, K>(t, c, scale, sl, mu, 0.0f);
  }
#pragma unroll
  for (int k = 1; k < K; ++k) t[0] += t[k];
  smx_pair_merge(m, s, mx, t[0]);
}
template <typename T, class M, int K>
__device__ __forceinline__ void smx_fold_pair_hidden(float& m, float& s, const Chunk<T> (&cx)[1][K],
                                                     const MaskChunk<M, Chunk<T>::N> (&cm)[1][K], float scale,
                                                     float sl) {
  Chunk<T> c[K];
  smx_fold_hidden<T, M, K>(c, cx, cm);
  smx_fold_pair_chunks<T, K>(m, s, c, scale, sl);
}
// STORE of folded chunks c + k * B (k < K) of row y, one chunk at a time (as smx_fold_store).
template <typename T, int K, int B>
__device__ __forceinline__ void smx_fold_store_chunks(const Chunk<T> (&h)[K], T* y, int c, int ofs, float sl,
                                                      float mls) {
  enum { N = Chunk<T>::N };
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float u[N];
    smx_chunk_f32<T>(h[k], u);
#pragma unroll
    for (int e = 0; e < N; ++e) u[e] = smx_exp2(fmaf(u[e], sl, -mls));
    smx_st16(y + (c + k * B) * N - ofs, smx_pack_chunk<T>(u));
  }
}
// STORE of a folded interior step with a hiding mask (as smx_fold_store).
template <typename T, class M, int K, int B>
__device__ __forceinline__ void smx_fold_store_hidden(const Chunk<T> (&cx)[1][K],
                                                      const MaskChunk<M, Chunk<T>::N> (&cm)[1][K], T* y, int c, int ofs,
                                                      float sl, float mls) {
  Chunk<T> h[K];
  smx_fold_hidden<T, M, K>(h, cx, cm);
  smx_fold_store_chunks<T, K, B>(h, y, c, ofs, sl, mls);
}
// x as floats and their max (no mask).
template <typename T, int K>
__device__ __forceinline__ float smx_fold_raw(float (&u)[K][Chunk<T>::N], const Chunk<T> (&cx)[1][K]) {
  enum { N = Chunk<T>::N };
  float mk[K];  // a max per chunk, then over the chunks: K chains side by side
#pragma unroll
  for (int k = 0; k < K; ++k) {
    smx_chunk_f32<T>(cx[0][k], u[k]);
    mk[k] = -SMX_INF;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      mk[k] = fmaxf(mk[k], u[k][e]);
    }
  }
#pragma unroll
  for (int k = 1; k < K; ++k) mk[0] = fmaxf(mk[0], mk[k]);
  return mk[0];
}
// PAIR of a folded interior step: merged into (m, s).  With a hiding mask, the mask in x's
// bits, the max over pairs and one FMA a term (smx_fold_pair_hidden); without one, the exact
// terms (on the H200 the one-FMA terms and the max over pairs were slower there: fp16 rows
// of 262144 keys 90 -> 83% of copy, with a bool mask 70 -> 72).
template <typename T, class M, int K>
__device__ __forceinline__ void smx_fold_pair(float& m, float& s, const Chunk<T> (&cx)[1][K],
                                              const MaskChunk<M, Chunk<T>::N> (&cm)[1][K], float scale, float sl) {
  enum { N = Chunk<T>::N };
  if constexpr (!SmxFold<T, M>::ON) {
    return;  // (never called: the callers fold only where SmxFold is on)
  } else if constexpr (M::PRESENT) {
    smx_fold_pair_hidden<T, M, K>(m, s, cx, cm, scale, sl);
  } else {
    float u[K][N];
    const float mx = smx_fold_raw<T, K>(u, cx) * scale;
    const float mu = smx_max_use(mx);
    float t[K];  // a sum per chunk, then over the chunks
#pragma unroll
    for (int k = 0; k < K; ++k) {
      t[k] = 0.0f;
      // (x * scale overflowing to +inf, x finite, makes the row NaN, as the general path does)
#pragma unroll
      for (int e = 0; e < N; ++e) t[k] += smx_term(u[k][e] * scale, mu);
    }
#pragma unroll
    for (int k = 1; k < K; ++k) t[0] += t[k];
    smx_pair_merge(m, s, mx, t[0]);
  }
}
// STORE of a folded interior step: chunks c + k * B (k < K) of row y; mls = max * log2e +
// log2(sum), sum > 0.
template <typename T, class M, int K, int B>
__device__ __forceinline__ void smx_fold_store(const Chunk<T> (&cx)[1][K], const MaskChunk<M, Chunk<T>::N> (&cm)[1][K],
                                               T* y, int c, int ofs, float sl, float mls) {
  enum { N = Chunk<T>::N };
  if constexpr (!SmxFold<T, M>::ON) {
    return;  // (as smx_fold_pair)
  } else if constexpr (M::PRESENT) {
    smx_fold_store_hidden<T, M, K, B>(cx, cm, y, c, ofs, sl, mls);
  } else {
    float u[K][N];
    smx_fold_raw<T, K>(u, cx);
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < N; ++e) u[k][e] = smx_exp2(fmaf(u[k][e], sl, -mls));
      smx_st16(y + (c + k * B) * N - ofs, smx_pack_chunk<T>(u[k]));
    }
  }
}
// Chunks per thread past the R in registers of each of `blocks` blocks sharing a row of
// `elems` elements (counted from the chunk grid's origin): `q_smem` where that holds the
// row (or blocks is 0: the coop tier), else the whole steps of U that do.
template <typename T>
__device__ __forceinline__ int smx_slice_steps(int elems, int blocks, int R, int q_smem) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  if (blocks <= 0) return q_smem;
  const int chunks = (elems + N - 1) / N;
  const int per_thread = (chunks + blocks * SMX_CBLOCK - 1) / (blocks * SMX_CBLOCK);
  const int q = (max(per_thread - R, 0) + U - 1) / U * U;
  return max(q, q_smem);
}

// Chunks [base, base + K * B) all whole and visible.
template <class Row>  // (FwdRow or BwdRow)
__device__ __forceinline__ bool smx_interior(const Row& r, int base, int kb) {
  return base >= r.c0 && base + kb <= r.c1;
}

// One step of PAIR: this thread's U chunks of x (and the mask), at chunks cs + tid + k *
// SMX_CBLOCK (cs: the step's first chunk), merged into (m, s); a folded interior step where
// `fold` allows (as smx_fwd_slice's register chunks).
template <typename T, class M>
__device__ __forceinline__ void smx_cl_pair_step(float& m, float& s, const Chunk<T> (&cx)[1][SMX_CL_U],
                                                 const MaskChunk<M, Chunk<T>::N> (&cm)[1][SMX_CL_U],
                                                 const FwdRow<T, M> (&rw)[1], int cs, int tid, bool fold, float scale,
                                                 float sl) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  if (fold && smx_interior(rw[0], cs, U * SMX_CBLOCK)) {
    smx_fold_pair<T, M, U>(m, s, cx, cm, scale, sl);
    return;
  }
  float v[1][U][N], mx[1];
  smx_fwd_values<T, M, U, 1, false>(v, mx, cx, cm, rw, cs + tid, SMX_CBLOCK, scale);
  const float mu = smx_max_use(mx[0]);
  float t = 0.0f;
#pragma unroll
  for (int k = 0; k < U; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) t += smx_term(v[0][k][e], mu);
  smx_pair_merge(m, s, mx[0], t);
}
// One step of STORE: y of this thread's U chunks at cs + tid + k * SMX_CBLOCK; mu, inv: the
// row's max in use and 1 / sum; a folded interior step where `sfold` allows (mls as
// smx_fold_store's).
template <typename T, class M>
__device__ __forceinline__ void smx_cl_store_step(const Chunk<T> (&cx)[1][SMX_CL_U],
                                                  const MaskChunk<M, Chunk<T>::N> (&cm)[1][SMX_CL_U],
                                                  const FwdRow<T, M> (&rw)[1], const bool (&acts)[1], int cs, int tid,
                                                  const SmxFwdParams& p, bool sfold, float sl, float mls, float mu,
                                                  const float (&inv)[1]) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  const int c0 = cs + tid;
  if (sfold && smx_interior(rw[0], cs, U * SMX_CBLOCK)) {
    smx_fold_store<T, M, U, SMX_CBLOCK>(cx, cm, rw[0].y, c0, rw[0].ofs, sl, mls);
    return;
  }
  float v[1][U][N], mx[1];
  smx_fwd_values<T, M, U, 1, false>(v, mx, cx, cm, rw, c0, SMX_CBLOCK, p.scale);
#pragma unroll
  for (int k = 0; k < U; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) v[0][k][e] = smx_term(v[0][k][e], mu);
  smx_fwd_store<T, M, U, 1, false>(v, inv, rw, acts, c0, SMX_CBLOCK, p);
}

// x-held slices (XS, smx_fwd_cluster_xs: 16-bit x with a hiding mask, cluster tier): shared
// memory holds x alone, the mask is read from global memory.  PAIR reads it once, and each
// folded interior step writes its chunks back with the hidden elements made -inf in x's
// bits (smx_fold_hide), so that STORE's folded steps need no mask (2^-inf is 0); steps
// STORE does not fold read the mask again.  A row's mask is so read once, where slices of
// x beside the mask take a third more shared memory: fp16 rows of 1M keys with a bool mask
// are held by 16 CTAs of 112 KB (two per SM) instead of 168 KB.
// The mask of one step's U chunks, from global memory: an interior step's whole, any other
// as the tier's LOAD reads it (its reads of x go unused, and the compiler drops them).
template <typename T, class M>
__device__ __forceinline__ void smx_xs_mask(MaskChunk<M, Chunk<T>::N> (&cm)[1][SMX_CL_U], const FwdRow<T, M> (&rw)[1],
                                            int cs, int tid, const SmxFwdParams& p, const T* x,
                                            const typename M::S* m0) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  if (smx_interior(rw[0], cs, U * SMX_CBLOCK) && rw[0].mvec) {
#pragma unroll
    for (int k = 0; k < U; ++k) smx_load_bytes(cm[0][k].b, rw[0].m + (cs + tid + k * SMX_CBLOCK) * N - rw[0].ofs);
    return;
  }
  Chunk<T> cx[1][U];
  smx_fwd_load<T, M, U, 1, false>(cx, cm, rw, cs + tid, SMX_CBLOCK, p, x, m0);
}
// One step of PAIR (as smx_cl_pair_step) on x from the thread's slots `xq` (the step's
// first chunk, then every SMX_CBLOCK: LOAD put every chunk there, an edge chunk as the
// tier's LOAD reads it) and the step's mask `cm`; a folded interior step's hidden chunks
// written back to `xq`.
template <typename T, class M>
__device__ __forceinline__ void smx_xs_pair_step(float& m, float& s, Chunk<T>* xq,
                                                 const MaskChunk<M, Chunk<T>::N> (&cm)[1][SMX_CL_U],
                                                 const FwdRow<T, M> (&rw)[1], int cs, int tid, const SmxFwdParams& p,
                                                 bool fold, float sl) {
  enum { U = SMX_CL_U };
  Chunk<T> cx[1][U];
#pragma unroll
  for (int k = 0; k < U; ++k) cx[0][k] = xq[k * SMX_CBLOCK];
  if (fold && smx_interior(rw[0], cs, U * SMX_CBLOCK)) {
    Chunk<T> c[U];
    smx_fold_hidden<T, M, U>(c, cx, cm);
#pragma unroll
    for (int k = 0; k < U; ++k) xq[k * SMX_CBLOCK] = c[k];
    smx_fold_pair_chunks<T, U>(m, s, c, p.scale, sl);
    return;
  }
  smx_cl_pair_step<T, M>(m, s, cx, cm, rw, cs, tid, false, p.scale, sl);
}
// One step of STORE (as smx_cl_store_step): a folded step (sfold: PAIR folded it too) from
// the hidden chunks alone, any other with the mask read again.
template <typename T, class M>
__device__ __forceinline__ void smx_xs_store_step(const Chunk<T>* xq, const FwdRow<T, M> (&rw)[1],
                                                  const bool (&acts)[1], int cs, int tid, const SmxFwdParams& p,
                                                  const T* x, const typename M::S* m0, bool sfold, float sl, float mls,
                                                  float mu, const float (&inv)[1]) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  Chunk<T> cx[1][U];
#pragma unroll
  for (int k = 0; k < U; ++k) cx[0][k] = xq[k * SMX_CBLOCK];
  if (sfold && smx_interior(rw[0], cs, U * SMX_CBLOCK)) {
    smx_fold_store_chunks<T, U, SMX_CBLOCK>(cx[0], rw[0].y, cs + tid, rw[0].ofs, sl, mls);
    return;
  }
  MaskChunk<M, N> cm[1][U];
  smx_xs_mask<T, M>(cm, rw, cs, tid, p, x, m0);
  smx_cl_store_step<T, M>(cx, cm, rw, acts, cs, tid, p, false, sl, mls, mu, inv);
}

// ---------------------------------------------------------------------------------
// A block's slice of one row: chunks rank * K * B .. of row `row` (see the top), its pair
// exchanged with the row's other blocks through `xc`.  `act`: the row exists (coop blocks
// of a wave past the last row only take part in the exchange).
template <typename T, class M, int R, class X, bool STREAM = false, bool XS = false>
__device__ __forceinline__ void smx_fwd_slice(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
                                              const void* __restrict__ klen, const SmxFwdParams& p, smx_i64 row,
                                              bool act, int rank, const X& xc, float (*red)[SMX_CBLOCK / 32],
                                              float* pair) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  typedef MaskChunk<M, N> MC;
  static_assert(!XS || (M::PRESENT && SmxFold<T, M>::ON && X::INTERIOR && !STREAM), "x-held slices");
  enum { XB = 16, MB = M::PRESENT && !XS ? (int)sizeof(MC) : 0 };  // bytes of a chunk in shared memory
  const int tid = threadIdx.x;
  // Q from the dynamic shared memory size (whole steps only: a size the driver rounds up
  // changes nothing), then the slots of the slice held there.
  const int q_smem = (int)(smx_dyn_smem_size() / ((XB + MB) * SMX_CBLOCK * U)) * U;
  const int slots = q_smem * SMX_CBLOCK;
  Chunk<T>* xs = (Chunk<T>*)smx_cl_dyn;
  MC* ms = (MC*)(smx_cl_dyn + (smx_u64)slots * XB);

  FwdRow<T, M> rw[1];
  rw[0] = smx_fwd_row<T, M, false>(x, y, mask, klen, p, row);
  // Chunks per thread of the slice: Q in shared memory, then, where the row needs more than
  // the cluster's registers and shared memory hold (the launch gave less shared memory than
  // the row: STREAM), steps read from global memory in PAIR and again, from L2 by then, in
  // STORE.  A launch whose shared memory holds the row never streams.
  const int q_count = STREAM ? smx_slice_steps<T>(p.sk + rw[0].ofs, xc.blocks(), R, q_smem) : q_smem;
  const int cb = rank * ((q_count + R) * SMX_CBLOCK);  // first chunk of this block's slice
  const int cq = cb + R * SMX_CBLOCK;                  // its first chunk past the registers
  const typename M::S* m0 = (const typename M::S*)mask;

  // The first R chunks of each thread stay in registers (the tier's LOAD), in flight while
  // the copies below are issued.
  enum { RR = R > 0 ? R : 1 };
  Chunk<T> cxr[1][RR];
  MC cmr[1][RR];
  if (R > 0) smx_fwd_load<T, M, RR, 1, false>(cxr, cmr, rw, cb + tid, SMX_CBLOCK, p, x, m0);

  // LOAD: everything in flight; whole aligned chunks without registers.  Committed in
  // parts, so that PAIR starts on the first part while the others still arrive.
  const int steps = q_smem / U;
  // Shared addresses of this thread's first slots; in the cluster tier a step of whole
  // visible chunks (and mask chunks read whole) is U copies at fixed offsets from them,
  // without checks (measured on the H200, % of copy: fp16 rows of 65536 keys with a bool
  // mask 77 -> 80; the coop tier keeps the per-chunk path: its loop over waves spilled).
  const smx_u32 xs_a = smx_smem_addr(xs) + tid * XB;
  const smx_u32 ms_a = smx_smem_addr(ms) + tid * MB;
  const bool mwhole = MB == 0 || rw[0].mvec;
  // BULK: each part's whole visible chunks by one bulk copy per operand, issued first by
  // thread 0 (bit g of `bulk`: part g's are on their way); the threads load the rest of
  // the slice (its ends, and parts whose mask a bulk copy cannot take) themselves.
  int bulk = 0;
  if constexpr (X::BULK) {
    if (mwhole)
      bulk = smx_bulk_parts<N, XB, MB>(xc, steps, cq, rw[0].c0, rw[0].c1, rw[0].ofs, smx_smem_addr(xs), rw[0].x,
                                       smx_smem_addr(ms), rw[0].m);
  }
#pragma unroll 1
  for (int g = 0; g < X::PARTS; ++g) {
    const bool gb = (bulk >> g) & 1;  // part g's whole visible chunks come by bulk copy
#pragma unroll 1
    for (int st = smx_part_begin<X::PARTS>(g, steps); st < smx_part_begin<X::PARTS>(g + 1, steps); ++st) {
      const int cs0 = cq + st * U * SMX_CBLOCK;  // the step's first chunk
      if (X::INTERIOR && mwhole && smx_interior(rw[0], cs0, U * SMX_CBLOCK)) {
        if (gb) continue;  // (the bulk copy brings the step: gb needs the cluster tier and mwhole)
        const int j0 = (cs0 + tid) * N - rw[0].ofs;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          smx_cp16a(xs_a + (st * U + u) * SMX_CBLOCK * XB, rw[0].x + j0 + u * SMX_CBLOCK * N);
          if (MB > 0)
            smx_cp_bytes_a<N * (int)sizeof(typename M::S)>(ms_a + (st * U + u) * SMX_CBLOCK * MB,
                                                           rw[0].m + j0 + u * SMX_CBLOCK * N);
        }
        continue;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int q = st * U + u;
        const int c = cq + q * SMX_CBLOCK + tid;
        const int slot = q * SMX_CBLOCK + tid;
        const int j0 = c * N - rw[0].ofs;
        if (smx_in(c, rw[0].c0, rw[0].c1)) {
          if (gb) continue;  // (the bulk copy brings it)
          smx_cp16(&xs[slot], rw[0].x + j0);
          if (MB > 0) {
            if (rw[0].mvec) {
              smx_cp_bytes<N * (int)sizeof(typename M::S)>(&ms[slot], rw[0].m + j0);
            } else {
              MC cm;
              smx_gather<sizeof(typename M::S), N * (int)sizeof(typename M::S) / 4>(cm.b.w, rw[0].m, p.sm, j0,
                                                                                   rw[0].lim, N);
              ms[slot] = cm;
            }
          }
        } else if (j0 < rw[0].lim && j0 + N > 0) {
          Chunk<T> cx[1][1];
          MC cm[1][1];
          smx_fwd_load<T, M, 1, 1, false>(cx, cm, rw, c, SMX_CBLOCK, p, x, m0);
          xs[slot] = cx[0][0];
          if (MB > 0) ms[slot] = cm[0][0];
        }
      }
    }
    smx_cp_commit();  // part g: one group (possibly empty)
  }

  // PAIR: this thread's (max, sum), a step of U chunks at a time (merged as they come),
  // then the warp's, the block's, the row's.
  float m = -SMX_INF, s = 0.0f;
  // Folded interior steps (see SmxFold) in the cluster tier only: in the coop tier's loop
  // over waves they cost registers, up to spills.
  const float sl = p.scale * SMX_LOG2E;
  const bool fold = X::INTERIOR && SmxFold<T, M>::ON && sl > 0.0f && sl < SMX_INF;
  if (R > 0 && fold && smx_interior(rw[0], cb, R * SMX_CBLOCK)) {
    smx_fold_pair<T, M, RR>(m, s, cxr, cmr, p.scale, sl);
  } else if (R > 0) {
    float v[1][RR][N], mx[1];
    smx_fwd_values<T, M, RR, 1, false>(v, mx, cxr, cmr, rw, cb + tid, SMX_CBLOCK, p.scale);
    const float mu = smx_max_use(mx[0]);
#pragma unroll
    for (int k = 0; k < RR; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) s += smx_term(v[0][k][e], mu);
    m = mx[0];
  }
  // XS: the mask of the next SMX_XS_AHEAD steps in flight while a step is worked on.
  enum { XA = XS ? SMX_XS_AHEAD : 1 };
  MC ring[XA][1][U];
#pragma unroll
  for (int d = 0; d < XA; ++d)
    if (XS && d * U < q_smem) smx_xs_mask<T, M>(ring[d], rw, cq + d * U * SMX_CBLOCK, tid, p, x, m0);
#pragma unroll 1
  for (int g = 0; g < X::PARTS; ++g) {
    smx_cp_wait_parts_after<X::PARTS>(g);  // each thread reads back only the slots it filled
    if constexpr (X::BULK) {
      if (mwhole) smx_mbar_wait0(xc.part_bar(g));  // and the part's bulk copies
    }
#pragma unroll 1
    for (int q0 = smx_part_begin<X::PARTS>(g, steps) * U; q0 < smx_part_begin<X::PARTS>(g + 1, steps) * U; q0 += U) {
      if constexpr (XS) {
        MC cm[1][U];
#pragma unroll
        for (int k = 0; k < U; ++k) cm[0][k] = ring[0][0][k];
#pragma unroll
        for (int d = 0; d + 1 < XA; ++d)
#pragma unroll
          for (int k = 0; k < U; ++k) ring[d][0][k] = ring[d + 1][0][k];
        const int qn = q0 + XA * U;  // the step whose mask is read now
        if (qn < q_smem) smx_xs_mask<T, M>(ring[XA - 1], rw, cq + qn * SMX_CBLOCK, tid, p, x, m0);
        smx_xs_pair_step<T, M>(m, s, xs + q0 * SMX_CBLOCK + tid, cm, rw, cq + q0 * SMX_CBLOCK, tid, p, fold, sl);
        continue;
      }
      Chunk<T> cx[1][U];
      MC cm[1][U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        cx[0][k] = xs[(q0 + k) * SMX_CBLOCK + tid];
        if (M::PRESENT) cm[0][k] = ms[(q0 + k) * SMX_CBLOCK + tid];
      }
      smx_cl_pair_step<T, M>(m, s, cx, cm, rw, cq + q0 * SMX_CBLOCK, tid, fold, p.scale, sl);
    }
  }
  // STREAM: the steps past shared memory, loaded into registers (the tier's LOAD).
#pragma unroll 1
  for (int q0 = q_smem; STREAM && q0 < q_count; q0 += U) {
    Chunk<T> cx[1][U];
    MC cm[1][U];
    const int c0 = cq + q0 * SMX_CBLOCK + tid;
    smx_fwd_load<T, M, U, 1, false>(cx, cm, rw, c0, SMX_CBLOCK, p, x, m0);
    smx_cl_pair_step<T, M>(m, s, cx, cm, rw, cq + q0 * SMX_CBLOCK, tid, fold, p.scale, sl);
  }
  smx_warp_pair_merge(m, s);
  const int warp = tid >> 5;
  if ((tid & 31) == 0) {
    red[0][warp] = m;
    red[1][warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = (tid & 31) < SMX_CBLOCK / 32 ? red[0][tid] : -SMX_INF;
    s = (tid & 31) < SMX_CBLOCK / 32 ? red[1][tid] : 0.0f;
    smx_warp_pair_merge(m, s);
    if (tid == 0) {
      pair[0] = m;
      pair[1] = s;
    }
  }
  xc.template merge<false, T>(m, s, pair, rw[0].y, p.sy, rw[0].ofs, (q_count + R) * SMX_CBLOCK, act);

  // STORE.
  const float mu = smx_max_use(m);
  const float inv[1] = {smx_inv_sum(s)};
  const bool acts[1] = {act};
  // (a row with nothing visible stores zeros: 1 / sum is 0 there)
  const bool sfold = fold && s > 0.0f && fabsf(mu) < SMX_FOLD_MAX;
  const float mls = mu * SMX_LOG2E + smx_log2(s);
  // The streamed steps first, the last read first: what PAIR read last is likeliest in L2.
#pragma unroll 1
  for (int q0 = q_count - U; STREAM && q0 >= (act ? q_smem : q_count); q0 -= U) {
    Chunk<T> cx[1][U];
    MC cm[1][U];
    const int c0 = cq + q0 * SMX_CBLOCK + tid;
    smx_fwd_load<T, M, U, 1, false>(cx, cm, rw, c0, SMX_CBLOCK, p, x, m0);
    smx_cl_store_step<T, M>(cx, cm, rw, acts, cq + q0 * SMX_CBLOCK, tid, p, sfold, sl, mls, mu, inv);
  }
  if (R > 0 && act && sfold && smx_interior(rw[0], cb, R * SMX_CBLOCK)) {
    smx_fold_store<T, M, RR, SMX_CBLOCK>(cxr, cmr, rw[0].y, cb + tid, rw[0].ofs, sl, mls);
  } else if (R > 0) {
    float v[1][RR][N], mx[1];
    smx_fwd_values<T, M, RR, 1, false>(v, mx, cxr, cmr, rw, cb + tid, SMX_CBLOCK, p.scale);
#pragma unroll
    for (int k = 0; k < RR; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) v[0][k][e] = smx_term(v[0][k][e], mu);
    smx_fwd_store<T, M, RR, 1, false>(v, inv, rw, acts, cb + tid, SMX_CBLOCK, p);
  }
  for (int q0 = 0; q0 < (act ? q_smem : 0); q0 += U) {
    if constexpr (XS) {
      smx_xs_store_step<T, M>(xs + q0 * SMX_CBLOCK + tid, rw, acts, cq + q0 * SMX_CBLOCK, tid, p, x, m0, sfold, sl,
                              mls, mu, inv);
      continue;
    }
    Chunk<T> cx[1][U];
    MC cm[1][U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      cx[0][k] = xs[(q0 + k) * SMX_CBLOCK + tid];
      if (M::PRESENT) cm[0][k] = ms[(q0 + k) * SMX_CBLOCK + tid];
    }
    smx_cl_store_step<T, M>(cx, cm, rw, acts, cq + q0 * SMX_CBLOCK, tid, p, sfold, sl, mls, mu, inv);
  }
  xc.finish();
}

// One streamed step: SMX_CL_U chunks of dy and y per thread at chunk c0, c0 + SMX_CBLOCK,
// ... read from global memory, their dot product added to `dot`, or dx stored.
template <typename T>
__device__ __forceinline__ void smx_bwd_stream_dot(float& dot, const BwdRow<T> (&rw)[1], int c0,
                                                   const SmxBwdParams& p, const T* dy, const T* y) {
  Chunk<T> cd[1][SMX_CL_U], cy[1][SMX_CL_U];
  float t[1];
  smx_bwd_load<T, SMX_CL_U, 1, false>(cd, cy, rw, c0, SMX_CBLOCK, p, dy, y);
  smx_bwd_dot<T, SMX_CL_U, 1, false>(t, cd, cy, rw, c0, SMX_CBLOCK, p.sk);
  dot += t[0];
}
template <typename T>
__device__ __forceinline__ void smx_bwd_stream_store(const float (&dots)[1], const BwdRow<T> (&rw)[1], int c0,
                                                     const SmxBwdParams& p, const T* dy, const T* y) {
  Chunk<T> cd[1][SMX_CL_U], cy[1][SMX_CL_U];
  smx_bwd_load<T, SMX_CL_U, 1, false>(cd, cy, rw, c0, SMX_CBLOCK, p, dy, y);
  smx_bwd_store<T, SMX_CL_U, 1, false>(cd, cy, dots, rw, c0, SMX_CBLOCK, p);
}

// The backward's slice: as the forward's, dy and y in place of x and the mask; STREAM as
// there (the steps past shared memory read for the dot product and again for dx).
template <typename T, int R, class X, bool STREAM = false>
__device__ __forceinline__ void smx_bwd_slice(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                                              const SmxBwdParams& p, smx_i64 row, int rank, const X& xc, float* red,
                                              float* pair) {
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  const int tid = threadIdx.x;
  const int q_smem = (int)(smx_dyn_smem_size() / (32 * SMX_CBLOCK * U)) * U;  // as forward
  const int slots = q_smem * SMX_CBLOCK;  // chunks of dy and of y
  Chunk<T>* ds = (Chunk<T>*)smx_cl_dyn;
  Chunk<T>* ys = ds + slots;

  BwdRow<T> rw[1];
  rw[0] = smx_bwd_row<T, false>(dy, y, dx, p, row);
  const int q_count = STREAM ? smx_slice_steps<T>(p.sk + rw[0].ofs, xc.blocks(), R, q_smem) : q_smem;
  const int cb = rank * ((q_count + R) * SMX_CBLOCK);
  const int cq = cb + R * SMX_CBLOCK;
  const int sk = rw[0].act ? p.sk : 0;  // nothing of a row past the end is read
  const bool vec = (p.flags & SMX_F_VEC) != 0;
  enum { RR = R > 0 ? R : 1 };
  Chunk<T> cdr[1][RR], cyr[1][RR];
  if (R > 0) smx_bwd_load<T, RR, 1, false>(cdr, cyr, rw, cb + tid, SMX_CBLOCK, p, dy, y);

  const int steps = q_smem / U;
  int bulk = 0;  // as the forward's LOAD
  if constexpr (X::BULK)
    bulk = smx_bulk_parts<N, 16, 16>(xc, steps, cq, rw[0].c0, rw[0].c1, rw[0].ofs, smx_smem_addr(ds), rw[0].dy,
                                     smx_smem_addr(ys), rw[0].y);
#pragma unroll 1
  for (int g = 0; g < X::PARTS; ++g) {
    const bool gb = (bulk >> g) & 1;
#pragma unroll 1
    for (int st = smx_part_begin<X::PARTS>(g, steps); st < smx_part_begin<X::PARTS>(g + 1, steps); ++st) {
      const int cs0 = cq + st * U * SMX_CBLOCK;
      if (gb && smx_interior(rw[0], cs0, U * SMX_CBLOCK)) continue;  // all by bulk copy
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int q = st * U + u;
        const int c = cq + q * SMX_CBLOCK + tid;
        const int slot = q * SMX_CBLOCK + tid;
        const int j0 = c * N - rw[0].ofs;
        if (smx_in(c, rw[0].c0, rw[0].c1)) {
          if (gb) continue;
          smx_cp16(&ds[slot], rw[0].dy + j0);
          smx_cp16(&ys[slot], rw[0].y + j0);
        } else if (j0 < sk && j0 + N > 0) {
          Chunk<T> cd, cy;
          smx_load_chunk<T>(cd, rw[0].dy, p.sdy, j0, sk, vec, dy, p.span_dy);
          smx_load_chunk<T>(cy, rw[0].y, p.sy, j0, sk, vec, y, p.span_y);
          ds[slot] = cd;
          ys[slot] = cy;
        }
      }
    }
    smx_cp_commit();
  }

  float dot = 0.0f;
  if (R > 0) {
    float t[1];
    smx_bwd_dot<T, RR, 1, false>(t, cdr, cyr, rw, cb + tid, SMX_CBLOCK, p.sk);
    dot = t[0];
  }
#pragma unroll 1
  for (int g = 0; g < X::PARTS; ++g) {
    smx_cp_wait_parts_after<X::PARTS>(g);
    if constexpr (X::BULK) smx_mbar_wait0(xc.part_bar(g));
#pragma unroll 1
    for (int q0 = smx_part_begin<X::PARTS>(g, steps) * U; q0 < smx_part_begin<X::PARTS>(g + 1, steps) * U; q0 += U) {
      Chunk<T> cd[1][U], cy[1][U];
      float t[1];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        cd[0][k] = ds[(q0 + k) * SMX_CBLOCK + tid];
        cy[0][k] = ys[(q0 + k) * SMX_CBLOCK + tid];
      }
      smx_bwd_dot<T, U, 1, false>(t, cd, cy, rw, cq + q0 * SMX_CBLOCK + tid, SMX_CBLOCK, p.sk);
      dot += t[0];
    }
  }
  // STREAM: the steps past shared memory, loaded into registers.
#pragma unroll 1
  for (int qs = q_smem; STREAM && qs < q_count; qs += U)
    smx_bwd_stream_dot<T>(dot, rw, cq + qs * SMX_CBLOCK + tid, p, dy, y);
  dot = smx_warp_sum(dot);
  const int warp = tid >> 5;
  if ((tid & 31) == 0) red[warp] = dot;
  __syncthreads();
  if (warp == 0) {
    float t = (tid & 31) < SMX_CBLOCK / 32 ? red[tid] : 0.0f;
    t = smx_warp_sum(t);
    dot = t;  // the cluster's exchange takes the block's sum from warp 0's lanes
    if (tid == 0) {
      pair[0] = 0.0f;
      pair[1] = t;
    }
  }
  float m;
  xc.template merge<true, T>(m, dot, pair, rw[0].dx, p.sdx, rw[0].ofs, (q_count + R) * SMX_CBLOCK, rw[0].act);

  const float dots[1] = {dot};
  // The streamed steps first, the last read first (as forward).
  const int lo = rw[0].act ? q_smem : q_count;
#pragma unroll 1
  for (int qs = q_count - U; STREAM && qs >= lo; qs -= U)
    smx_bwd_stream_store<T>(dots, rw, cq + qs * SMX_CBLOCK + tid, p, dy, y);
  if (R > 0) smx_bwd_store<T, RR, 1, false>(cdr, cyr, dots, rw, cb + tid, SMX_CBLOCK, p);
  for (int q0 = 0; q0 < (rw[0].act ? q_smem : 0); q0 += U) {
    Chunk<T> cd[1][U], cy[1][U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      cd[0][k] = ds[(q0 + k) * SMX_CBLOCK + tid];
      cy[0][k] = ys[(q0 + k) * SMX_CBLOCK + tid];
    }
    smx_bwd_store<T, U, 1, false>(cd, cy, dots, rw, cq + q0 * SMX_CBLOCK + tid, SMX_CBLOCK, p);
  }
  xc.finish();
}

// ---------------------------------------------------------------------------------
// Kernels.  Cluster tier: grid rows * CS in clusters of CS (sm_90+).  Coop tier: grid
// (G, groups), all blocks co-resident (cooperative launch); group g takes rows g,
// g + groups, ...
// CTAs per SM the forward's registers are held to: three (80 registers; the fp32 forward
// with a bool mask took 88 and two CTAs otherwise), but two where a mask of 8-byte elements
// or an fp32 forward with an additive mask would spill at 80.  Tried and not kept: four
// CTAs per SM for the forward without a mask (64 registers, no spill; the slices of 48 KB
// the planner gives rows of 65536 and 262144 keys fit four): on the H200, % of copy, fp16
// 65536 keys 89.3 -> 89.1, 262144 88.8 -> 88.6, fp32 65536 88.1 -> 89.0, 262144 86.0 ->
// 85.6 (three rounds each): occupancy does not bound these rows.
template <typename T, class M> struct SmxClusterFwdBlocks {
  enum { V = sizeof(typename M::S) == 8 || (sizeof(T) == 4 && M::PRESENT && !M::HIDE) ? 2 : 3 };
};
#if __CUDA_ARCH__ >= 900
// A cluster kernel's body: the block's slice of row blockIdx.x / CS, the exchange set up.
template <typename T, class M, int R, bool STREAM, bool XS = false>
__device__ __forceinline__ void smx_fwd_cluster_body(const T* __restrict__ x, T* __restrict__ y,
                                                     const void* __restrict__ mask, const void* __restrict__ klen,
                                                     const SmxFwdParams& p) {
  __shared__ float red[2][SMX_CBLOCK / 32];
  __shared__ float pair[2];
  __shared__ SmxClusterShared xs;
  const SmxClusterX xc = {smx_cluster_size(), smx_cluster_rank(), &xs};
  xc.start();
  smx_fwd_slice<T, M, R, SmxClusterX, STREAM, XS>(x, y, mask, klen, p, (smx_i64)(blockIdx.x / xc.cs), true,
                                                  (int)xc.rank, xc, red, pair);
}
template <typename T, int R, bool STREAM>
__device__ __forceinline__ void smx_bwd_cluster_body(const T* __restrict__ dy, const T* __restrict__ y,
                                                     T* __restrict__ dx, const SmxBwdParams& p) {
  __shared__ float red[SMX_CBLOCK / 32];
  __shared__ float pair[2];
  __shared__ SmxClusterShared xs;
  const SmxClusterX xc = {smx_cluster_size(), smx_cluster_rank(), &xs};
  xc.start();
  smx_bwd_slice<T, R, SmxClusterX, STREAM>(dy, y, dx, p, (smx_i64)(blockIdx.x / xc.cs), (int)xc.rank, xc, red, pair);
}
#endif

template <typename T, class M, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, (SmxClusterFwdBlocks<T, M>::V))
smx_fwd_cluster(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
                const void* __restrict__ klen, const SmxFwdParams p) {
#if __CUDA_ARCH__ >= 900
  smx_fwd_cluster_body<T, M, R, false>(x, y, mask, klen, p);
#endif
}

// The same with x alone in shared memory, the mask read from global memory (smx_fwd_slice's
// XS: 16-bit x with a hiding mask).
template <typename T, class M, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, SMX_XS_BLOCKS)
smx_fwd_cluster_xs(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
                   const void* __restrict__ klen, const SmxFwdParams p) {
#if __CUDA_ARCH__ >= 900
  smx_fwd_cluster_body<T, M, R, false, true>(x, y, mask, klen, p);
#endif
}

// The same with a slice longer than its shared memory: the steps past it streamed (read in
// PAIR and again in STORE; smx_fwd_slice's STREAM), for rows no cluster holds on chip.
template <typename T, class M, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_fwd_cluster_stream(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
                       const void* __restrict__ klen, const SmxFwdParams p) {
#if __CUDA_ARCH__ >= 900
  smx_fwd_cluster_body<T, M, R, true>(x, y, mask, klen, p);
#endif
}

template <typename T, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_bwd_cluster(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p) {
#if __CUDA_ARCH__ >= 900
  smx_bwd_cluster_body<T, R, false>(dy, y, dx, p);
#endif
}

// The same with a slice longer than its shared memory: the steps past it streamed
// (smx_bwd_slice's STREAM), for rows no cluster holds on chip.
template <typename T, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_bwd_cluster_stream(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p) {
#if __CUDA_ARCH__ >= 900
  smx_bwd_cluster_body<T, R, true>(dy, y, dx, p);
#endif
}

template <typename T, class M, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_fwd_coop(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
             const void* __restrict__ klen, const SmxFwdParams p) {
  __shared__ float red[2][SMX_CBLOCK / 32];
  __shared__ float pair[2];
  const SmxCoopX xc;
  const smx_i64 groups = gridDim.y;
  const smx_i64 waves = (p.rows + groups - 1) / groups;
#pragma unroll 1
  for (smx_i64 w = 0; w < waves; ++w) {
    const smx_i64 row = blockIdx.y + w * groups;
    smx_fwd_slice<T, M, R>(x, y, mask, klen, p, row, row < p.rows, (int)blockIdx.x, xc, red, pair);
  }
}

template <typename T, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_bwd_coop(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p) {
  __shared__ float red[SMX_CBLOCK / 32];
  __shared__ float pair[2];
  const SmxCoopX xc;
  const smx_i64 groups = gridDim.y;
  const smx_i64 waves = (p.rows + groups - 1) / groups;
#pragma unroll 1
  for (smx_i64 w = 0; w < waves; ++w) {
    smx_bwd_slice<T, R>(dy, y, dx, p, blockIdx.y + w * groups, (int)blockIdx.x, xc, red, pair);
  }
}
