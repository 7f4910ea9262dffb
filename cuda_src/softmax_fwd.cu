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
  RowGeom g;            // operands: 0 x, 1 y, 2 mask, 3 key_lengths, 4 query index
  smx_i64 sk;           // row length
  smx_i64 sx, sy, sm;   // element strides along the row
  smx_i64 causal_shift; // Sk - Sq: query i sees keys j <= i + shift
  float scale;
  int flags;            // SMX_F_*
  int tpr_log2;         // register tier: log2(threads per row)
};

#define SMX_F_CAUSAL 1
#define SMX_F_KLEN 2
#define SMX_F_KLEN64 4
#define SMX_F_VEC 8

// Number of leading keys of this row that may be visible.
__device__ __forceinline__ smx_i64 smx_fwd_limit(const FwdParams& p, const void* klen,
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
  return lim < 0 ? 0 : lim;
}

// LOAD of one element: scaled, biased score, -inf if hidden.
template <typename T, class M>
__device__ __forceinline__ float smx_fwd_score(float xv, const FwdParams& p, const void* mask,
                                               smx_i64 moff, smx_i64 j, smx_i64 lim) {
  if (j >= lim) return -SMX_INF;
  return M::apply(xv * p.scale, mask, moff + j * p.sm);
}

// Load chunk c (elements c*N .. c*N+N-1) of a row of x as biased scores.
template <typename T, class M>
__device__ __forceinline__ void smx_fwd_load_chunk(float (&v)[Chunk<T>::N], const T* xrow,
                                                   const FwdParams& p, const void* mask,
                                                   smx_i64 moff, smx_i64 c, smx_i64 lim) {
  enum { N = Chunk<T>::N };
  const smx_i64 j0 = c * N;
  if (j0 >= lim) {  // wholly hidden: not read at all
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = -SMX_INF;
    return;
  }
  if ((p.flags & SMX_F_VEC) && j0 + N <= p.sk) {
    Chunk<T> ch;
    ch.raw = *(const uint4*)(xrow + j0);
#pragma unroll
    for (int e = 0; e < N; ++e)
      v[e] = smx_fwd_score<T, M>(smx_to_f32(ch.e[e]), p, mask, moff, j0 + e, lim);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const smx_i64 j = j0 + e;
      v[e] = (j < p.sk && j < lim)
                 ? smx_fwd_score<T, M>(smx_to_f32(xrow[j * p.sx]), p, mask, moff, j, lim)
                 : -SMX_INF;
    }
  }
}

template <typename T>
__device__ __forceinline__ void smx_store_chunk(T* yrow, smx_i64 sy, smx_i64 sk, int flags,
                                                smx_i64 c, const float (&o)[Chunk<T>::N]) {
  enum { N = Chunk<T>::N };
  const smx_i64 j0 = c * N;
  if ((flags & SMX_F_VEC) && j0 + N <= sk) {
    Chunk<T> ch;
#pragma unroll
    for (int e = 0; e < N; ++e) ch.e[e] = smx_from_f32<T>(o[e]);
    *(uint4*)(yrow + j0) = ch.raw;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (j0 + e < sk) yrow[(j0 + e) * sy] = smx_from_f32<T>(o[e]);
  }
}

// Map a score to the value the max reduction sees: NaN and +inf become +inf, which then
// marks the whole row as NaN.
__device__ __forceinline__ float smx_max_key(float v) { return (v != v) ? SMX_INF : v; }

// STORE of one element given the row's max and 1/sum.
__device__ __forceinline__ float smx_fwd_out(float v, float mx, float inv) {
  if (mx == SMX_INF) return SMX_NAN;      // NaN or +inf in the row
  if (mx == -SMX_INF) return 0.0f;        // nothing visible
  return exp2f((v - mx) * SMX_LOG2E) * inv;  // hidden: exp2(-inf) == 0
}

