// drvsoftmax forward, the pipelined register tier: the register tier's rows on a persistent
// grid, the next rows' chunks in flight while a block works on its current ones.
//
// A block of smx_fwd's shape (tpr threads per row, rpb rows side by side, NCH chunks per
// thread, one row per thread group) takes row groups g = blockIdx.x, g + gridDim.x, ...
// (the grid is what the device holds at once).  Each thread owns NCH 16-byte slots of
// dynamic shared memory for x (and NCH for the mask's matching bytes), slot k of thread t at
// (k * blockDim.x + t) * bytes: it alone writes and reads them, so no barrier guards them.
//   LOAD   the group's chunks go to the thread's slots by asynchronous copies (no
//          registers held while they fly; keys past a row's visible prefix not read);
//   TAKE   once they have landed (the thread's own copies: cp.async.wait_group), the slots
//          into registers, raw, as smx_fwd's LOAD leaves them; then the next group's LOAD
//          into the same slots at once, in flight through everything below;
//   then the register tier's steps (smx_fwd_body: VALUES, the row's pair, STORE).
// TAKE's shared loads have read a slot before the next LOAD's copy into it lands: the copy
// writes its slot only when its global read returns, hundreds of cycles after the shared
// loads issued before it (a warp's shared-memory accesses are performed in order).
// The exchange of a row's warps goes through `red`, two sets used in turn: a warp can be a
// group ahead of another, never two (each group passes one barrier of the whole block).
// Whole-chunk rows only (AL; a slot never holds a partial chunk), 32-bit row maps only
// (fewer than 2^31 rows: no call to the 64-bit division in the loop).  Slots of chunks past
// the visible prefix keep an earlier row's bytes: VALUES hides every key there.
// Compiled after softmax_cluster.cu (its asynchronous-copy steps and dynamic shared memory).
#include "softmax_common.cuh"

template <int B> __device__ __forceinline__ void smx_lds_bytes(Bytes<B>& d, smx_u32 a) {
  if (B == 16) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d.w[0]), "=r"(d.w[1]), "=r"(d.w[2]), "=r"(d.w[3])
                 : "r"(a)
                 : "memory");
  } else if (B == 8) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(d.w[0]), "=r"(d.w[1]) : "r"(a) : "memory");
  } else {
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(d.w[0]) : "r"(a) : "memory");
  }
}

// LOAD of one row group: this thread's chunks of its row, raw, to its slots (one commit group).
template <typename T, class M, int NCH>
__device__ __forceinline__ void smx_pipe_load(const FwdRow<T, M>& r, int lane, int tpr, smx_u32 sx, smx_u32 sm,
                                              smx_u32 stx, smx_u32 stm) {
  enum { N = Chunk<T>::N, MB = N * (int)sizeof(typename M::S) };
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int j0 = (lane + k * tpr) * N;
    if (j0 < r.lim) {
      smx_cp16a(sx + k * stx, r.x + j0);
      if (M::PRESENT) smx_cp_bytes_a<MB>(sm + k * stm, r.m + j0);
    }
  }
  smx_cp_commit();
}

template <typename T, class M, int NCH>
__global__ void __launch_bounds__(SMX_BLOCK, NCH * Chunk<T>::N > SMX_HELD_VALUES ? SMX_LEAN_MIN_BLOCKS : 0)
smx_fwd_pipe(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask, const void* __restrict__ klen,
             const SmxFwdParams p) {
  enum { N = Chunk<T>::N, MB = N * (int)sizeof(typename M::S) };
  __shared__ float red[2][1][2][SMX_BLOCK / 32];
  smx_rows_of_block rb(p.tpr_log2);
  const int tpr = rb.tpr, lane = rb.lane, rpb = rb.rpb;
  const smx_i64 groups = (p.rows + rpb - 1) / rpb;
  const smx_u32 stx = blockDim.x * 16u, stm = blockDim.x * (smx_u32)MB;
  const smx_u32 sx = smx_smem_addr(smx_cl_dyn) + threadIdx.x * 16u;
  const smx_u32 sm = sx - threadIdx.x * 16u + NCH * stx + threadIdx.x * (smx_u32)MB;
  const smx_i64 first = blockIdx.x;
  smx_pipe_load<T, M, NCH>(smx_fwd_row<T, M, true, true>(x, y, mask, klen, p, first * rpb + rb.first_row), lane, tpr,
                           sx, sm, stx, stm);
  int it = 0;
  for (smx_i64 g = first; g < groups; g += gridDim.x, it ^= 1) {
    // This group's row and the next group's, found before any chunk is held (the next
    // group's LOAD goes out as soon as the slots are taken).
    const smx_i64 row = g * rpb + rb.first_row;
    FwdRow<T, M> rw[1] = {smx_fwd_row<T, M, true, true>(x, y, mask, klen, p, row)};
    const bool act[1] = {row < p.rows};
    const FwdRow<T, M> nx = smx_fwd_row<T, M, true, true>(x, y, mask, klen, p, row + (smx_i64)gridDim.x * rpb);
    smx_cp_wait<0>();
    Chunk<T> cx[1][NCH];
    MaskChunk<M, N> cm[1][NCH];
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      Bytes<16> b;
      smx_lds_bytes<16>(b, sx + k * stx);
#pragma unroll
      for (int i = 0; i < 4; ++i) cx[0][k].w[i] = b.w[i];
      if (M::PRESENT) smx_lds_bytes<MB>(cm[0][k].b, sm + k * stm);
    }
    smx_pipe_load<T, M, NCH>(nx, lane, tpr, sx, sm, stx, stm);
    smx_fwd_body<T, M, NCH, 1, true>(cx, cm, rw, act, lane, tpr, p, red[it]);
  }
}
