// drvsoftmax backward: dx = scale * y * (dy - sum(dy * y)) over the last axis.
//
// Same tiers as the forward: smx_bwd_reg<T, NCH> keeps y and dy of a row in registers,
// smx_bwd_loop<T> takes a block per row and reads the row twice.  Positions where y == 0
// (hidden keys, fully hidden rows) get exactly 0.  dy and y are only read.
#include "softmax_common.cuh"

struct BwdParams {
  RowGeom g;               // operands: 0 dy, 1 y, 2 dx
  smx_i64 sdy, sy, sdx;    // element strides along the row
  int sk;                  // row length (< 2^31, checked on the host)
  float scale;
  int flags;               // SMX_B_VEC
  int tpr_log2;
};

#define SMX_B_VEC 8

template <typename T>
__device__ __forceinline__ void smx_load_plain(float (&v)[Chunk<T>::N], const T* row, smx_i64 st,
                                               int sk, int flags, int c) {
  enum { N = Chunk<T>::N };
  const int j0 = c * N;
  if ((flags & SMX_B_VEC) && j0 + N <= sk) {
    Chunk<T> ch;
    ch.raw = __ldg((const uint4*)(row + j0));
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = smx_to_f32(ch.e[e]);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = (j0 + e < sk) ? smx_to_f32(row[(smx_i64)(j0 + e) * st]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ void smx_bwd_store(T* row, smx_i64 st, int sk, int flags,
                                              int c, const float (&o)[Chunk<T>::N]) {
  enum { N = Chunk<T>::N };
  const int j0 = c * N;
  if ((flags & SMX_B_VEC) && j0 + N <= sk) {
    Chunk<T> ch;
    smx_pack_chunk<T>(ch, o);
    *(uint4*)(row + j0) = ch.raw;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (j0 + e < sk) row[(smx_i64)(j0 + e) * st] = smx_from_f32<T>(o[e]);
  }
}

__device__ __forceinline__ float smx_bwd_out(float yv, float dyv, float dot, float scale) {
  return yv == 0.0f ? 0.0f : scale * yv * (dyv - dot);
}

// Short rows (at most 32 chunks): one chunk per thread, R rows per thread at once.
template <typename T, int R>
__global__ void __launch_bounds__(128)
smx_bwd_short(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
              const BwdParams p) {
  enum { N = Chunk<T>::N };
  const int tpr_log2 = p.tpr_log2;  // <= 5
  const int rpb = blockDim.x >> tpr_log2;
  const int sub = threadIdx.x >> tpr_log2;
  const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
  const bool has = lane * N < p.sk;
  const smx_i64 step = (smx_i64)rpb * R;
  for (smx_i64 base = (smx_i64)blockIdx.x * step; base < p.g.rows; base += (smx_i64)gridDim.x * step) {
    float vy[R][N], vd[R][N];
    smx_i64 xoff[R];
    bool act[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const smx_i64 row = base + (smx_i64)r * rpb + sub;
      act[r] = has && row < p.g.rows;
      xoff[r] = 0;
      if (act[r]) {
        smx_i64 off[SMX_NOP];
        smx_row_offsets(p.g, row, off);
        xoff[r] = off[2];
        smx_load_plain<T>(vd[r], dy + off[0], p.sdy, p.sk, p.flags, lane);
        smx_load_plain<T>(vy[r], y + off[1], p.sy, p.sk, p.flags, lane);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) vd[r][e] = vy[r][e] = 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < N; ++e) dot += vd[r][e] * vy[r][e];
      dot = smx_warp_reduce<OpSum>(dot, tpr_log2);
#pragma unroll
      for (int e = 0; e < N; ++e) vd[r][e] = smx_bwd_out(vy[r][e], vd[r][e], dot, p.scale);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (act[r]) smx_bwd_store<T>(dx + xoff[r], p.sdx, p.sk, p.flags, lane, vd[r]);
  }
}

template <typename T, int NCH>
__global__ void __launch_bounds__(1024)
smx_bwd_reg(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
            const BwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[32];
  const int tpr_log2 = p.tpr_log2;
  const int rpb = blockDim.x >> tpr_log2;
  const int sub = threadIdx.x >> tpr_log2;
  const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
  const int nch = (p.sk + N - 1) / N;
  for (smx_i64 base = (smx_i64)blockIdx.x * rpb; base < p.g.rows;
       base += (smx_i64)gridDim.x * rpb) {
    const smx_i64 row = base + sub;
    const bool active = row < p.g.rows;
    smx_i64 off[SMX_NOP];
    if (active) smx_row_offsets(p.g, row, off);
    float vy[NCH][N], vd[NCH][N];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = (k << tpr_log2) + lane;
      if (active && c < nch) {
        smx_load_plain<T>(vd[k], dy + off[0], p.sdy, p.sk, p.flags, c);
        smx_load_plain<T>(vy[k], y + off[1], p.sy, p.sk, p.flags, c);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) vd[k][e] = vy[k][e] = 0.0f;
      }
#pragma unroll
      for (int e = 0; e < N; ++e) dot += vd[k][e] * vy[k][e];
    }
    dot = smx_row_reduce<OpSum>(dot, tpr_log2, red);
    if (active) {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c = (k << tpr_log2) + lane;
        if (c < nch) {
          float o[N];
#pragma unroll
          for (int e = 0; e < N; ++e) o[e] = smx_bwd_out(vy[k][e], vd[k][e], dot, p.scale);
          smx_bwd_store<T>(dx + off[2], p.sdx, p.sk, p.flags, c, o);
        }
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(1024)
smx_bwd_loop(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
             const BwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[32];
  const int tpr_log2 = 31 - __clz(blockDim.x);
  const int nch = (p.sk + N - 1) / N;
  for (smx_i64 row = blockIdx.x; row < p.g.rows; row += gridDim.x) {
    smx_i64 off[SMX_NOP];
    smx_row_offsets(p.g, row, off);
    float dot = 0.0f;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
      float a[N], b[N];
      smx_load_plain<T>(a, dy + off[0], p.sdy, p.sk, p.flags, c);
      smx_load_plain<T>(b, y + off[1], p.sy, p.sk, p.flags, c);
#pragma unroll
      for (int e = 0; e < N; ++e) dot += a[e] * b[e];
    }
    dot = smx_row_reduce<OpSum>(dot, tpr_log2, red);
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
      float a[N], b[N], o[N];
      smx_load_plain<T>(a, dy + off[0], p.sdy, p.sk, p.flags, c);
      smx_load_plain<T>(b, y + off[1], p.sy, p.sk, p.flags, c);
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = smx_bwd_out(b[e], a[e], dot, p.scale);
      smx_bwd_store<T>(dx + off[2], p.sdx, p.sk, p.flags, c, o);
    }
  }
}
