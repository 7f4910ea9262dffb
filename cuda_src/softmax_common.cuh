// drvsoftmax: shared pieces of the row-softmax kernels.
//
// Header-free on purpose: NVRTC has no CUDA headers built in, and pulling them from a
// toolkit or a wheel of another version is a source of breakage.  Everything below is
// plain C++ plus a few lines of inline PTX.
//
// The kernel skeleton (softmax_fwd.cu, softmax_bwd.cu) works on 16-byte chunks of a row:
// a thread owns NCH chunks of each of RPT rows.  It first issues every load of all its
// chunks (raw bits into registers, no use in between), then converts and computes, then
// stores.  Threads per row, chunks per thread and rows per thread are what the planner
// picks (drvsoftmax/_plan.py); NCH and RPT are template parameters so that every loop
// unrolls and every array stays in registers.
#pragma once

#include "softmax_params.cuh"

typedef unsigned char smx_u8;
typedef unsigned short smx_u16;
typedef unsigned long long smx_u64;

#define SMX_INF (__int_as_float(0x7f800000))
#define SMX_LOG2E 1.4426950408889634f
// The largest block a register-tier kernel is launched with (a row of 512 threads); as
// launch bounds it caps registers at 128 per thread.
#define SMX_BLOCK 512

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
__device__ __forceinline__ float smx_to_f32(smx_bf16 v) { return __uint_as_float(((smx_u32)v.bits) << 16); }

// The two 16-bit elements of a word as floats, low half first (one instruction each: the
// high half is converted in place, not shifted down first).
__device__ __forceinline__ void smx_unpack2(smx_u32 w, float& lo, float& hi, smx_f16) {
  asm("{ .reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }" : "=f"(lo), "=f"(hi) : "r"(w));
}
__device__ __forceinline__ void smx_unpack2(smx_u32 w, float& lo, float& hi, smx_bf16) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
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

// ---------------------------------------------------------------------------------
// Chunks: 16 bytes of a row, N elements of T, loaded and stored as raw words.
template <typename T> struct Chunk {
  enum { N = 16 / (int)sizeof(T) };
  union {
    uint4 raw;
    T e[N];
    smx_u32 w[4];
  };
};

