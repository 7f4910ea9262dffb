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
//           thread owns to dynamic shared memory, raw, all in flight:
//           whole aligned chunks by cp.async (16 bytes, no registers held), the few others
//           (a row's first and last chunk, strided rows) through the register tier's LOAD;
//           committed in SMX_CL_PARTS groups, so that PAIR starts on the first part of the
//           slice while the rest still arrives;
//   PAIR    the thread's (max, sum) over its chunks (the register tier's VALUES), merged
//           over the warp, the CTA, then the cluster: each CTA publishes its pair in shared
//           memory, and after one cluster barrier (arrive.release / wait.acquire) every warp
//           reads all CS pairs through distributed shared memory (mapa + ld.shared::cluster)
//           and merges them in the same order, so every CTA holds the same row statistics;
//   STORE   y of the thread's chunks from shared memory (VALUES again, the tier's STORE).
// A CTA may not leave while another still reads its pair: a second cluster barrier is
// arrived at right after the reads and waited on before the CTA exits.
// Backward: dy and y held in shared memory alike; the pair is the dot product sum(dy * y).
//
// The dynamic shared memory size tells the kernel Q: Q * B * (bytes of a chunk of every
// operand held).  Q is a multiple of SMX_CL_U (chunks a thread handles per step), maybe 0.
//
// The bodies exist for sm_90+ only (clusters and distributed shared memory); on older
// architectures the kernels compile empty and the planner never picks them there.
//
// Compiled after softmax_fwd.cu and softmax_bwd.cu (the kernel set's main source includes
// the three in that order): it uses their row, LOAD, VALUES and STORE steps.
#include "softmax_common.cuh"

#define SMX_CBLOCK 256  // threads of a cluster-tier block (_plan.BLOCK)

#define SMX_CL_U 4  // chunks per thread per step of PAIR and STORE
// The slice is loaded in SMX_CL_PARTS parts, each a commit group of whole steps of U
// chunks: part g covers steps [smx_part_begin(g), smx_part_begin(g + 1)).
#define SMX_CL_PARTS 4

extern __shared__ __align__(16) unsigned char smx_cl_dyn[];

