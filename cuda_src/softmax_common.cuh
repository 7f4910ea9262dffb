// drvsoftmax: shared pieces of the row-softmax kernels.
//
// Header-free on purpose: NVRTC has no CUDA headers built in, and pulling them from a
// toolkit or a wheel of another version is a source of breakage.  Everything below is
// plain C++ plus a few lines of inline PTX.
//
// Layout model.  A tensor of shape [..., Sk] is a set of rows.  The leading dims are
// merged on the host where every operand allows it and passed as `RowGeom`: the sizes of
// at most SMX_MAXD leading dims (innermost last) and, for each operand, its element
// stride along each of them (0 where the operand is broadcast).  The kernel turns a row
// number into one element offset per operand.  Operands that are not tensors use the
// same mechanism: key_lengths is an operand with stride 1 along dim 0, the query index
// of the causal mask is an operand with stride 1 along dim -2.
#pragma once

#define SMX_MAXD 6
#define SMX_NOP 5

typedef unsigned char smx_u8;
typedef unsigned short smx_u16;
typedef unsigned int smx_u32;
typedef unsigned long long smx_u64;
typedef long long smx_i64;

#define SMX_INF (__int_as_float(0x7f800000))
#define SMX_NAN (__int_as_float(0x7fffffff))
#define SMX_LOG2E 1.4426950408889634f

// Storage types.  Distinct structs so that templates can tell fp16 from bf16.
struct smx_f16 { smx_u16 bits; };
struct smx_bf16 { smx_u16 bits; };

__device__ __forceinline__ float smx_to_f32(float v) { return v; }
__device__ __forceinline__ float smx_to_f32(double v) { return (float)v; }
__device__ __forceinline__ float smx_to_f32(smx_f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float smx_to_f32(smx_bf16 v) {
  return __uint_as_float(((smx_u32)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T smx_from_f32(float v);
template <> __device__ __forceinline__ float smx_from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ smx_f16 smx_from_f32<smx_f16>(float v) {
  smx_f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
  return r;
}
template <> __device__ __forceinline__ smx_bf16 smx_from_f32<smx_bf16>(float v) {
  // Round to nearest even; NaN stays a (quiet) NaN.
  smx_u32 u = __float_as_uint(v);
  smx_bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (smx_u16)((u >> 16) | 0x40u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (smx_u16)(u >> 16);
  }
  return r;
}

// ---------------------------------------------------------------------------------
// Mask sources, as LOAD modifiers: each takes the scaled score of one position and
// returns the biased score.  A hidden position becomes -inf.
struct MaskNone {
  static __device__ __forceinline__ float apply(float v, const void*, smx_i64) { return v; }
};
// Boolean / integer masks of any width: nonzero hides.
template <typename S> struct MaskHide {
  static __device__ __forceinline__ float apply(float v, const void* m, smx_i64 i) {
    return ((const S*)m)[i] != 0 ? -SMX_INF : v;
  }
};
// Additive floating masks: added after scaling; -inf hides.
template <typename S> struct MaskAdd {
  static __device__ __forceinline__ float apply(float v, const void* m, smx_i64 i) {
    return v + smx_to_f32(((const S*)m)[i]);
  }
};

// ---------------------------------------------------------------------------------
struct RowGeom {
  smx_i64 rows;                       // number of rows
  smx_i64 size[SMX_MAXD];             // leading dims, innermost last
  smx_i64 stride[SMX_NOP][SMX_MAXD];  // per operand, in elements
  int ndim;                           // used entries of size/stride
  int small;                          // every size and the row count fit in 32 bits
};

// Element offsets of one row for every operand.
__device__ __forceinline__ void smx_row_offsets(const RowGeom& g, smx_i64 row,
                                                smx_i64 (&off)[SMX_NOP]) {
#pragma unroll
  for (int k = 0; k < SMX_NOP; ++k) off[k] = 0;
  if (g.small) {
    smx_u32 r = (smx_u32)row;
    for (int d = g.ndim - 1; d >= 0; --d) {
      smx_u32 n = (smx_u32)g.size[d];
      smx_u32 q = r / n;
      smx_u32 i = r - q * n;
      r = q;
#pragma unroll
      for (int k = 0; k < SMX_NOP; ++k) off[k] += (smx_i64)i * g.stride[k][d];
    }
  } else {
    smx_u64 r = (smx_u64)row;
    for (int d = g.ndim - 1; d >= 0; --d) {
      smx_u64 n = (smx_u64)g.size[d];
      smx_u64 q = r / n;
      smx_u64 i = r - q * n;
      r = q;
#pragma unroll
      for (int k = 0; k < SMX_NOP; ++k) off[k] += (smx_i64)i * g.stride[k][d];
    }
  }
}

// ---------------------------------------------------------------------------------
// Reductions over the TPR = 1 << tpr_log2 consecutive threads that share a row.
// Within a warp by shuffles; across warps through `red` (one slot per warp).  Every
// thread of the block must call these, active row or not.
struct OpMax {
  static __device__ __forceinline__ float f(float a, float b) { return fmaxf(a, b); }
};
struct OpSum {
  static __device__ __forceinline__ float f(float a, float b) { return a + b; }
};

template <class Op>
__device__ __forceinline__ float smx_row_reduce(float v, int tpr_log2, float* red) {
  const int width = tpr_log2 < 5 ? (1 << tpr_log2) : 32;
  for (int o = width >> 1; o > 0; o >>= 1) v = Op::f(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (tpr_log2 > 5) {
    const int warp = threadIdx.x >> 5;
    const int wpr = 1 << (tpr_log2 - 5);
    __syncthreads();  // earlier readers of `red` are done
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int first = warp & ~(wpr - 1);
    v = red[first];
    for (int i = 1; i < wpr; ++i) v = Op::f(v, red[first + i]);
  }
  return v;
}

// A chunk is 16 bytes of a row: CH elements, loaded with one vector access when the
// row allows it (unit stride, 16-byte aligned), element by element otherwise.
template <typename T> struct Chunk {
  enum { N = 16 / (int)sizeof(T) };
  union {
    uint4 raw;
    T e[N];
  };
};
