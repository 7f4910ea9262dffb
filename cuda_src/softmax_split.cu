// drvsoftmax long rows split over ordinary blocks: every byte read once, any architecture.
//
// Grid (S, G): block (seg, g) holds segment `seg` of rows g, g + G, ... (S segments of NCH
// chunks per thread each); the row's S blocks exchange their pairs through a workspace
// of 16-byte slots (one per row and segment, flags zeroed before the launch).  Per row:
//   LOAD + VALUES  the segment's chunks in registers (the register tier's steps), the
//                  terms relative to each warp's max, the block's (max, sum) pair;
//   PUBLISH        thread 0 writes the pair into the row's slot `seg` and sets its flag
//                  (a release store);
//   GATHER         warp 0 polls the row's S flags (acquire loads), then merges the S pairs
//                  in a fixed order: every block of the row gets the same bits;
//   STORE          y from the values held.
// Blocks of one row are launched next to each other (the segment is the grid's fastest
// index), so a row's slots fill within the time of its loads.  Nothing relies on the
// blocks being resident together: a block whose row is still incomplete after
// SMX_SPLIT_WAIT_NS (other work holding the GPU, say) computes the missing pairs itself
// from x, by the same steps and so to the same bits, publishes them, and loads its own
// segment again: slower, never stuck.
// Backward: dy and y held; the pair is the dot product sum(dy * y).
//
// Compiled after softmax_fwd.cu and softmax_bwd.cu (it uses their steps).
#include "softmax_common.cuh"

#define SMX_SPLIT_BLOCK 256  // threads of a split-tier block (_plan.BLOCK)
#define SMX_SPLIT_WAIT_NS 2000000ull

struct SmxSlot {
  float a, b;  // the pair: (max, sum) forward, (dot, 0) backward
  smx_u32 flag, pad;
};

__device__ __forceinline__ smx_u64 smx_now_ns() {
  smx_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void smx_slot_put(SmxSlot* s, float a, float b) {
  asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" ::"l"(&s->a), "f"(a) : "memory");
  asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" ::"l"(&s->b), "f"(b) : "memory");
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(&s->flag), "r"(1u) : "memory");
}
__device__ __forceinline__ bool smx_slot_ready(const SmxSlot* s) {
  smx_u32 f;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(f) : "l"(&s->flag) : "memory");
  return f != 0u;
}
__device__ __forceinline__ void smx_slot_get(const SmxSlot* s, float& a, float& b) {
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(a) : "l"(&s->a) : "memory");
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(b) : "l"(&s->b) : "memory");
}

// Warp 0: wait until all S slots are ready (lane i watches slots i, i + 32, ...), then
// merge them, every lane to the same bits; the result and whether the wait succeeded go
// to `shared` (3 floats) and from there to the whole block.  `patient`: no time limit.
template <bool SUM>
__device__ __forceinline__ bool smx_split_gather(const SmxSlot* slots, int S, float& m, float& s, float* shared,
                                                 bool patient) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int next = lane;
    const smx_u64 t0 = smx_now_ns();
    unsigned ns = 32;
    bool ok = true;
    for (;;) {
      while (next < S && smx_slot_ready(slots + next)) next += 32;
      if (__all_sync(0xffffffffu, next >= S)) break;
      if (!patient && smx_now_ns() - t0 > SMX_SPLIT_WAIT_NS) {
        ok = false;
        break;
      }
      __nanosleep(ns);
      ns = ns < 512 ? 2 * ns : ns;
    }
    float pm = SUM ? 0.0f : -SMX_INF, ps = 0.0f;
    if (ok) {
#pragma unroll 1
      for (int i = lane; i < S; i += 32) {
        float a, b;
        smx_slot_get(slots + i, a, b);
        if (SUM) {
          pm += a;
        } else {
          smx_pair_merge(pm, ps, a, b);
        }
      }
      if (SUM) {
        pm = smx_warp_sum(pm);
      } else {
        smx_warp_pair_merge(pm, ps);
      }
    }
    if (lane == 0) {
      shared[0] = pm;
      shared[1] = ps;
      shared[2] = ok ? 1.0f : 0.0f;
    }
  }
  __syncthreads();
  m = shared[0];
  s = shared[1];
  const bool ok = shared[2] != 0.0f;
  __syncthreads();  // (`shared` is written again for the next row)
  return ok;
}