#if __CUDA_ARCH__ >= 900
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
// Cluster barrier: arrive releases this thread's prior writes (shared memory included) to
// the threads of the cluster that then wait (acquire).  Every thread of every CTA takes
// part, warps converged (.aligned).
__device__ __forceinline__ void smx_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void smx_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// Two floats at the shared-memory address of `p` in the CTA `rank` of this cluster.
__device__ __forceinline__ void smx_ld_cluster2(float& a, float& b, const void* p, smx_u32 rank) {
  smx_u32 ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(smx_smem_addr(p)), "r"(rank));
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(ra) : "memory");
}
// Asynchronous copies global -> shared (sm_80+): 16 bytes (L1 bypassed, L2 prefetch of
// the 256-byte sector group) or B = 4 / 8 bytes.
__device__ __forceinline__ void smx_cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(smx_smem_addr(dst)), "l"(src) : "memory");
}
template <int B> __device__ __forceinline__ void smx_cp_small(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smx_smem_addr(dst)), "l"(src), "n"(B) : "memory");
}
// B bytes (4 .. 64) from a min(B, 16)-aligned address.
template <int B> __device__ __forceinline__ void smx_cp_bytes(void* dst, const void* src) {
  if (B >= 16) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) smx_cp16((char*)dst + 16 * i, (const char*)src + 16 * i);
  } else {
    smx_cp_small<(B < 16 ? B : 8)>(dst, src);
  }
}
__device__ __forceinline__ int smx_part_begin(int g, int steps) { return g * steps / SMX_CL_PARTS; }
__device__ __forceinline__ void smx_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most G of this thread's committed groups are still in flight.
template <int G> __device__ __forceinline__ void smx_cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(G) : "memory");
}
__device__ __forceinline__ void smx_cp_wait_parts_after(int g) {  // part g has landed
  switch (SMX_CL_PARTS - 1 - g) {
    case 0: smx_cp_wait<0>(); break;
    case 1: smx_cp_wait<1>(); break;
    case 2: smx_cp_wait<2>(); break;
    default: smx_cp_wait<3>(); break;
  }
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

// The cluster-wide merge of this CTA's pair: `pair` (shared, 2 floats) must hold the CTA's
// pair, written before the call by one thread.  Returns the row's pair in every thread.
// Sums (backward) use m = 0 throughout: the merge then adds.
template <bool SUM>
__device__ __forceinline__ void smx_cluster_merge(float& m, float& s, const float* pair, smx_u32 cs) {
  smx_cluster_arrive();
  smx_cluster_wait();
  const smx_u32 lane = threadIdx.x & 31;
  m = SUM ? 0.0f : -SMX_INF;
  s = 0.0f;
  if (lane < cs) smx_ld_cluster2(m, s, pair, lane);
  if (SUM) {
    s = smx_warp_sum(s);
  } else {
    smx_warp_pair_merge(m, s);
  }
  smx_cluster_arrive();  // this CTA has read every pair: the others may leave once all have
}
#endif

template <typename T, class M, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_fwd_cluster(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
                const void* __restrict__ klen, const SmxFwdParams p) {
#if __CUDA_ARCH__ >= 900
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  typedef MaskChunk<M, N> MC;
  enum { XB = 16, MB = M::PRESENT ? (int)sizeof(MC) : 0 };
  __shared__ float red[2][SMX_CBLOCK / 32];
  __shared__ float pair[2];
  const int tid = threadIdx.x;
  const smx_u32 cs = smx_cluster_size();
  const smx_u32 rank = smx_cluster_rank();
  // Q from the dynamic shared memory size (whole steps only: a size the driver rounds up
  // changes nothing), then the slots of the slice held there.
  const int q_count = (int)(smx_dyn_smem_size() / ((XB + MB) * SMX_CBLOCK * U)) * U;
  const int slots = q_count * SMX_CBLOCK;
  Chunk<T>* xs = (Chunk<T>*)smx_cl_dyn;
  MC* ms = (MC*)(smx_cl_dyn + (smx_u64)slots * XB);
  const int cb = (int)rank * (slots + R * SMX_CBLOCK);  // first chunk of this CTA's slice
  const int cq = cb + R * SMX_CBLOCK;                    // its first chunk in shared memory

  FwdRow<T, M> rw[1];
  rw[0] = smx_fwd_row<T, M, false>(x, y, mask, klen, p, (smx_i64)(blockIdx.x / cs));
  const typename M::S* m0 = (const typename M::S*)mask;

  // The first R chunks of each thread stay in registers (the tier's LOAD), in flight while
  // the copies below are issued.
  enum { RR = R > 0 ? R : 1 };
  Chunk<T> cxr[1][RR];
  MC cmr[1][RR];
  if (R > 0) smx_fwd_load<T, M, RR, 1, false>(cxr, cmr, rw, cb + tid, SMX_CBLOCK, p, x, m0);

  // LOAD: everything in flight; whole aligned chunks without registers.  Committed in
  // parts, so that PAIR starts on the first part while the others still arrive.
  const int steps = q_count / U;
#pragma unroll 1
  for (int g = 0; g < SMX_CL_PARTS; ++g) {
#pragma unroll 1
    for (int st = smx_part_begin(g, steps); st < smx_part_begin(g + 1, steps); ++st) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int q = st * U + u;
        const int c = cq + q * SMX_CBLOCK + tid;
        const int slot = q * SMX_CBLOCK + tid;
        const int j0 = c * N - rw[0].ofs;
        if (smx_in(c, rw[0].c0, rw[0].c1)) {
          smx_cp16(&xs[slot], rw[0].x + j0);
          if (M::PRESENT) {
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
          if (M::PRESENT) ms[slot] = cm[0][0];
        }
      }
    }
    smx_cp_commit();  // part g: one group (possibly empty)
  }

  // PAIR: this thread's (max, sum), a step of U chunks at a time (merged as they come),
  // then the warp's, the CTA's, the row's.
  float m = -SMX_INF, s = 0.0f;
  if (R > 0) {
    float v[1][RR][N], mx[1];
    smx_fwd_values<T, M, RR, 1, false>(v, mx, cxr, cmr, rw, cb + tid, SMX_CBLOCK, p.scale);
    const float ml = smx_max_use(mx[0]) * SMX_LOG2E;
#pragma unroll
    for (int k = 0; k < RR; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) s += smx_exp2(fmaf(v[0][k][e], SMX_LOG2E, -ml));
    m = mx[0];
  }
#pragma unroll 1
  for (int g = 0; g < SMX_CL_PARTS; ++g) {
    smx_cp_wait_parts_after(g);  // each thread reads back only the slots it filled
#pragma unroll 1
    for (int q0 = smx_part_begin(g, steps) * U; q0 < smx_part_begin(g + 1, steps) * U; q0 += U) {
      Chunk<T> cx[1][U];
      MC cm[1][U];
      float v[1][U][N], mx[1];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        cx[0][k] = xs[(q0 + k) * SMX_CBLOCK + tid];
        if (M::PRESENT) cm[0][k] = ms[(q0 + k) * SMX_CBLOCK + tid];
      }
      smx_fwd_values<T, M, U, 1, false>(v, mx, cx, cm, rw, cq + q0 * SMX_CBLOCK + tid, SMX_CBLOCK, p.scale);
      const float ml = smx_max_use(mx[0]) * SMX_LOG2E;
      float t = 0.0f;
#pragma unroll
      for (int k = 0; k < U; ++k)
#pragma unroll
        for (int e = 0; e < N; ++e) t += smx_exp2(fmaf(v[0][k][e], SMX_LOG2E, -ml));
      smx_pair_merge(m, s, mx[0], t);
    }
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
  smx_cluster_merge<false>(m, s, pair, cs);

  // STORE.
  const float ml = smx_max_use(m) * SMX_LOG2E;
  const float inv[1] = {smx_inv_sum(s)};
  const bool act[1] = {true};
  if (R > 0) {
    float v[1][RR][N], mx[1];
    smx_fwd_values<T, M, RR, 1, false>(v, mx, cxr, cmr, rw, cb + tid, SMX_CBLOCK, p.scale);
#pragma unroll
    for (int k = 0; k < RR; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) v[0][k][e] = smx_exp2(fmaf(v[0][k][e], SMX_LOG2E, -ml));
    smx_fwd_store<T, M, RR, 1, false>(v, inv, rw, act, cb + tid, SMX_CBLOCK, p);
  }
  for (int q0 = 0; q0 < q_count; q0 += U) {
    Chunk<T> cx[1][U];
    MC cm[1][U];
    float v[1][U][N], mx[1];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      cx[0][k] = xs[(q0 + k) * SMX_CBLOCK + tid];
      if (M::PRESENT) cm[0][k] = ms[(q0 + k) * SMX_CBLOCK + tid];
    }
    const int c0 = cq + q0 * SMX_CBLOCK + tid;
    smx_fwd_values<T, M, U, 1, false>(v, mx, cx, cm, rw, c0, SMX_CBLOCK, p.scale);
#pragma unroll
    for (int k = 0; k < U; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) v[0][k][e] = smx_exp2(fmaf(v[0][k][e], SMX_LOG2E, -ml));
    smx_fwd_store<T, M, U, 1, false>(v, inv, rw, act, c0, SMX_CBLOCK, p);
  }
  smx_cluster_wait();  // no CTA leaves while another may still read its pair
