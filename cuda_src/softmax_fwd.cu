// drvsoftmax forward: y = softmax(x * scale + bias) over the last axis.
//
// One row softmax, two tiers that differ only in where the row lives:
//   smx_fwd_reg<T, M, NCH>: the row sits in registers, NCH chunks of 16 bytes per
//       thread, TPR threads per row (a power of two from 1 to 1024, chosen on the host).
//   smx_fwd_loop<T, M>:     a block per row, any length: an online max/sum pass, then a
//       pass that recomputes and writes.
// LOAD = read x, scale, apply the mask source M and the prefix limit (causal and
// key_lengths: only keys j < limit are visible, and nothing beyond it is read).
// STORE = exp(v - max) / sum, converted to T.  A row whose biased scores contain NaN or
// +inf is NaN throughout (as torch.softmax); a row with no visible key is all zeros.
#include "softmax_common.cuh"

struct FwdParams {
  RowGeom g;             // operands: 0 x, 1 y, 2 mask, 3 key_lengths, 4 query index
  smx_i64 sx, sy, sm;    // element strides along the row
  smx_i64 causal_shift;  // Sk - Sq: query i sees keys j <= i + shift
  int sk;                // row length (< 2^31, checked on the host)
  float scale;
  int flags;             // SMX_F_*
  int tpr_log2;          // register tier: log2(threads per row)
};

#define SMX_F_CAUSAL 1
#define SMX_F_KLEN 2
#define SMX_F_KLEN64 4
#define SMX_F_VEC 8    // x and y: unit stride, 16-byte aligned rows
#define SMX_F_MVEC 16  // mask: unit stride, rows aligned to a chunk's worth of mask bytes

// Number of leading keys of this row that may be visible, in [0, sk].
__device__ __forceinline__ int smx_fwd_limit(const FwdParams& p, const void* klen,
                                             const smx_i64 (&off)[SMX_NOP]) {
  smx_i64 lim = p.sk;
  if (p.flags & SMX_F_KLEN) {
    smx_i64 n = (p.flags & SMX_F_KLEN64) ? ((const smx_i64*)klen)[off[3]]
                                          : (smx_i64)((const int*)klen)[off[3]];
    lim = n < lim ? n : lim;
  }
  if (p.flags & SMX_F_CAUSAL) {
    smx_i64 n = off[4] + p.causal_shift + 1;
    lim = n < lim ? n : lim;
  }
  return lim < 0 ? 0 : (int)lim;
}

// LOAD: chunk c (elements c*N .. c*N+N-1) of a row as biased scores x*scale (+) mask,
// -inf where hidden.  Keys at or beyond `lim` are hidden and never read.
template <typename T, class M>
__device__ __forceinline__ void smx_fwd_load_chunk(float (&v)[Chunk<T>::N], const T* xrow,
                                                   const typename M::S* mrow, const FwdParams& p,
                                                   int c, int lim) {
  enum { N = Chunk<T>::N };
  typedef typename M::S S;
  const int j0 = c * N;
  if (j0 >= lim) {
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = -SMX_INF;
    return;
  }
  S m[N];
  if (j0 + N <= lim) {  // every element visible
    smx_mask_load<M, N>(m, mrow, j0, p.sm, (p.flags & SMX_F_MVEC) != 0, N);
    if (p.flags & SMX_F_VEC) {
      Chunk<T> ch;
      ch.raw = __ldg((const uint4*)(xrow + j0));
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = M::apply(smx_to_f32(ch.e[e]) * p.scale, m[e]);
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = M::apply(smx_to_f32(xrow[(smx_i64)(j0 + e) * p.sx]) * p.scale, m[e]);
    }
  } else {
    const int cnt = lim - j0;
    smx_mask_load<M, N>(m, mrow, j0, p.sm, false, cnt);
#pragma unroll
    for (int e = 0; e < N; ++e)
      v[e] = e < cnt ? M::apply(smx_to_f32(xrow[(smx_i64)(j0 + e) * p.sx]) * p.scale, m[e]) : -SMX_INF;
  }
}

