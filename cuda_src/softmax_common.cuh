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

// 2^x with one MUFU instruction (flushes results below 2^-126 to 0, far below every
// output format's resolution of a probability).
__device__ __forceinline__ float smx_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Load B bytes from a B-aligned address as plain words (B = 4, 8, 16, 32 or 64).
template <int B> struct Bytes { smx_u32 w[B / 4]; };
template <int B> __device__ __forceinline__ void smx_load_bytes(Bytes<B>& dst, const void* p) {
  if (B >= 16) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) {
      uint4 v = ((const uint4*)p)[i];
      dst.w[4 * i] = v.x; dst.w[4 * i + 1] = v.y; dst.w[4 * i + 2] = v.z; dst.w[4 * i + 3] = v.w;
    }
  } else if (B == 8) {
    uint2 v = *(const uint2*)p;
    dst.w[0] = v.x; dst.w[1] = v.y;
  } else {
    dst.w[0] = *(const smx_u32*)p;
  }
}

// ---------------------------------------------------------------------------------
// Mask sources, as LOAD modifiers.  `apply` takes a scaled score and the mask value of
// its position and returns the biased score; a hidden position becomes -inf.  `load`
// reads the mask value at element i of a mask row; `load_vec` reads N consecutive ones
// from an aligned address in as few accesses as possible.
struct MaskNone {
  typedef smx_u8 S;
  enum { PRESENT = 0 };
  static __device__ __forceinline__ float apply(float v, S) { return v; }
};
// Boolean / integer masks of any width: nonzero hides.
template <typename S_> struct MaskHide {
  typedef S_ S;
  enum { PRESENT = 1 };
  static __device__ __forceinline__ float apply(float v, S m) { return m != 0 ? -SMX_INF : v; }
};
// Additive floating masks: added after scaling; -inf hides.
template <typename S_> struct MaskAdd {
  typedef S_ S;
  enum { PRESENT = 1 };
  static __device__ __forceinline__ float apply(float v, S m) { return v + smx_to_f32(m); }
};

// Mask values of elements j0 .. j0+N-1 of a mask row.  `vec`: the N values are
// contiguous and aligned (one access); else element-wise, reading only the first `cnt`.
template <class M, int N>
__device__ __forceinline__ void smx_mask_load(typename M::S (&m)[N], const typename M::S* row, int j0,
                                              smx_i64 sm, bool vec, int cnt) {
  typedef typename M::S S;
  if (!M::PRESENT) return;
  if (vec) {
    union { Bytes<N * sizeof(S)> b; S e[N]; } u;
    smx_load_bytes<N * sizeof(S)>(u.b, row + j0);
#pragma unroll
    for (int e = 0; e < N; ++e) m[e] = u.e[e];
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) m[e] = e < cnt ? row[(smx_i64)(j0 + e) * sm] : S();
  }
}

// ---------------------------------------------------------------------------------
struct RowGeom {
  smx_i64 rows;                       // number of rows
  smx_i64 size[SMX_MAXD];             // leading dims, innermost last
  smx_i64 stride[SMX_NOP][SMX_MAXD];  // per operand, in elements
  smx_u32 mul[SMX_MAXD];              // q = umulhi(r, mul) >> shr  ==  r / size (r < 2^31)
  smx_u32 shr[SMX_MAXD];
  int ndim;                           // used entries of size/stride
  int small;                          // the row count and every size are below 2^31
};

// Element offsets of one row for every operand.  The outermost dim needs no division:
// what is left of the row number is its index.
__device__ __forceinline__ void smx_row_offsets(const RowGeom& g, smx_i64 row,
                                                smx_i64 (&off)[SMX_NOP]) {
#pragma unroll
  for (int k = 0; k < SMX_NOP; ++k) off[k] = 0;
  if (g.small) {
    smx_u32 r = (smx_u32)row;
    for (int d = g.ndim - 1; d > 0; --d) {
      const smx_u32 q = __umulhi(r, g.mul[d]) >> g.shr[d];
      const smx_u32 i = r - q * (smx_u32)g.size[d];
      r = q;
#pragma unroll
      for (int k = 0; k < SMX_NOP; ++k) off[k] += (smx_i64)i * g.stride[k][d];
    }
    if (g.ndim > 0) {
#pragma unroll
      for (int k = 0; k < SMX_NOP; ++k) off[k] += (smx_i64)r * g.stride[k][0];
    }
  } else {
    smx_u64 r = (smx_u64)row;
    for (int d = g.ndim - 1; d > 0; --d) {
      const smx_u64 n = (smx_u64)g.size[d];
      const smx_u64 q = r / n;
      const smx_u64 i = r - q * n;
      r = q;
#pragma unroll
      for (int k = 0; k < SMX_NOP; ++k) off[k] += (smx_i64)i * g.stride[k][d];
    }
    if (g.ndim > 0) {
#pragma unroll
      for (int k = 0; k < SMX_NOP; ++k) off[k] += (smx_i64)r * g.stride[k][0];
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

// Reduction over 1 << w consecutive lanes of a warp (w <= 5).
template <class Op>
__device__ __forceinline__ float smx_warp_reduce(float v, int w) {
  for (int o = (1 << w) >> 1; o > 0; o >>= 1) v = Op::f(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class Op>
__device__ __forceinline__ float smx_row_reduce(float v, int tpr_log2, float* red) {
  v = smx_warp_reduce<Op>(v, tpr_log2 < 5 ? tpr_log2 : 5);
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

// A chunk is 16 bytes of a row: N elements, loaded with one vector access when the
// row allows it (unit stride, 16-byte aligned), element by element otherwise.
template <typename T> struct Chunk {
  enum { N = 16 / (int)sizeof(T) };
  union {
    uint4 raw;
    T e[N];
    smx_u32 w[4];
  };
};

// Two floats to two 16-bit values in one instruction where the chip has it (sm_80+).
template <typename T> __device__ __forceinline__ smx_u32 smx_pack2(float lo, float hi);
template <> __device__ __forceinline__ smx_u32 smx_pack2<smx_f16>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  smx_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (smx_u32)smx_from_f32<smx_f16>(lo).bits | ((smx_u32)smx_from_f32<smx_f16>(hi).bits << 16);
#endif
}
template <> __device__ __forceinline__ smx_u32 smx_pack2<smx_bf16>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  smx_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (smx_u32)smx_from_f32<smx_bf16>(lo).bits | ((smx_u32)smx_from_f32<smx_bf16>(hi).bits << 16);
#endif
}

// A chunk of outputs, converted to T.
template <typename T>
__device__ __forceinline__ void smx_pack_chunk(Chunk<T>& ch, const float (&o)[Chunk<T>::N]) {
#pragma unroll
  for (int i = 0; i < Chunk<T>::N / 2; ++i) ch.w[i] = smx_pack2<T>(o[2 * i], o[2 * i + 1]);
}
template <> __device__ __forceinline__ void smx_pack_chunk<float>(Chunk<float>& ch, const float (&o)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) ch.e[i] = o[i];
}