template <typename T, class M, int NCH>
__global__ void __launch_bounds__(1024)
smx_fwd_reg(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
            const void* __restrict__ klen, const FwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[32];
  const int tpr_log2 = p.tpr_log2;
  const int rpb = blockDim.x >> tpr_log2;  // rows per block
  const int sub = threadIdx.x >> tpr_log2;
  const int lane = threadIdx.x & ((1 << tpr_log2) - 1);
  const smx_i64 nch = (p.sk + N - 1) / N;

  for (smx_i64 base = (smx_i64)blockIdx.x * rpb; base < p.g.rows;
       base += (smx_i64)gridDim.x * rpb) {
    const smx_i64 row = base + sub;
    const bool active = row < p.g.rows;
    smx_i64 off[SMX_NOP];
    smx_i64 lim = 0;
    if (active) {
      smx_row_offsets(p.g, row, off);
      lim = smx_fwd_limit(p, klen, off);
    }
    float v[NCH][N];
    float mx = -SMX_INF;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const smx_i64 c = (smx_i64)k * (1 << tpr_log2) + lane;
      if (active && c < nch) {
        smx_fwd_load_chunk<T, M>(v[k], x + off[0], p, mask, off[2], c, lim);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) v[k][e] = -SMX_INF;
      }
#pragma unroll
      for (int e = 0; e < N; ++e) mx = fmaxf(mx, smx_max_key(v[k][e]));
    }
    mx = smx_row_reduce<OpMax>(mx, tpr_log2, red);
    float s = 0.0f;
    if (mx != SMX_INF && mx != -SMX_INF) {
#pragma unroll
      for (int k = 0; k < NCH; ++k)
#pragma unroll
        for (int e = 0; e < N; ++e) {
          v[k][e] = exp2f((v[k][e] - mx) * SMX_LOG2E);
          s += v[k][e];
        }
    }
    s = smx_row_reduce<OpSum>(s, tpr_log2, red);
    if (active) {
      const float inv = 1.0f / s;
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const smx_i64 c = (smx_i64)k * (1 << tpr_log2) + lane;
        if (c < nch) {
          float o[N];
#pragma unroll
          for (int e = 0; e < N; ++e)
            o[e] = mx == SMX_INF ? SMX_NAN : (mx == -SMX_INF ? 0.0f : v[k][e] * inv);
          smx_store_chunk<T>(y + off[1], p.sy, p.sk, p.flags, c, o);
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
  __shared__ float red[32];
  const int tpr_log2 = 31 - __clz(blockDim.x);  // one row per block
  const smx_i64 nch = (p.sk + N - 1) / N;
  for (smx_i64 row = blockIdx.x; row < p.g.rows; row += gridDim.x) {
    smx_i64 off[SMX_NOP];
    smx_row_offsets(p.g, row, off);
    const smx_i64 lim = smx_fwd_limit(p, klen, off);
    const smx_i64 nvis = (lim + N - 1) / N;  // chunks holding a visible key
    // Pass 1: online max and sum of this thread's chunks.
    float mx = -SMX_INF, s = 0.0f;
    for (smx_i64 c = threadIdx.x; c < nvis; c += blockDim.x) {
      float v[N];
      smx_fwd_load_chunk<T, M>(v, x + off[0], p, mask, off[2], c, lim);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float kv = smx_max_key(v[e]);
        if (kv > mx) {
          s = s * exp2f((mx - kv) * SMX_LOG2E) + (kv == SMX_INF ? 0.0f : 1.0f);
          mx = kv;
        } else if (kv != -SMX_INF && mx != SMX_INF) {
          s += exp2f((kv - mx) * SMX_LOG2E);
        }
      }
    }
    const float rmx = smx_row_reduce<OpMax>(mx, tpr_log2, red);
    float part = 0.0f;
    if (rmx != SMX_INF && rmx != -SMX_INF && mx != -SMX_INF)
      part = s * exp2f((mx - rmx) * SMX_LOG2E);
    const float inv = 1.0f / smx_row_reduce<OpSum>(part, tpr_log2, red);
    // Pass 2: recompute and write every element of the row (hidden ones as 0).
    for (smx_i64 c = threadIdx.x; c < nch; c += blockDim.x) {
      float v[N], o[N];
      smx_fwd_load_chunk<T, M>(v, x + off[0], p, mask, off[2], c, lim);
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = smx_fwd_out(v[e], rmx, inv);
      smx_store_chunk<T>(y + off[1], p.sy, p.sk, p.flags, c, o);
    }
  }
}