#endif
}

template <typename T, int R>
__global__ void __launch_bounds__(SMX_CBLOCK, 2)
smx_bwd_cluster(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p) {
#if __CUDA_ARCH__ >= 900
  enum { N = Chunk<T>::N, U = SMX_CL_U };
  __shared__ float red[SMX_CBLOCK / 32];
  __shared__ float pair[2];
  const int tid = threadIdx.x;
  const smx_u32 cs = smx_cluster_size();
  const smx_u32 rank = smx_cluster_rank();
  const int q_count = (int)(smx_dyn_smem_size() / (32 * SMX_CBLOCK * U)) * U;  // as forward
  const int slots = q_count * SMX_CBLOCK;  // chunks of dy and of y
  Chunk<T>* ds = (Chunk<T>*)smx_cl_dyn;
  Chunk<T>* ys = ds + slots;
  const int cb = (int)rank * (slots + R * SMX_CBLOCK);
  const int cq = cb + R * SMX_CBLOCK;

  BwdRow<T> rw[1];
  rw[0] = smx_bwd_row<T, false>(dy, y, dx, p, (smx_i64)(blockIdx.x / cs));
  const bool vec = (p.flags & SMX_F_VEC) != 0;
  enum { RR = R > 0 ? R : 1 };
  Chunk<T> cdr[1][RR], cyr[1][RR];
  if (R > 0) smx_bwd_load<T, RR, 1, false>(cdr, cyr, rw, cb + tid, SMX_CBLOCK, p, dy, y);

  const int steps = q_count / U;
#pragma unroll 1
  for (int g = 0; g < SMX_CL_PARTS; ++g) {
#pragma unroll 1
    for (int st = smx_part_begin(g, steps); st < smx_part_begin(g + 1, steps); ++st) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int q = st * U + u;
        const int c = cq + q * SMX_CBLOCK + tid;
        const int slot = q * SMX_CBLOCK + tid;
        const int j0 = c * N - rw[0].ofs;
        if (smx_in(c, rw[0].c0, rw[0].c1)) {
          smx_cp16(&ds[slot], rw[0].dy + j0);
          smx_cp16(&ys[slot], rw[0].y + j0);
        } else if (j0 < p.sk && j0 + N > 0) {
          Chunk<T> cd, cy;
          smx_load_chunk<T>(cd, rw[0].dy, p.sdy, j0, p.sk, vec, dy, p.span_dy);
          smx_load_chunk<T>(cy, rw[0].y, p.sy, j0, p.sk, vec, y, p.span_y);
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
  for (int g = 0; g < SMX_CL_PARTS; ++g) {
    smx_cp_wait_parts_after(g);
#pragma unroll 1
    for (int q0 = smx_part_begin(g, steps) * U; q0 < smx_part_begin(g + 1, steps) * U; q0 += U) {
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
  dot = smx_warp_sum(dot);
  const int warp = tid >> 5;
  if ((tid & 31) == 0) red[warp] = dot;
  __syncthreads();
  if (warp == 0) {
    float t = (tid & 31) < SMX_CBLOCK / 32 ? red[tid] : 0.0f;
    t = smx_warp_sum(t);
    if (tid == 0) {
      pair[0] = 0.0f;
      pair[1] = t;
    }
  }
  float m;
  smx_cluster_merge<true>(m, dot, pair, cs);

  const float dots[1] = {dot};
  if (R > 0) smx_bwd_store<T, RR, 1, false>(cdr, cyr, dots, rw, cb + tid, SMX_CBLOCK, p);
  for (int q0 = 0; q0 < q_count; q0 += U) {
    Chunk<T> cd[1][U], cy[1][U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      cd[0][k] = ds[(q0 + k) * SMX_CBLOCK + tid];
      cy[0][k] = ys[(q0 + k) * SMX_CBLOCK + tid];
    }
    smx_bwd_store<T, U, 1, false>(cd, cy, dots, rw, cq + q0 * SMX_CBLOCK + tid, SMX_CBLOCK, p);
  }
  smx_cluster_wait();
#endif
}