// Whether slot j is ready, for the whole block.
__device__ __forceinline__ bool smx_split_have(const SmxSlot* slot, float* shared) {
  if (threadIdx.x == 0) shared[2] = smx_slot_ready(slot) ? 1.0f : 0.0f;
  __syncthreads();
  const bool have = shared[2] != 0.0f;
  __syncthreads();
  return have;
}

// LOAD and VALUES of a forward segment: v holds the terms relative to the warp's max mw;
// (bm, bs) the block's pair (every thread gets the same bits).
template <typename T, class M, int NCH>
__device__ __forceinline__ void smx_split_fwd_seg(float (&v)[1][NCH][Chunk<T>::N], float& mw, float& bm, float& bs,
                                                  const FwdRow<T, M> (&rw)[1], int c0, const SmxFwdParams& p,
                                                  const T* x, const void* mask, float (*red)[SMX_SPLIT_BLOCK / 32]) {
  enum { N = Chunk<T>::N, W = SMX_SPLIT_BLOCK / 32 };
  Chunk<T> cx[1][NCH];
  MaskChunk<M, N> cm[1][NCH];
  float mx[1];
  smx_fwd_load<T, M, NCH, 1, false>(cx, cm, rw, c0, SMX_SPLIT_BLOCK, p, x, (const typename M::S*)mask);
  smx_fwd_values<T, M, NCH, 1, false>(v, mx, cx, cm, rw, c0, SMX_SPLIT_BLOCK, p.scale);
  smx_warp_allreduce<OpMax, 1>(mx, 32);
  const float mu = smx_max_use(mx[0]);
  float s[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < NCH; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) {
      v[0][k][e] = smx_term(v[0][k][e], mu);
      s[0] += v[0][k][e];
    }
  smx_warp_allreduce<OpSum, 1>(s, 32);
  mw = mx[0];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    red[0][warp] = mw;
    red[1][warp] = s[0];
  }
  __syncthreads();
  bm = -SMX_INF;
#pragma unroll
  for (int i = 0; i < W; ++i) bm = fmaxf(bm, red[0][i]);
  bs = 0.0f;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const float si = red[1][i];
    // A warp that saw nothing visible adds nothing (its max may be -inf); NaN stays.
    if (si != 0.0f) bs += si * smx_term(smx_max_use(red[0][i]), smx_max_use(bm));
  }
  __syncthreads();  // (`red` is written again)
}