// One 16-byte load through the read-only path, and one 16-byte store.  Measured on the
// H200, the plain load beats the L1::no_allocate / L2::256B prefetch hints (backward +6-10%
// of copy), and a default store is as fast as or faster than .cs and .cg ones (0-1.3% of
// copy over 10 forward and backward cases; SMX_ST_HINT selects one for such comparisons).
__device__ __forceinline__ uint4 smx_ld16(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
#ifndef SMX_ST_HINT
#define SMX_ST_HINT ""
#endif
__device__ __forceinline__ void smx_st16(void* p, uint4 v) {
  asm volatile("st.global" SMX_ST_HINT ".v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// B bytes (4, 8, 16, 32 or 64) from a B-aligned address (B < 16) or a 16-aligned one.
template <int B> struct Bytes { smx_u32 w[B < 4 ? 1 : B / 4]; };
template <int B> __device__ __forceinline__ void smx_load_bytes(Bytes<B>& dst, const void* p) {
  if (B >= 16) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) {
      const uint4 v = smx_ld16((const char*)p + 16 * i);
      dst.w[4 * i] = v.x; dst.w[4 * i + 1] = v.y; dst.w[4 * i + 2] = v.z; dst.w[4 * i + 3] = v.w;
    }
  } else if (B == 8) {
    const uint2 v = __ldg((const uint2*)p);
    dst.w[0] = v.x; dst.w[1] = v.y;
  } else if (B == 4) {
    dst.w[0] = __ldg((const smx_u32*)p);
  } else {
    dst.w[0] = B == 2 ? *(const smx_u16*)p : *(const smx_u8*)p;
  }
}

// Two floats to two 16-bit values in one instruction where the chip has it (sm_80+).
template <typename T> __device__ __forceinline__ smx_u32 smx_pack2(float lo, float hi) {
  return (smx_u32)smx_from_f32<T>(lo).bits | ((smx_u32)smx_from_f32<T>(hi).bits << 16);
}
#if __CUDA_ARCH__ >= 800
template <> __device__ __forceinline__ smx_u32 smx_pack2<smx_f16>(float lo, float hi) {
  smx_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ smx_u32 smx_pack2<smx_bf16>(float lo, float hi) {
  smx_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

// A chunk's elements as floats (16-bit ones two to a word, see smx_unpack2).
template <typename T> __device__ __forceinline__ void smx_chunk_f32(const Chunk<T>& ch, float (&u)[Chunk<T>::N]) {
#pragma unroll
  for (int i = 0; i < Chunk<T>::N / 2; ++i) smx_unpack2(ch.w[i], u[2 * i], u[2 * i + 1], T());
}
template <> __device__ __forceinline__ void smx_chunk_f32<float>(const Chunk<float>& ch, float (&u)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = __uint_as_float(ch.w[i]);
}
__device__ __forceinline__ float smx_log2(float x) {
  float r;
  asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

template <typename T> __device__ __forceinline__ uint4 smx_pack_chunk(const float (&o)[Chunk<T>::N]) {
  Chunk<T> ch;
#pragma unroll
  for (int i = 0; i < Chunk<T>::N / 2; ++i) ch.w[i] = smx_pack2<T>(o[2 * i], o[2 * i + 1]);
  return ch.raw;
}
template <> __device__ __forceinline__ uint4 smx_pack_chunk<float>(const float (&o)[4]) {
  uint4 v;
  v.x = __float_as_uint(o[0]);
  v.y = __float_as_uint(o[1]);
  v.z = __float_as_uint(o[2]);
  v.w = __float_as_uint(o[3]);
  return v;
}

// c in [lo, hi), in one comparison (needs lo <= hi).
__device__ __forceinline__ bool smx_in(int c, int lo, int hi) { return (unsigned)(c - lo) < (unsigned)(hi - lo); }

// ---------------------------------------------------------------------------------
// Row maps (see softmax_params.cuh): the element offset of a row for one operand.  The
// term loop is unrolled (kernel parameters must be indexed by constants, or the compiler
// copies them to local memory) and stops at the used terms: most operands have one or
// two.  Beyond 2**31 the kernel divides in 64 bits, out of line.
__device__ __noinline__ smx_u64 smx_divmod64(smx_u64 r, smx_u64 d, smx_u64 m) {
  const smx_u64 q = r / d;
  return m ? q % m : q;
}
__device__ __forceinline__ smx_i64 smx_row_offset(const SmxRowMap& m, smx_i64 row, bool small) {
  smx_i64 off = 0;
  const smx_u32 r = (smx_u32)row;
#pragma unroll
  for (int t = 0; t < SMX_MAXT; ++t) {
    if (t >= m.nterms) break;
    if (small) {
      smx_u32 q = m.dmul[t] ? __umulhi(r, m.dmul[t]) >> m.dshr[t] : r;
      if (m.mod[t]) q -= (__umulhi(q, m.mmul[t]) >> m.mshr[t]) * (smx_u32)m.mod[t];
      off += (smx_i64)q * m.stride[t];
    } else {
      off += (smx_i64)smx_divmod64((smx_u64)row, (smx_u64)m.div[t], (smx_u64)m.mod[t]) * m.stride[t];
    }
  }
  return off;
}

// ---------------------------------------------------------------------------------
// Element e of a register array of W 32-bit words holding elements of B bytes, with a
// run-time e (selects over the words, so the array stays in registers).  For the few
// chunks that are not read or written whole: a row's first and last chunk when rows are
// not 16-byte aligned, strided rows, mask rows out of step with x's chunks.
template <int B, int W> __device__ __forceinline__ void smx_put(smx_u32 (&w)[W], int e, smx_u64 v) {
  if (B == 8) {  // as two 4-byte halves: one select chain writing both words sends w to local memory
    smx_put<4, W>(w, 2 * e, (smx_u32)v);
    smx_put<4, W>(w, 2 * e + 1, (smx_u32)(v >> 32));
    return;
  }
  const int bit = e * B * 8;
  const int wi = bit >> 5;
  const int sh = bit & 31;
  const smx_u32 lo = B == 8 ? (smx_u32)v : (smx_u32)v << sh;
  const smx_u32 msk = B >= 4 ? 0xffffffffu : ((1u << (B * 8)) - 1u) << sh;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if (i == wi) w[i] = (w[i] & ~msk) | (lo & msk);
    if (B == 8 && i == wi + 1) w[i] = (smx_u32)(v >> 32);
  }
}
template <int B, int W> __device__ __forceinline__ smx_u64 smx_get(const smx_u32 (&w)[W], int e) {
  const int bit = e * B * 8;
  const int wi = bit >> 5;
  const int sh = bit & 31;
  smx_u64 v = 0;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if (i == wi) v |= (smx_u64)(w[i] >> sh);
    if (B == 8 && i == wi + 1) v |= (smx_u64)w[i] << 32;
  }
  return B == 8 ? v : v & ((1ull << (B * 8)) - 1ull);
}
template <int B> __device__ __forceinline__ smx_u64 smx_read_bits(const void* p) {
  if (B == 1) return *(const smx_u8*)p;
  if (B == 2) return *(const smx_u16*)p;
  if (B == 4) return *(const smx_u32*)p;
  return *(const smx_u64*)p;
}
template <int B> __device__ __forceinline__ void smx_write_bits(void* p, smx_u64 v) {
  if (B == 1) *(smx_u8*)p = (smx_u8)v;
  if (B == 2) *(smx_u16*)p = (smx_u16)v;
  if (B == 4) *(smx_u32*)p = (smx_u32)v;
  if (B == 8) *(smx_u64*)p = v;
}
// Elements j0 + e (e < n) of a row with element stride st, those with 0 <= j < lim only,
// into a word array; the others are left as they were.
template <int B, int W>
__device__ __forceinline__ void smx_gather(smx_u32 (&w)[W], const void* row, smx_i64 st, int j0, int lim, int n) {
#pragma unroll 1
  for (int e = 0; e < n; ++e) {
    const int j = j0 + e;
    if (j >= 0 && j < lim) smx_put<B, W>(w, e, smx_read_bits<B>((const char*)row + (smx_i64)j * st * B));
  }
}
template <int B, int W>
__device__ __forceinline__ void smx_scatter(void* row, smx_i64 st, const smx_u32 (&w)[W], int j0, int lim, int n) {
#pragma unroll 1
  for (int e = 0; e < n; ++e) {
    const int j = j0 + e;
    if (j >= 0 && j < lim) smx_write_bits<B>((char*)row + (smx_i64)j * st * B, smx_get<B, W>(w, e));
  }
}

// Bytes [lo, hi) (even, 0 <= lo < hi <= 16) of a 16-byte chunk held in w, stored into the
// 16-byte block at `blk`: a row's partial first or last chunk in a unit-stride row, without
// touching the neighbouring row's bytes.  Aligned 2-, 4- and 8-byte stores, at most four:
// up from lo to the next 16-byte boundary, then down to hi.
__device__ __forceinline__ smx_u32 smx_word(const smx_u32 (&w)[4], int i) {
  return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
}
__device__ __forceinline__ void smx_st2(char* p, smx_u32 v) {
  asm volatile("st.global" SMX_ST_HINT ".u16 [%0], %1;" ::"l"(p), "h"((unsigned short)v) : "memory");
}
__device__ __forceinline__ void smx_st4(char* p, smx_u32 v) {
  asm volatile("st.global" SMX_ST_HINT ".u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void smx_st8(char* p, smx_u32 a, smx_u32 b) {
  asm volatile("st.global" SMX_ST_HINT ".v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void smx_st_part(void* block, const smx_u32 (&w)[4], int lo, int hi) {
  char* b = (char*)block;
  if ((lo & 2) && lo + 2 <= hi) {
    smx_st2(b + lo, smx_word(w, lo >> 2) >> 16);  // lo = 2 mod 4: the upper half of its word
    lo += 2;
  }
  if ((lo & 4) && lo + 4 <= hi) {
    smx_st4(b + lo, smx_word(w, lo >> 2));
    lo += 4;
  }
  if ((lo & 8) && lo + 8 <= hi) {
    smx_st8(b + 8, w[2], w[3]);
    lo += 8;
  }
  if (lo + 8 <= hi) {  // lo is 0 or 8 here
    smx_st8(b + lo, smx_word(w, lo >> 2), smx_word(w, (lo >> 2) + 1));
    lo += 8;
  }
  if (lo + 4 <= hi) {
    smx_st4(b + lo, smx_word(w, lo >> 2));
    lo += 4;
  }
  if (lo + 2 <= hi) smx_st2(b + lo, smx_word(w, lo >> 2) & 0xffffu);  // lo = 0 mod 4 here
}

// ---------------------------------------------------------------------------------
// Which rows of a block a thread works on.  Threads per row tpr = 2^tpr_log2, rows of the
// block side by side; where 2^tpr_log2 exceeds the block, the block is one row of
// blockDim.x threads (a multiple of 32 that need not be a power of two: rows of 65 to 512
// threads then waste no more than one warp's share).
struct smx_rows_of_block {
  int tpr, lane, rpb, first_row;
  __device__ __forceinline__ explicit smx_rows_of_block(int tl) {
    if ((1 << tl) >= (int)blockDim.x) {
      tpr = blockDim.x;
      lane = threadIdx.x;
      rpb = 1;
      first_row = 0;
    } else {
      tpr = 1 << tl;
      lane = threadIdx.x & (tpr - 1);
      rpb = blockDim.x >> tl;
      first_row = threadIdx.x >> tl;
    }
  }
};

// ---------------------------------------------------------------------------------
// Reductions over the threads of a row.  Rows of up to 32 threads live in one warp
// (lanes aligned to the row width); wider rows span whole warps and finish with one
// exchange through shared memory.
struct OpMax {
  static __device__ __forceinline__ float f(float a, float b) { return fmaxf(a, b); }
};
struct OpSum {
  static __device__ __forceinline__ float f(float a, float b) { return a + b; }
};

// All-reduce of R independent values over the min(tpr, 32) lanes of a row within a warp.
template <class Op, int R>
__device__ __forceinline__ void smx_warp_allreduce(float (&v)[R], int tpr) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < tpr) {
#pragma unroll
      for (int r = 0; r < R; ++r) v[r] = Op::f(v[r], __shfl_xor_sync(0xffffffffu, v[r], o));
    }
  }
}

// Softmax statistics of a row: the max m (-inf if nothing is visible) and the sum s of
// exp(v - m_use) with m_use = m, or 0 where m is -inf (then every term is 0).
// Combining two partial pairs: the larger max wins, the other sum is rescaled.  A pair
// with s == 0 (nothing visible) contributes nothing, whatever its max.  NaN (from a NaN
// or +inf score) propagates through s.
__device__ __forceinline__ float smx_max_use(float m) { return m == -SMX_INF ? 0.0f : m; }
// The term of a score v in a row (or part of one) whose max has the use mu (smx_max_use):
// e^(v - mu), as exp2((v - mu) * log2e).  The max is subtracted before the scaling: the
// difference is exact wherever it matters (0 at the max), whatever the size of the scores,
// where a shift mu * log2e taken as one rounded float is off by up to half a spacing of
// floats there (64 and more from |mu| = 2^30 on, and inf beyond 2.4e38: a row of
// finfo(float32).min or finfo(bfloat16).min scores) and takes exp2 out of range.
__device__ __forceinline__ float smx_term_of(float d) { return smx_exp2(d * SMX_LOG2E); }  // d = v - mu
__device__ __forceinline__ float smx_term(float v, float mu) { return smx_term_of(v - mu); }
// The sum of the terms of passes that compute the values again: a row whose max is +inf
// (x * scale overflowed, x finite) is NaN, as the held values make it, whatever the passes'
// terms made of inf - inf.
__device__ __forceinline__ float smx_fused_sum(float s, float m) { return m == SMX_INF ? __int_as_float(0x7fffffff) : s; }
__device__ __forceinline__ void smx_pair_merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  const float mu = smx_max_use(mm);
  const float a = s == 0.0f ? 0.0f : s * smx_term(smx_max_use(m), mu);
  const float b = s2 == 0.0f ? 0.0f : s2 * smx_term(smx_max_use(m2), mu);
  m = mm;
  s = a + b;
}
// 1/sum, or 0 for a row with no visible key (every numerator is 0 then).
__device__ __forceinline__ float smx_inv_sum(float s) { return s == 0.0f ? 0.0f : 1.0f / s; }