// STORE of chunk c; elements at or beyond sk do not exist.
template <typename T>
__device__ __forceinline__ void smx_store_chunk(T* yrow, smx_i64 sy, int sk, bool vec, int c,
                                                const float (&o)[Chunk<T>::N]) {
  enum { N = Chunk<T>::N };
  const int j0 = c * N;
  if (vec && j0 + N <= sk) {
    Chunk<T> ch;
    smx_pack_chunk<T>(ch, o);
    *(uint4*)(yrow + j0) = ch.raw;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (j0 + e < sk) yrow[(smx_i64)(j0 + e) * sy] = smx_from_f32<T>(o[e]);
  }
}

// The row's max in the exp2 domain.  A row with no visible key has max -inf and uses 0,
// so that every exp2 is of -inf (0) and the sum is 0.  NaN needs no special case: fmaxf
// skips it, its exp2 is NaN, and so are the sum and the whole row; +inf as the max makes
// (+inf) - (+inf) NaN the same way.
__device__ __forceinline__ float smx_max_l2(float mx) { return mx == -SMX_INF ? 0.0f : mx * SMX_LOG2E; }
// 1/sum, or 0 for a row with no visible key (every numerator is 0 then).
__device__ __forceinline__ float smx_inv_sum(float s) { return s == 0.0f ? 0.0f : 1.0f / s; }

// Short rows (at most 32 chunks): 1..32 threads per row, one chunk each, and every
// thread takes R rows at once (R chunks of loads in flight before the first reduction).
template <typename T, class M, int R>
__global__ void __launch_bounds__(128)
smx_fwd_short(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
              const void* __restrict__ klen, const FwdParams p) {
  enum { N = Chunk<T>::N };
  typedef typename M::S S;
  const int tpr_log2 = p.tpr_log2;  // <= 5
  const int rpb = blockDim.x >> tpr_log2;
  const int sub = threadIdx.x >> tpr_log2;
  const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
  const bool has = lane * N < p.sk;
  const bool vec = (p.flags & SMX_F_VEC) != 0;
  const smx_i64 step = (smx_i64)rpb * R;
  for (smx_i64 base = (smx_i64)blockIdx.x * step; base < p.g.rows; base += (smx_i64)gridDim.x * step) {
    float v[R][N];
    smx_i64 yoff[R];
    bool act[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const smx_i64 row = base + (smx_i64)r * rpb + sub;
      act[r] = has && row < p.g.rows;
      yoff[r] = 0;
      if (act[r]) {
        smx_i64 off[SMX_NOP];
        smx_row_offsets(p.g, row, off);
        yoff[r] = off[1];
        smx_fwd_load_chunk<T, M>(v[r], x + off[0], (const S*)mask + off[2], p, lane, smx_fwd_limit(p, klen, off));
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) v[r][e] = -SMX_INF;
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float mx = v[r][0];
#pragma unroll
      for (int e = 1; e < N; ++e) mx = fmaxf(mx, v[r][e]);
      const float mxl = smx_max_l2(smx_warp_reduce<OpMax>(mx, tpr_log2));
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        v[r][e] = smx_exp2(fmaf(v[r][e], SMX_LOG2E, -mxl));
        s += v[r][e];
      }
      const float inv = smx_inv_sum(smx_warp_reduce<OpSum>(s, tpr_log2));
#pragma unroll
      for (int e = 0; e < N; ++e) v[r][e] *= inv;
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (act[r]) smx_store_chunk<T>(y + yoff[r], p.sy, p.sk, vec, lane, v[r]);
  }
}