template <typename T, class M, int NCH>
__global__ void __launch_bounds__(SMX_SPLIT_BLOCK)
smx_fwd_split(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
              const void* __restrict__ klen, const SmxFwdParams p, SmxSlot* __restrict__ ws) {
  enum { N = Chunk<T>::N };
  __shared__ float red[2][SMX_SPLIT_BLOCK / 32];
  __shared__ float shared[3];
  const int S = (int)gridDim.x, seg = (int)blockIdx.x;
  const int c0 = seg * NCH * SMX_SPLIT_BLOCK + (int)threadIdx.x;
  const bool act[1] = {true};
#pragma unroll 1
  for (smx_i64 row = blockIdx.y; row < p.rows; row += gridDim.y) {
    FwdRow<T, M> rw[1];
    rw[0] = smx_fwd_row<T, M, false>(x, y, mask, klen, p, row);
    SmxSlot* slots = ws + row * S;
    // Normally one pass: this segment, its pair published, the row's pairs gathered.  A
    // block whose row is still incomplete after the wait computes each missing pair
    // itself (the same steps: the same bits) and publishes it, then this segment again
    // and waits without limit (every pair is then published).
    float v[1][NCH][N], mw, m, s;
    int todo = seg, j = 0;
    bool patient = false;
#pragma unroll 1
    for (;;) {
      float bm, bs;
      smx_split_fwd_seg<T, M, NCH>(v, mw, bm, bs, rw, todo * NCH * SMX_SPLIT_BLOCK + (int)threadIdx.x, p, x, mask,
                                   red);
      if (threadIdx.x == 0) smx_slot_put(slots + todo, bm, bs);
      if (todo == seg) {
        if (smx_split_gather<false>(slots, S, m, s, shared, patient)) break;
        patient = true;
      }
      while (j < S && (j == seg || smx_split_have(slots + j, shared))) ++j;
      todo = j < S ? j++ : seg;
    }
    // This warp's terms were taken relative to its own max.
    const float f = mw == -SMX_INF ? 0.0f : smx_term(smx_max_use(mw), smx_max_use(m));
    const float fac[1] = {f * smx_inv_sum(s)};
    smx_fwd_store<T, M, NCH, 1, false>(v, fac, rw, act, c0, SMX_SPLIT_BLOCK, p);
  }
}

// LOAD of a backward segment and the block's dot product (every thread the same bits).
template <typename T, int NCH>
__device__ __forceinline__ float smx_split_bwd_seg(Chunk<T> (&cd)[1][NCH], Chunk<T> (&cy)[1][NCH],
                                                   const BwdRow<T> (&rw)[1], int c0, const SmxBwdParams& p,
                                                   const T* dy, const T* y, float* red) {
  enum { W = SMX_SPLIT_BLOCK / 32 };
  smx_bwd_load<T, NCH, 1, false>(cd, cy, rw, c0, SMX_SPLIT_BLOCK, p, dy, y);
  float dot[1];
  smx_bwd_dot<T, NCH, 1, false>(dot, cd, cy, rw, c0, SMX_SPLIT_BLOCK, p.sk);
  smx_warp_allreduce<OpSum, 1>(dot, 32);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = dot[0];
  __syncthreads();
  float t = red[0];
#pragma unroll
  for (int i = 1; i < W; ++i) t += red[i];
  __syncthreads();
  return t;
}

template <typename T, int NCH>
__global__ void __launch_bounds__(SMX_SPLIT_BLOCK)
smx_bwd_split(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p,
              SmxSlot* __restrict__ ws) {
  __shared__ float red[SMX_SPLIT_BLOCK / 32];
  __shared__ float shared[3];
  const int S = (int)gridDim.x, seg = (int)blockIdx.x;
  const int c0 = seg * NCH * SMX_SPLIT_BLOCK + (int)threadIdx.x;
#pragma unroll 1
  for (smx_i64 row = blockIdx.y; row < p.rows; row += gridDim.y) {
    BwdRow<T> rw[1];
    rw[0] = smx_bwd_row<T, false>(dy, y, dx, p, row);
    SmxSlot* slots = ws + row * S;
    Chunk<T> cd[1][NCH], cy[1][NCH];
    float dot[1], unused;
    int todo = seg, j = 0;
    bool patient = false;
#pragma unroll 1
    for (;;) {  // (as the forward's)
      const float t =
          smx_split_bwd_seg<T, NCH>(cd, cy, rw, todo * NCH * SMX_SPLIT_BLOCK + (int)threadIdx.x, p, dy, y, red);
      if (threadIdx.x == 0) smx_slot_put(slots + todo, t, 0.0f);
      if (todo == seg) {
        if (smx_split_gather<true>(slots, S, dot[0], unused, shared, patient)) break;
        patient = true;
      }
      while (j < S && (j == seg || smx_split_have(slots + j, shared))) ++j;
      todo = j < S ? j++ : seg;
    }
    smx_bwd_store<T, NCH, 1, false>(cd, cy, dot, rw, c0, SMX_SPLIT_BLOCK, p);
  }
}