template <typename T, class M, int NCH>
__global__ void __launch_bounds__(1024)
smx_fwd_reg(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
            const void* __restrict__ klen, const FwdParams p) {
  enum { N = Chunk<T>::N };
  typedef typename M::S S;
  __shared__ float red[32];
  const int tpr_log2 = p.tpr_log2;
  const int rpb = blockDim.x >> tpr_log2;  // rows per block
  const int sub = threadIdx.x >> tpr_log2;
  const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
  const int nch = (p.sk + N - 1) / N;
  const bool vec = (p.flags & SMX_F_VEC) != 0;

  for (smx_i64 base = (smx_i64)blockIdx.x * rpb; base < p.g.rows;
       base += (smx_i64)gridDim.x * rpb) {
    const smx_i64 row = base + sub;
    const bool active = row < p.g.rows;
    smx_i64 off[SMX_NOP];
    int lim = 0;
    if (active) {
      smx_row_offsets(p.g, row, off);
      lim = smx_fwd_limit(p, klen, off);
    }
    const T* xrow = x + off[0];
    const S* mrow = (const S*)mask + off[2];
    float v[NCH][N];
    float mx = -SMX_INF;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = (k << tpr_log2) + lane;
      if (active && c < nch) {
        smx_fwd_load_chunk<T, M>(v[k], xrow, mrow, p, c, lim);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) v[k][e] = -SMX_INF;
      }
#pragma unroll
      for (int e = 0; e < N; ++e) mx = fmaxf(mx, v[k][e]);
    }
    const float mxl = smx_max_l2(smx_row_reduce<OpMax>(mx, tpr_log2, red));
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NCH; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) {
        v[k][e] = smx_exp2(fmaf(v[k][e], SMX_LOG2E, -mxl));
        s += v[k][e];
      }
    const float inv = smx_inv_sum(smx_row_reduce<OpSum>(s, tpr_log2, red));
    if (active) {
      T* yrow = y + off[1];
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int c = (k << tpr_log2) + lane;
        if (c < nch) {
          float o[N];
#pragma unroll
          for (int e = 0; e < N; ++e) o[e] = v[k][e] * inv;
          smx_store_chunk<T>(yrow, p.sy, p.sk, vec, c, o);
        }
      }
    }
  }
}

template <typename T, class M>
__global__ void __launch_bounds__(1024)
smx_fwd_loop(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
             const void* __restrict__ klen, const FwdParams p) {
  enum { N = Chunk<T>::N };
  typedef typename M::S S;
  __shared__ float red[32];
  const int tpr_log2 = 31 - __clz(blockDim.x);  // one row per block
  const int nch = (p.sk + N - 1) / N;
  const bool vec = (p.flags & SMX_F_VEC) != 0;
  for (smx_i64 row = blockIdx.x; row < p.g.rows; row += gridDim.x) {
    smx_i64 off[SMX_NOP];
    smx_row_offsets(p.g, row, off);
    const int lim = smx_fwd_limit(p, klen, off);
    const int nvis = (lim + N - 1) / N;  // chunks holding a visible key
    const T* xrow = x + off[0];
    const S* mrow = (const S*)mask + off[2];
    // Pass 1: online max and sum over this thread's chunks.
    float mx = -SMX_INF, s = 0.0f;
    for (int c = threadIdx.x; c < nvis; c += blockDim.x) {
      float v[N];
      smx_fwd_load_chunk<T, M>(v, xrow, mrow, p, c, lim);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float kv = v[e];
        if (kv > mx) {
          s = s * smx_exp2((mx - kv) * SMX_LOG2E) + 1.0f;
          mx = kv;
        } else if (kv != -SMX_INF) {  // NaN goes in, and makes the row NaN
          s += smx_exp2((kv - mx) * SMX_LOG2E);
        }
      }
    }
    const float rmx = smx_row_reduce<OpMax>(mx, tpr_log2, red);
    const float part = mx == -SMX_INF ? 0.0f : s * smx_exp2((mx - rmx) * SMX_LOG2E);
    const float inv = smx_inv_sum(smx_row_reduce<OpSum>(part, tpr_log2, red));
    const float mxl = smx_max_l2(rmx);
    // Pass 2: recompute and write every element of the row (hidden ones as 0).
    T* yrow = y + off[1];
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
      float v[N], o[N];
      smx_fwd_load_chunk<T, M>(v, xrow, mrow, p, c, lim);
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = smx_exp2(fmaf(v[e], SMX_LOG2E, -mxl)) * inv;
      smx_store_chunk<T>(yrow, p.sy, p.sk, vec, c, o);
    }
  }
}
