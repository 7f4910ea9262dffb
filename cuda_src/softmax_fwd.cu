// drvsoftmax forward: y = softmax(x * scale + bias) over the last axis.
//
// One skeleton, three steps per tile of chunks (see softmax_common.cuh):
//   LOAD   every 16-byte chunk of x (and the mask's matching bytes) a thread owns, raw,
//          all in flight together; keys at or beyond the row's visible prefix (causal,
//          key_lengths) are never read;
//   VALUES convert, scale, apply the mask source M; hidden keys become -inf;
//   STORE  exp(v - max) / sum, converted to T.
// A row whose biased scores contain NaN or +inf is NaN throughout (as torch.softmax); a
// row with no visible key is all zeros.  Score modifiers are steps of VALUES.
//
// Kernels:
//   smx_fwd<T, M, NCH, RPT>   a row in registers: tpr threads (1..512) x NCH chunks, RPT
//                             rows per thread.  16-bit kernels of 8 chunks are lean (see
//                             SMX_HELD_VALUES): raw chunks held, values computed per pass.
//   smx_fwd_loop<T, M, NCH>   a block per row, any length: a pass for (max, sum), a pass
//                             that reloads and writes.
// Unaligned rows (odd Sk) keep 16-byte accesses.  Without a mask they are "edged" (see
// smx_fwd_edged): the whole 16-byte blocks inside a row are its chunks and the few keys
// outside them are taken one per lane.  Otherwise chunks follow the 16-byte grid of the
// address space, and only a row's first and last chunk are accessed element-wise.
#include "softmax_common.cuh"

// A mask row's N values of one chunk, as raw bytes.
template <class M, int N> struct MaskChunk {
  typedef typename M::S S;
  union {
    Bytes<N * (int)sizeof(S)> b;
    S e[N];
  };
};

// Mask sources, as steps of VALUES.  `apply` takes a scaled score and the mask value of
// its position and returns the biased score; a hidden position becomes -inf.
struct MaskNone {
  typedef smx_u8 S;
  enum { PRESENT = 0, HIDE = 0 };
  static __device__ __forceinline__ float apply(float v, S) { return v; }
};
// Boolean / integer masks of any width: nonzero hides.
template <typename S_> struct MaskHide {
  typedef S_ S;
  enum { PRESENT = 1, HIDE = 1 };
  static __device__ __forceinline__ float apply(float v, S m) { return m != 0 ? -SMX_INF : v; }
};
// Additive floating masks: added after scaling; -inf hides.
template <typename S_> struct MaskAdd {
  typedef S_ S;
  enum { PRESENT = 1, HIDE = 0 };
  static __device__ __forceinline__ float apply(float v, S m) { return v + smx_to_f32(m); }
};

// What a thread knows about one of its rows.
template <typename T, class M> struct FwdRow {
  const T* x;
  T* y;
  const typename M::S* m;
  int lim;    // keys j < lim may be visible (causal, key_lengths); 0 for a row past the end
  int ofs;    // elements of the row before its first 16-byte boundary, negated: chunk c
              // starts at element c * N - ofs
  bool mvec;  // the mask row can be read a chunk at a time
  // Chunks c in [c0, c1) are whole 16-byte blocks inside the row and wholly visible: the
  // fast path (one vector access, no per-element checks).  Stores: [c0, cs1).
  int c0, c1, cs1;
};

// The end of the chunks of a row that are stored whole, [c0, cs1).
template <typename T, class M>
__device__ __forceinline__ int smx_fwd_cs1(const FwdRow<T, M>& r, const SmxFwdParams& p) {
  return (p.flags & SMX_F_VEC) ? max(r.c0, (p.sk + r.ofs) / Chunk<T>::N) : 0;
}

// SMALL: the launch has 32-bit row maps (SMX_F_SMALL, fewer than 2^31 rows): the 64-bit
// path (a call) is not compiled in.
template <typename T, class M, bool AL, bool SMALL = false>
__device__ __forceinline__ FwdRow<T, M> smx_fwd_row(const T* x, T* y, const void* mask, const void* klen,
                                                    const SmxFwdParams& p, smx_i64 row) {
  typedef typename M::S S;
  enum { N = Chunk<T>::N };
  FwdRow<T, M> r;
  r.x = x;
  r.y = y;
  r.m = (const S*)mask;
  r.lim = 0;
  r.ofs = 0;
  r.mvec = false;
  r.c0 = r.c1 = r.cs1 = 0;
  if (row >= p.rows) return r;
  const bool small = SMALL || (p.flags & SMX_F_SMALL) != 0;
  const smx_i64 ox = smx_row_offset(p.map_x, row, small);
  r.x = x + ox;
  r.y = y + ((p.flags & SMX_F_SAMEMAP) ? ox : smx_row_offset(p.map_y, row, small));
  if (!AL && (p.flags & SMX_F_VEC)) r.ofs = (int)(((smx_u64)r.x & 15) / sizeof(T));
  if (M::PRESENT) {
    r.m += smx_row_offset(p.map_m, row, small);
    enum { MB = N * (int)sizeof(S) < 16 ? N * (int)sizeof(S) : 16 };
    r.mvec = AL || ((p.flags & SMX_F_MVEC) && (((smx_u64)(r.m - r.ofs)) & (MB - 1)) == 0);
  }
  smx_i64 lim = p.sk;
  if (p.flags & SMX_F_KLEN) {
    const smx_i64 k = smx_row_offset(p.map_k, row, small);
    const smx_i64 n = (p.flags & SMX_F_KLEN64) ? ((const smx_i64*)klen)[k] : (smx_i64)((const int*)klen)[k];
    lim = n < lim ? n : lim;
  }
  if (p.flags & SMX_F_CAUSAL) {
    const smx_i64 n = smx_row_offset(p.map_q, row, small) + p.causal_shift + 1;
    lim = n < lim ? n : lim;
  }
  r.lim = lim < 0 ? 0 : (int)lim;
  if (p.flags & SMX_F_VEC) {
    r.c0 = r.ofs > 0;
    r.c1 = max(r.c0, (r.lim + r.ofs) / N);  // an empty range stays empty for smx_in
    r.cs1 = smx_fwd_cs1(r, p);
  }
  return r;
}

// LOAD: chunks c0 + k * tpr + lane (k < NCH) of each row, raw.
template <typename T, class M, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_fwd_load(Chunk<T> (&cx)[RPT][NCH], MaskChunk<M, Chunk<T>::N> (&cm)[RPT][NCH],
                                             const FwdRow<T, M> (&rw)[RPT], int c0, int tpr, const SmxFwdParams& p,
                                             const T* x, const typename M::S* m0) {
  enum { N = Chunk<T>::N };
  typedef typename M::S S;
  enum { MW = N * (int)sizeof(S) / 4 };  // words of a mask chunk
  const bool vec = (p.flags & SMX_F_VEC) != 0;
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = c0 + k * tpr;
      const int j0 = c * N - rw[r].ofs;
      const int lim = rw[r].lim;
      if (AL) {
        if (j0 < lim) {
          cx[r][k].raw = smx_ld16(rw[r].x + j0);
          if (M::PRESENT) smx_load_bytes(cm[r][k].b, rw[r].m + j0);
        }
        continue;
      }
      if (smx_in(c, rw[r].c0, rw[r].c1)) {
        cx[r][k].raw = smx_ld16(rw[r].x + j0);
        if (M::PRESENT) {
          if (rw[r].mvec) {
            smx_load_bytes(cm[r][k].b, rw[r].m + j0);
          } else {
            smx_gather<sizeof(S), MW>(cm[r][k].b.w, rw[r].m, p.sm, j0, lim, N);
          }
        }
        continue;
      }
      // Chunks holding a visible key are read.  A whole 16-byte block is read where it
      // lies inside the row or anywhere inside the tensor (bytes of a neighbouring row are
      // read and ignored); element-wise only at the tensor's very ends and for strided rows.
      if (j0 < lim && j0 + N > 0) {
        const bool inrow = j0 >= 0 && j0 + N <= p.sk;
        if (vec && (inrow || (rw[r].x + j0 >= x && rw[r].x + j0 + N <= x + p.span_x))) {
          cx[r][k].raw = smx_ld16(rw[r].x + j0);
        } else {
          smx_gather<sizeof(T), 4>(cx[r][k].w, rw[r].x, p.sx, j0, lim, N);
        }
        if (M::PRESENT) {
          if (rw[r].mvec && (inrow || (rw[r].m + j0 >= m0 && rw[r].m + j0 + N <= m0 + p.span_m))) {
            smx_load_bytes(cm[r][k].b, rw[r].m + j0);
          } else {
            smx_gather<sizeof(S), MW>(cm[r][k].b.w, rw[r].m, p.sm, j0, lim, N);
          }
        }
      }
    }
  }
}

// Chunks wholly past a row's visible prefix (causal, key_lengths; half the chunks of a causal
// row) skip their values in the 16-bit whole-chunk kernels of 4 chunks per thread without a
// mask: -inf at once (nothing was read), no conversion, no per-key test.  Measured on the
// H200, causal [8,32,2048,2048] (fp16 / bf16), per-key tests as smx_hide_past -> this skip
// too: 0.860 / 0.896 -> 0.847 / 0.864 ms (0.892 / 0.924 before either).  The same skip of
// the terms as well took 63 registers against 54 (0.887 / 0.904 ms), of the outputs as well
// 55 (0.850 / 0.869); in the fp32 and 2-chunk kernels the skip alone made rows without a
// prefix slower (fp32 Sk 8192 0.51 -> 0.62 ms, Sk 1024 0.519 -> 0.550; bf16 Sk 512 0.511 ->
// 0.520).
template <typename T, class M, int NCH, bool AL> struct SmxPast {
  enum { SKIP = AL && !M::PRESENT && sizeof(T) == 2 && NCH == 4 };
};

// Keys j >= lim of the chunk at key j0 >= 0 made -inf.  The bound is taken once, a key costs
// a compare and a select (as j0 + e >= lim per key, ptxas spent an add and two compares on
// each: 4 instructions a key where a causal row hides half its chunks).
template <int N> __device__ __forceinline__ void smx_hide_past(float (&v)[N], int j0, int lim) {
  const int hi = lim - j0;  // the chunk's keys e >= hi are hidden
  if (hi < N) {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (e >= hi) v[e] = -SMX_INF;
  }
}

// VALUES: biased scores, -inf where hidden; and each row's max over this thread.  `shift`:
// the scores less it (a row's max, for passes that compute the values again to take their
// terms).  x * scale is rounded before the shift, as the max was: the difference is then 0
// at the max whatever its size.  (One FMA for x * scale - shift leaves the product's rounding
// error, up to half a spacing of floats at the max: a factor e^64 on every term from
// |max| = 2^30 on, and rows of bf16 scores of 1e30 or finfo.min turned NaN or 0.)  With an
// additive mask, x * scale + mask may be one FMA: its one rounding is the same in every pass.
// (__fmul_rn there cost 16-bit additive masks 8-13% on the H200.)  Without a shift (SH
// false: values held, or a max pass; `shift` unused) x * scale is an FMA with -0, the same
// rounded product: as __fmul_rn or a plain product, ptxas took the causal fp16 kernel from
// 54 to 63 registers on sm_90 (H200: [8,32,2048,2048] 0.93 ms against 0.89).
template <typename T, class M, int NCH, int RPT, bool AL, bool SH = false>
__device__ __forceinline__ void smx_fwd_values(float (&v)[RPT][NCH][Chunk<T>::N], float (&mx)[RPT],
                                               const Chunk<T> (&cx)[RPT][NCH],
                                               const MaskChunk<M, Chunk<T>::N> (&cm)[RPT][NCH],
                                               const FwdRow<T, M> (&rw)[RPT], int c0, int tpr, float scale,
                                               float shift = 0.0f) {
  enum { N = Chunk<T>::N };
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    mx[r] = -SMX_INF;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = c0 + k * tpr;
      const int j0 = c * N - rw[r].ofs;
      const int lim = rw[r].lim;
      if (SmxPast<T, M, NCH, AL>::SKIP && j0 >= lim) {
#pragma unroll
        for (int e = 0; e < N; ++e) v[r][k][e] = -SMX_INF;
        continue;
      }
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float xe = smx_to_f32(cx[r][k].e[e]);
        // An additive mask is added before the shift (the shift may be as large as the mask)
        v[r][k][e] = M::PRESENT && !M::HIDE ? M::apply(xe * scale, cm[r][k].e[e]) - shift
                     : SH                   ? M::apply(__fmul_rn(xe, scale) - shift, cm[r][k].e[e])
                                            : M::apply(fmaf(xe, scale, -0.0f), cm[r][k].e[e]);
      }
      // Not wholly visible: past the visible prefix (half the chunks of a causal row), or a
      // partial chunk (the general path: also before the row's start).  The kernels with a
      // mask keep the per-key test (as smx_hide_past, ptxas took the fp16 one with a bool
      // mask from 56 registers to 58, a block fewer per SM at 128 threads).
      if (AL && !M::PRESENT) {
        smx_hide_past(v[r][k], j0, lim);
      } else if (AL ? j0 + N > lim : (!smx_in(c, rw[r].c0, rw[r].c1) && !(j0 >= 0 && j0 + N <= lim))) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const int j = j0 + e;
          if (j < 0 || j >= lim) v[r][k][e] = -SMX_INF;
        }
      }
#pragma unroll
      for (int e = 0; e < N; ++e) mx[r] = fmaxf(mx[r], v[r][k][e]);
    }
  }
}

// STORE: y = v * inv (v already exponentiated), every element of the row that exists.
template <typename T, class M, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_fwd_store(const float (&v)[RPT][NCH][Chunk<T>::N], const float (&inv)[RPT],
                                              const FwdRow<T, M> (&rw)[RPT], const bool (&act)[RPT], int c0,
                                              int tpr, const SmxFwdParams& p) {
  enum { N = Chunk<T>::N };
  const bool vec = (p.flags & SMX_F_VEC) != 0;
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    if (!act[r]) continue;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = c0 + k * tpr;
      const int j0 = c * N - rw[r].ofs;
      float o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = v[r][k][e] * inv[r];
      Chunk<T> ch;
      ch.raw = smx_pack_chunk<T>(o);
      if (AL) {
        if (j0 < p.sk) smx_st16(rw[r].y + j0, ch.raw);
      } else if (smx_in(c, rw[r].c0, rw[r].cs1) || (vec && j0 >= 0 && j0 + N <= p.sk)) {
        smx_st16(rw[r].y + j0, ch.raw);
      } else if (j0 < p.sk && j0 + N > 0) {
        if (vec) {  // a row's partial first or last chunk: the row's bytes of its 16-byte block
          smx_st_part(rw[r].y + j0, ch.w, max(0, -j0) * (int)sizeof(T), min(N, p.sk - j0) * (int)sizeof(T));
        } else {
          smx_scatter<sizeof(T), 4>(rw[r].y, p.sy, ch.w, j0, p.sk, N);
        }
      }
    }
  }
}

// From the (max, sum) pair of each row's part held by this thread's warp (every lane
// holds it) to this thread's factor: the output is exp2(v * log2e - max_use(m)) * fac.
// Rows of at most 32 threads are done; wider rows exchange the warps' pairs once through
// `red` (RPT x 2 x warps).  LANES: lane i of every warp of the row takes warp i's pair and
// the lanes merge them (butterflies: every lane of every warp ends with the same bits);
// else every thread merges all the warps' pairs in turn, which costs a 512-thread row 16
// exp2 per thread (H200, 16-bit rows of 16384 keys with a mask: 68-74% of copy serial,
// 84-86% with LANES).  The lanes' merge keeps a few more values live: with it, kernels of
// 8 chunks per thread and of fp32 x (at the register caps, see test_softmax_compile.py)
// spilled, so they merge serially.
template <int RPT, bool LANES = false>
__device__ __forceinline__ void smx_row_stats(const float (&m)[RPT], const float (&s)[RPT], float (&fac)[RPT],
                                              int tpr, float (*red)[2][SMX_BLOCK / 32]) {
  if (tpr <= 32) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) fac[r] = smx_inv_sum(s[r]);
    return;
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      red[r][0][warp] = m[r];
      red[r][1][warp] = s[r];
    }
  }
  __syncthreads();
  const int wpr = tpr >> 5;
  const int first = tpr == (int)blockDim.x ? 0 : warp & ~(wpr - 1);  // the row's first warp
  if (LANES) {
    const int lane = threadIdx.x & 31;
    const bool in = lane < wpr;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const float mi = in ? red[r][0][first + lane] : -SMX_INF;
      const float si = in ? red[r][1][first + lane] : 0.0f;
      float M[1] = {mi};
      smx_warp_allreduce<OpMax, 1>(M, 32);
      // A warp that saw nothing visible adds nothing (its max may be -inf); NaN stays.
      float S[1] = {si == 0.0f ? 0.0f : si * smx_term(smx_max_use(mi), smx_max_use(M[0]))};
      smx_warp_allreduce<OpSum, 1>(S, 32);
      // This warp's terms were taken relative to its own max.
      const float f = m[r] == -SMX_INF ? 0.0f : smx_term(smx_max_use(m[r]), smx_max_use(M[0]));
      fac[r] = f * smx_inv_sum(S[0]);
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    float M = -SMX_INF;
#pragma unroll
    for (int i = 0; i < SMX_BLOCK / 32; ++i)
      if (i < wpr) M = fmaxf(M, red[r][0][first + i]);
    float S = 0.0f;
#pragma unroll
    for (int i = 0; i < SMX_BLOCK / 32; ++i) {
      if (i < wpr) {
        const float si = red[r][1][first + i];
        // A warp that saw nothing visible adds nothing (its max may be -inf); NaN stays.
        if (si != 0.0f) S += si * smx_term(smx_max_use(red[r][0][first + i]), smx_max_use(M));
      }
    }
    // This warp's terms were taken relative to its own max.
    const float f = m[r] == -SMX_INF ? 0.0f : smx_term(smx_max_use(m[r]), smx_max_use(M));
    fac[r] = f * smx_inv_sum(S);
  }
}

// The fold (the lean kernels here, the cluster tier's interior steps in softmax_cluster.cu):
// for 16-bit x without an additive mask and 0 < scale * log2e < inf, the max of x * scale
// is scale * max(x) (rounding is monotonic), taken on pairs of 16-bit values, and each
// term and output takes one FMA in its exponent: 2^(x * scale * log2e - shift).  See the
// cluster tier's comment for what that changes (under 2^-13 relative, where the max is
// below SMX_FOLD_MAX; rows whose max reaches it take the exact path).
template <typename T, class M> struct SmxFold {
  enum { ON = sizeof(T) == 2 && (!M::PRESENT || M::HIDE) };
};
#define SMX_FOLD_MAX 1024.0f
// A 16-bit -inf, twice (the fold's scale is positive: a hidden element hidden in x's bits
// becomes -inf after scaling, as M::apply makes it).
template <typename T> struct SmxNegInf2;
template <> struct SmxNegInf2<smx_f16> { enum : smx_u32 { V = 0xfc00fc00u }; };
template <> struct SmxNegInf2<smx_bf16> { enum : smx_u32 { V = 0xff80ff80u }; };
// Word w of 16-bit values with the halves that h selects (0xffff each) made -inf.
template <typename T> __device__ __forceinline__ smx_u32 smx_neg_inf_where(smx_u32 w, smx_u32 h) {
  return (w & ~h) | ((smx_u32)SmxNegInf2<T>::V & h);
}
// The larger of each half of two words of 16-bit floats (a NaN loses to a number, as in
// fmaxf: a NaN element still makes its terms, and so the row, NaN).
#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ smx_u32 smx_max2_of(smx_u32 a, smx_u32 b, smx_f16) {
  smx_u32 r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ smx_u32 smx_max2_of(smx_u32 a, smx_u32 b, smx_bf16) {
  smx_u32 r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif
template <typename T> __device__ __forceinline__ smx_u32 smx_max2(smx_u32 a, smx_u32 b) {
#if __CUDA_ARCH__ >= 800
  return smx_max2_of(a, b, T());
#else
  float a0, a1, b0, b1;
  smx_unpack2(a, a0, a1, T());
  smx_unpack2(b, b0, b1, T());
  return smx_pack2<T>(fmaxf(a0, b0), fmaxf(a1, b1));
#endif
}
// Their max: over pairs of 16-bit values a word at a time (four chains side by side), one
// conversion of the result.
template <typename T, int K> __device__ __forceinline__ float smx_fold_max(const Chunk<T> (&c)[K]) {
  smx_u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = c[0].w[i];
#pragma unroll
    for (int k = 1; k < K; ++k) w[i] = smx_max2<T>(w[i], c[k].w[i]);
  }
  w[0] = smx_max2<T>(smx_max2<T>(w[0], w[1]), smx_max2<T>(w[2], w[3]));
  float lo, hi;
  smx_unpack2(w[0], lo, hi, T());
  return fmaxf(lo, hi);
}
// Values a thread holds as fp32 at once.  Kernels of more ("lean" kernels: 16-bit x, 8
// chunks per thread, 64 values) keep only the raw chunks, half the registers, and compute
// each chunk's values afresh in each of three passes (max; sum; store): twice the loads in
// flight per register of the 4-chunk kernels, for a second exp2 per element.
#define SMX_HELD_VALUES 32
// Lean kernels are held to two 512-thread blocks per SM (64 registers: four blocks of the
// at most 256 threads they run with).  On sm_100 and later ptxas spills them heavily at 64,
// so there they keep the usual cap.
#if __CUDA_ARCH__ >= 1000
#define SMX_LEAN_MIN_BLOCKS 0
#else
#define SMX_LEAN_MIN_BLOCKS 2
#endif

// The raw chunks, as if changed: XORed with `z`, a zero the compiler cannot know (a flag
// bit never set), so values computed from them before cannot be reused after (the
// compiler would keep them live instead of computing them again).
template <typename T, class M, int NCH, int RPT>
__device__ __forceinline__ void smx_fwd_opaque(Chunk<T> (&cx)[RPT][NCH], MaskChunk<M, Chunk<T>::N> (&cm)[RPT][NCH],
                                               int& c0, int& tpr, smx_u32 z) {
  enum { MW = sizeof(cm[0][0].b.w) / 4 };
  // The chunk indices too: each is cheaper to compute again than to keep.
  c0 ^= (int)z;
  tpr ^= (int)z;
#pragma unroll
  for (int r = 0; r < RPT; ++r)
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i) cx[r][k].w[i] ^= z;
      if (M::PRESENT) {
#pragma unroll
        for (int i = 0; i < MW; ++i) cm[r][k].b.w[i] ^= z;
      }
    }
}

// VALUES of chunk k of row r alone (the lean kernels' passes).
template <typename T, class M, int NCH, int RPT, bool AL>
__device__ __forceinline__ float smx_fwd_chunk(float (&v)[1][1][Chunk<T>::N], const Chunk<T> (&cx)[RPT][NCH],
                                               const MaskChunk<M, Chunk<T>::N> (&cm)[RPT][NCH],
                                               const FwdRow<T, M> (&rw)[RPT], int r, int k, int c0, int tpr,
                                               float scale, float shift = 0.0f) {
  const Chunk<T> a[1][1] = {{cx[r][k]}};
  MaskChunk<M, Chunk<T>::N> b[1][1];
  if (M::PRESENT) b[0][0] = cm[r][k];
  const FwdRow<T, M> w[1] = {rw[r]};
  float mx[1];
  smx_fwd_values<T, M, 1, 1, AL, true>(v, mx, a, b, w, c0 + k * tpr, tpr, scale, shift);
  return mx[0];
}

// The lean kernels fold on sm_80 to sm_100 (before sm_80, no max over pairs of 16-bit
// values: the fold's unpacking spilled the bf16 kernel on sm_75; on sm_120 ptxas 13.5
// spilled both at 64 registers).
#if __CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1200
#define SMX_LEAN_FOLDS 1
#else
#define SMX_LEAN_FOLDS 0
#endif
// The fold's rows (whole chunks, no mask): a row whose visible prefix ends on a chunk's
// boundary (every row without causal or key_lengths) has no partial chunk; a thread's
// chunks past that prefix become -inf in x's own bits (their registers were never loaded),
// which the max ignores, whose terms are 0 and whose outputs (inside the row) store 0.
// Rows with a partial chunk take the exact path.
template <typename T, class M> __device__ __forceinline__ bool smx_fold_whole(const FwdRow<T, M>& rw) {
  return (rw.lim & (Chunk<T>::N - 1)) == 0;
}
template <typename T, class M, int NCH>
__device__ __forceinline__ void smx_fold_hide_past(Chunk<T> (&cx)[NCH], const FwdRow<T, M>& rw, int c0, int tpr) {
#pragma unroll
  for (int k = 0; k < NCH; ++k)
    if ((c0 + k * tpr) * Chunk<T>::N >= rw.lim) {
#pragma unroll
      for (int i = 0; i < 4; ++i) cx[k].w[i] = (smx_u32)SmxNegInf2<T>::V;
    }
}

// The forward after LOAD, for kernels that hold raw chunks only (see SMX_HELD_VALUES).
// Whole-chunk rows without a mask fold (SmxFold) where no chunk is partly visible
// (smx_fold_whole): the max over pairs of 16-bit values, one FMA in each term's and output's
// exponent (1 / sum folded into the output's).  On the H200 the exact passes came close to the issue limit (see _plan.LEAN_FROM).
template <typename T, class M, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_fwd_lean(Chunk<T> (&cx)[RPT][NCH], MaskChunk<M, Chunk<T>::N> (&cm)[RPT][NCH],
                                              FwdRow<T, M> (&rw)[RPT], const bool (&act)[RPT], int c0, int tpr,
                                              const SmxFwdParams& p, float (*red)[2][SMX_BLOCK / 32]) {
  enum { N = Chunk<T>::N, FOLD = SmxFold<T, M>::ON && !M::PRESENT && SMX_LEAN_FOLDS && AL };
  float mx[RPT], s[RPT], fac[RPT], mu[RPT];
  const float sl = p.scale * SMX_LOG2E;
  bool fold[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    fold[r] = FOLD && sl > 0.0f && sl < SMX_INF && smx_fold_whole<T, M>(rw[r]);
    if constexpr (FOLD) {
      if (fold[r]) {
        smx_fold_hide_past<T, M, NCH>(cx[r], rw[r], c0, tpr);
        mx[r] = smx_fold_max<T, NCH>(cx[r]) * p.scale;
        continue;
      }
    }
    mx[r] = -SMX_INF;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      float v[1][1][N];
      mx[r] = fmaxf(mx[r], smx_fwd_chunk<T, M, NCH, RPT, AL>(v, cx, cm, rw, r, k, c0, tpr, p.scale));
    }
  }
  smx_warp_allreduce<OpMax, RPT>(mx, tpr);
  smx_fwd_opaque<T, M, NCH, RPT>(cx, cm, c0, tpr, (smx_u32)p.flags & SMX_F_ZERO);
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    mu[r] = smx_max_use(mx[r]);
    s[r] = 0.0f;
    // (the warp's max: the same in every lane of it)
    fold[r] = fold[r] && fabsf(mu[r]) < SMX_FOLD_MAX;
    if (fold[r]) {
      const float ml = mu[r] * SMX_LOG2E;
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        float u[N];
        smx_chunk_f32<T>(cx[r][k], u);
#pragma unroll
        for (int e = 0; e < N; ++e) s[r] += smx_exp2(fmaf(u[e], sl, -ml));
      }
      continue;
    }
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      float v[1][1][N];
      smx_fwd_chunk<T, M, NCH, RPT, AL>(v, cx, cm, rw, r, k, c0, tpr, p.scale, mu[r]);
#pragma unroll
      for (int e = 0; e < N; ++e) s[r] += smx_term_of(v[0][0][e]);
    }
    s[r] = smx_fused_sum(s[r], mx[r]);
  }
  smx_warp_allreduce<OpSum, RPT>(s, tpr);
  smx_row_stats<RPT>(mx, s, fac, tpr, red);
  smx_fwd_opaque<T, M, NCH, RPT>(cx, cm, c0, tpr, (smx_u32)p.flags & SMX_F_ZERO);
  if (!AL) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) rw[r].cs1 = smx_fwd_cs1(rw[r], p);
  }
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    // fac > 0 and finite: the output's factor folds into its exponent (a factor of 0, a
    // warp that saw nothing of the row's max, stores through the exact path).  The choice
    // is made a chunk at a time: taken once for all chunks, ptxas kept every chunk's values
    // live across it and spilled.
    const bool sfold = fold[r] && fac[r] > 0.0f && fac[r] < SMX_INF;
    const float mls = mu[r] * SMX_LOG2E - smx_log2(fac[r]);
    const FwdRow<T, M> w[1] = {rw[r]};
    const bool a[1] = {act[r]};
    const float f[1] = {fac[r]};
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      float v[1][1][N];
      if (sfold) {
        if (act[r] && (c0 + k * tpr) * N < p.sk) {
          smx_chunk_f32<T>(cx[r][k], v[0][0]);
#pragma unroll
          for (int e = 0; e < N; ++e) v[0][0][e] = smx_exp2(fmaf(v[0][0][e], sl, -mls));
          smx_st16(rw[r].y + (c0 + k * tpr) * N, smx_pack_chunk<T>(v[0][0]));
        }
        continue;
      }
      smx_fwd_chunk<T, M, NCH, RPT, AL>(v, cx, cm, rw, r, k, c0, tpr, p.scale, mu[r]);
#pragma unroll
      for (int e = 0; e < N; ++e) v[0][0][e] = smx_term_of(v[0][0][e]);
      smx_fwd_store<T, M, 1, 1, AL>(v, f, w, a, c0 + k * tpr, tpr, p);
    }
  }
}

// Rows off the 16-byte grid with unit key stride (SMX_F_VEC), no mask, a row per thread
// group: "edged" rows.  Chunk c is the c-th whole 16-byte block inside the row, from the
// row's first 16-byte boundary (h elements in); the at most 2 (N - 1) keys outside those
// blocks (the head before it, the tail after the last) are taken one per lane in each of
// E slots.  No access leaves the row, and the chunk loop is the whole-chunk kernels' one:
// a chunk is partial only at the visible prefix (causal, key_lengths), never at the row's
// ends, so no lane runs per-key code there (the general path's first and last chunk).
template <typename T, int NCH> struct SmxEdged {
  enum { N = Chunk<T>::N, E = NCH <= 2 ? 2 : 1 };
  // Kernels with the path: 16-bit x (8 chunks per thread: lean, see smx_fwd_edged_lean), or
  // 2 chunks per thread (fp32 rows of more chunks measured faster on the general path: 95
  // against 92% of copy at Sk 4097, with 52 registers against 40).  A launch takes it where
  // every edge of a row has a lane's slot.
  enum { HAS = sizeof(T) == 2 || NCH == 2, LEAN = NCH * N > SMX_HELD_VALUES };
  static __device__ __forceinline__ bool fits(int tpr) { return tpr * E >= 2 * (N - 1); }
};

// The edged row's keys j >= clim of the chunk at key j0 made -inf (per key: as smx_hide_past,
// ptxas took the fp32 edged kernel of 2 chunks per thread from 32 registers to 34).
template <int N> __device__ __forceinline__ void smx_edged_hide(float (&v)[N], int j0, int clim) {
  if (j0 + N > clim) {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (j0 + e >= clim) v[e] = -SMX_INF;
  }
}
// Values of the edged row's chunk at key j0 (keys j >= clim hidden).
template <typename T>
__device__ __forceinline__ void smx_edged_values(float (&v)[Chunk<T>::N], const Chunk<T>& c, int j0, int clim,
                                                 float scale, float shift = 0.0f) {
  enum { N = Chunk<T>::N };
#pragma unroll
  for (int e = 0; e < N; ++e) v[e] = __fmul_rn(smx_to_f32(c.e[e]), scale) - shift;  // (see smx_fwd_values)
  smx_edged_hide(v, j0, clim);
}

// The edged lean kernels fold their sum's terms on sm_80 and later in fp16, on sm_80 to
// sm_90 in bf16 (there, at 128 registers, ptxas 13.5 spilled 80-96 bytes of the bf16 kernel
// with the fold on sm_100 and sm_120; 13.0 none).
template <typename T> struct SmxEdgedFold { enum { ON = 0 }; };
#if __CUDA_ARCH__ >= 800
template <> struct SmxEdgedFold<smx_f16> { enum { ON = 1 }; };
template <> struct SmxEdgedFold<smx_bf16> { enum { ON = __CUDA_ARCH__ < 1000 }; };
#endif
// x of the chunk as fp32, unscaled (the fold's terms; keys j >= clim -inf).
template <typename T>
__device__ __forceinline__ void smx_edged_raw(float (&u)[Chunk<T>::N], const Chunk<T>& c, int j0, int clim) {
  smx_chunk_f32<T>(c, u);
  smx_edged_hide(u, j0, clim);
}

template <typename T, class M, int NCH>
__device__ __forceinline__ void smx_fwd_edged(const FwdRow<T, M>& rw, bool act, int lane, int tpr,
                                              const SmxFwdParams& p, float (*red)[2][SMX_BLOCK / 32]) {
  enum { N = Chunk<T>::N, E = SmxEdged<T, NCH>::E };
  const int sk = p.sk;
  const int h = min((N - rw.ofs) & (N - 1), sk);  // the head: keys before the first boundary
  const int t0 = h + (sk - h) / N * N;            // the tail's first key (after the whole chunks)
  const int clim = min(rw.lim, t0);               // chunk keys j < clim are visible
  // LOAD: the chunks, then the edges (keys j >= sk: no edge in that slot).
  Chunk<T> cx[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int j0 = h + (lane + k * tpr) * N;
    if (j0 < clim) cx[k].raw = smx_ld16(rw.x + j0);
  }
  int ej[E];
  T ex[E];
#pragma unroll
  for (int q = 0; q < E; ++q) {
    const int i = lane + q * tpr;
    ej[q] = i < h ? i : i - h + t0;
    if (ej[q] < rw.lim) ex[q] = rw.x[ej[q]];
  }
  // VALUES, max.
  float v[NCH][N], ev[E], mx[1] = {-SMX_INF};
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    smx_edged_values<T>(v[k], cx[k], h + (lane + k * tpr) * N, clim, p.scale);
#pragma unroll
    for (int e = 0; e < N; ++e) mx[0] = fmaxf(mx[0], v[k][e]);
  }
#pragma unroll
  for (int q = 0; q < E; ++q) {
    ev[q] = ej[q] < rw.lim ? smx_to_f32(ex[q]) * p.scale : -SMX_INF;
    mx[0] = fmaxf(mx[0], ev[q]);
  }
  smx_warp_allreduce<OpMax, 1>(mx, tpr);
  // exp, sum.
  const float mu = smx_max_use(mx[0]);
  float s[1] = {0.0f}, fac[1];
#pragma unroll
  for (int k = 0; k < NCH; ++k)
#pragma unroll
    for (int e = 0; e < N; ++e) {
      v[k][e] = smx_term(v[k][e], mu);
      s[0] += v[k][e];
    }
#pragma unroll
  for (int q = 0; q < E; ++q) {
    ev[q] = smx_term(ev[q], mu);
    s[0] += ev[q];
  }
  smx_warp_allreduce<OpSum, 1>(s, tpr);
  smx_row_stats<1>(mx, s, fac, tpr, red);
  if (!act) return;
  // STORE: every chunk and edge of the row (hidden keys as zeros).
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int j0 = h + (lane + k * tpr) * N;
    if (j0 < t0) {
      float o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = v[k][e] * fac[0];
      smx_st16(rw.y + j0, smx_pack_chunk<T>(o));
    }
  }
#pragma unroll
  for (int q = 0; q < E; ++q)
    if (ej[q] < sk) rw.y[ej[q]] = smx_from_f32<T>(ev[q] * fac[0]);
}

// Edged rows of 16-bit x at 8 chunks per thread: the raw chunks held, their values
// computed afresh in each of three passes (max; sum; store), as smx_fwd_lean does for
// whole-chunk rows; the lane's edge is held as a value.  The max and the sum's terms fold
// (SmxEdgedFold).  Held to the lean kernels' 64 registers, ptxas spills nothing on sm_90
// (NVRTC 13.0 and 13.5); on the H200 an earlier build that spilled 24 bytes was still
// faster than 80 registers without spills (three blocks per SM): Sk 4097 fp16 / bf16 92.9
// / 91.8% of copy against 91.7 / 88.0.  As built (two rounds, against the unfolded passes
// with an FMA's unrounded shift, see smx_fwd_values): Sk 4097 95.8 / 96.5 (96.5 / 95.4),
// 16383 95.2 / 95.7 (96.2 / 94.5), 2047 96.4 / 96.2 (96.2 / 94.4).
template <typename T, class M, int NCH>
__device__ __forceinline__ void smx_fwd_edged_lean(const FwdRow<T, M>& rw, bool act, int lane, int tpr,
                                                   const SmxFwdParams& p, float (*red)[2][SMX_BLOCK / 32]) {
  enum { N = Chunk<T>::N };
  const int h = min((N - rw.ofs) & (N - 1), p.sk);
  const int t0 = h + (p.sk - h) / N * N;
  const int clim = min(rw.lim, t0);
  const smx_u32 z = (smx_u32)p.flags & SMX_F_ZERO;
  int j = h + lane * N;  // chunk k's key: j + k * step
  int step = tpr * N;
  Chunk<T> cx[1][NCH];
  MaskChunk<M, N> cm[1][NCH];  // (no mask: never read)
#pragma unroll
  for (int k = 0; k < NCH; ++k)
    if (j + k * step < clim) cx[0][k].raw = smx_ld16(rw.x + j + k * step);
  const int ej = lane < h ? lane : lane - h + t0;
  const bool est = act && ej < p.sk;  // this lane stores an edge
  float ev = -SMX_INF;
  if (ej < rw.lim) ev = smx_to_f32(rw.x[ej]) * p.scale;
  float mx[1] = {ev};
  // The max folds where 0 < scale < inf (smx_fold_max: scale * max(x), a chunk's hidden keys
  // -inf in x's bits; the passes below hide them again, and keep them -inf where they fold).
  const bool mfold = SmxEdgedFold<T>::ON && p.scale > 0.0f && p.scale < SMX_INF;
  if constexpr (SmxEdgedFold<T>::ON) {
    if (mfold) {
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        const int j0 = j + k * step;
        if (j0 + N > clim) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const smx_u32 m = (j0 + 2 * i >= clim ? 0x0000ffffu : 0u) | (j0 + 2 * i + 1 >= clim ? 0xffff0000u : 0u);
            cx[0][k].w[i] = smx_neg_inf_where<T>(cx[0][k].w[i], m);
          }
        }
      }
      mx[0] = fmaxf(mx[0], smx_fold_max<T, NCH>(cx[0]) * p.scale);
    }
  }
  if (!mfold) {
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      float v[N];
      smx_edged_values<T>(v, cx[0][k], j + k * step, clim, p.scale);
#pragma unroll
      for (int e = 0; e < N; ++e) mx[0] = fmaxf(mx[0], v[e]);
    }
  }
  smx_warp_allreduce<OpMax, 1>(mx, tpr);
  const float mu = smx_max_use(mx[0]);
  smx_fwd_opaque<T, M, NCH, 1>(cx, cm, j, step, z);  // the passes compute the values again
  ev = smx_term(ev, mu);
  float s[1] = {ev}, fac[1];
  // The sum's terms fold as smx_fwd_lean's do (one FMA in the exponent; the max is taken
  // exactly, the outputs too): a choice a chunk at a time, the same in the row's lanes.
  // (Folded in STORE as well, ptxas spilled 16-34 bytes more at the 64 registers.)
  const float sl = p.scale * SMX_LOG2E, ml = mu * SMX_LOG2E;
  const bool fold = SmxEdgedFold<T>::ON && sl > 0.0f && sl < SMX_INF && fabsf(mu) < SMX_FOLD_MAX;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    float v[N];
    if (fold) {
      smx_edged_raw<T>(v, cx[0][k], j + k * step, clim);
#pragma unroll
      for (int e = 0; e < N; ++e) s[0] += smx_exp2(fmaf(v[e], sl, -ml));
      continue;
    }
    smx_edged_values<T>(v, cx[0][k], j + k * step, clim, p.scale, mu);
#pragma unroll
    for (int e = 0; e < N; ++e) s[0] += smx_term_of(v[e]);
  }
  s[0] = smx_fused_sum(s[0], mx[0]);
  smx_warp_allreduce<OpSum, 1>(s, tpr);
  smx_row_stats<1>(mx, s, fac, tpr, red);
  if (!act) return;
  smx_fwd_opaque<T, M, NCH, 1>(cx, cm, j, step, z);
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int j0 = j + k * step;
    if (j0 < t0) {
      float v[N];
      smx_edged_values<T>(v, cx[0][k], j0, clim, p.scale, mu);
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = smx_term_of(v[e]) * fac[0];
      smx_st16(rw.y + j0, smx_pack_chunk<T>(v));
    }
  }
  if (est) rw.y[ej] = smx_from_f32<T>(ev * fac[0]);
}

// The 8-chunk general kernels of 16-bit x without a mask exist for edged rows: a launch
// that cannot take that path (the planner plans none: no 16-byte access, or fewer threads
// per row than edges) is still right, a key per thread at a time, each read three times.
template <typename T, class M>
__device__ __forceinline__ void smx_fwd_keywise(const FwdRow<T, M>& rw, bool act, int lane, int tpr,
                                                const SmxFwdParams& p, float (*red)[2][SMX_BLOCK / 32]) {
  float mx[1] = {-SMX_INF}, s[1] = {0.0f}, fac[1];
  for (int j = lane; j < rw.lim; j += tpr) mx[0] = fmaxf(mx[0], smx_to_f32(rw.x[(smx_i64)j * p.sx]) * p.scale);
  smx_warp_allreduce<OpMax, 1>(mx, tpr);
  const float mu = smx_max_use(mx[0]);
  for (int j = lane; j < rw.lim; j += tpr)
    s[0] += smx_term(smx_to_f32(rw.x[(smx_i64)j * p.sx]) * p.scale, mu);
  smx_warp_allreduce<OpSum, 1>(s, tpr);
  smx_row_stats<1>(mx, s, fac, tpr, red);
  if (!act) return;
  for (int j = lane; j < p.sk; j += tpr) {
    const float e = j < rw.lim ? smx_term(smx_to_f32(rw.x[(smx_i64)j * p.sx]) * p.scale, mu) : 0.0f;
    rw.y[(smx_i64)j * p.sy] = smx_from_f32<T>(e * fac[0]);
  }
}

// Everything after LOAD of the register tier's forward: VALUES, the row's (max, sum), STORE
// (the lean kernels' passes where a thread holds more than SMX_HELD_VALUES values).
template <typename T, class M, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_fwd_body(Chunk<T> (&cx)[RPT][NCH], MaskChunk<M, Chunk<T>::N> (&cm)[RPT][NCH],
                                             FwdRow<T, M> (&rw)[RPT], const bool (&act)[RPT], int lane, int tpr,
                                             const SmxFwdParams& p, float (*red)[2][SMX_BLOCK / 32]) {
  enum { N = Chunk<T>::N };
  if (NCH * N > SMX_HELD_VALUES) {
    smx_fwd_lean<T, M, NCH, RPT, AL>(cx, cm, rw, act, lane, tpr, p, red);
    return;
  }
  float v[RPT][NCH][N], mx[RPT], s[RPT], fac[RPT];
  smx_fwd_values<T, M, NCH, RPT, AL>(v, mx, cx, cm, rw, lane, tpr, p.scale);
  smx_warp_allreduce<OpMax, RPT>(mx, tpr);
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const float mu = smx_max_use(mx[r]);
    s[r] = 0.0f;
    // 16-bit whole-chunk rows: where the max is below SMX_FOLD_MAX, a term takes one FMA in
    // its exponent, 2^(v * log2e - max * log2e), the shift one rounded float (off by less
    // than 2^-13, about 2^-14 relative, as the fold's); exact (smx_term) otherwise, for fp32
    // and for the general path (there ptxas 13.5 spilled 8-12 bytes of the bf16 4-chunk
    // kernel on sm_100 and sm_120).  On the H200, causal [8,32,2048,2048] fp16 / bf16 0.842 /
    // 0.858 -> 0.821 / 0.834 ms, 16-bit rows without a prefix and masked ones within 1%
    // either way (registers in the same allocation unit on sm_90).
    if (sizeof(T) == 2 && AL && fabsf(mu) < SMX_FOLD_MAX) {
      const float ml = mu * SMX_LOG2E;
#pragma unroll
      for (int k = 0; k < NCH; ++k)
#pragma unroll
        for (int e = 0; e < N; ++e) {
          v[r][k][e] = smx_exp2(fmaf(v[r][k][e], SMX_LOG2E, -ml));
          s[r] += v[r][k][e];
        }
    } else {
#pragma unroll
      for (int k = 0; k < NCH; ++k)
#pragma unroll
        for (int e = 0; e < N; ++e) {
          v[r][k][e] = smx_term(v[r][k][e], mu);
          s[r] += v[r][k][e];
        }
    }
  }
  smx_warp_allreduce<OpSum, RPT>(s, tpr);
  smx_row_stats<RPT, sizeof(T) == 2 && NCH <= 4>(mx, s, fac, tpr, red);
  // cs1 afresh rather than kept live since the set-up: through LOAD and VALUES it costs
  // a register, which the general 16-bit kernels of 4 chunks with a mask spilled (sm_86,
  // sm_89, sm_90), as did the fp32 ones of 2 chunks (sm_86, sm_89).  The 16-bit kernels
  // without a mask keep it: recomputed, it costs them a spill on sm_75.
  if (!AL && (M::PRESENT || sizeof(T) == 4)) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) rw[r].cs1 = smx_fwd_cs1(rw[r], p);
  }
  smx_fwd_store<T, M, NCH, RPT, AL>(v, fac, rw, act, lane, tpr, p);
}

template <typename T, class M, int NCH, int RPT, bool AL>
__global__ void __launch_bounds__(SMX_BLOCK, NCH * Chunk<T>::N > SMX_HELD_VALUES ? SMX_LEAN_MIN_BLOCKS : 0)
smx_fwd(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask, const void* __restrict__ klen,
        const SmxFwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[RPT][2][SMX_BLOCK / 32];
  smx_rows_of_block rb(p.tpr_log2);
  const int tpr = rb.tpr, lane = rb.lane, rpb = rb.rpb;
  const smx_i64 row0 = (smx_i64)blockIdx.x * rpb * RPT + rb.first_row;

  if (!AL && !M::PRESENT && RPT == 1 && SmxEdged<T, NCH>::HAS) {
    const bool edged = (p.flags & SMX_F_VEC) && SmxEdged<T, NCH>::fits(tpr);
    if (edged || SmxEdged<T, NCH>::LEAN) {
      const FwdRow<T, M> r = smx_fwd_row<T, M, false>(x, y, mask, klen, p, row0);
      if (!SmxEdged<T, NCH>::LEAN)
        smx_fwd_edged<T, M, NCH>(r, row0 < p.rows, lane, tpr, p, red);
      else if (edged)
        smx_fwd_edged_lean<T, M, NCH>(r, row0 < p.rows, lane, tpr, p, red);
      else
        smx_fwd_keywise<T, M>(r, row0 < p.rows, lane, tpr, p, red);
      return;
    }
  }
  FwdRow<T, M> rw[RPT];
  bool act[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const smx_i64 row = row0 + (smx_i64)r * rpb;
    act[r] = row < p.rows;
    rw[r] = smx_fwd_row<T, M, AL>(x, y, mask, klen, p, row);
  }
  Chunk<T> cx[RPT][NCH];
  MaskChunk<M, N> cm[RPT][NCH];
  smx_fwd_load<T, M, NCH, RPT, AL>(cx, cm, rw, lane, tpr, p, x, (const typename M::S*)mask);
  smx_fwd_body<T, M, NCH, RPT, AL>(cx, cm, rw, act, lane, tpr, p, red);
}

// Rows longer than a block holds: one block per row (blockDim = threads per row), the
// row in segments of NCH chunks per thread.  Pass 1 keeps a running (max, sum) per
// thread; pass 2 reloads each segment and writes it.
template <typename T, class M, int NCH>
__global__ void __launch_bounds__(256)
smx_fwd_loop(const T* __restrict__ x, T* __restrict__ y, const void* __restrict__ mask,
             const void* __restrict__ klen, const SmxFwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[1][2][SMX_BLOCK / 32];
  const int tpr = blockDim.x;
  const int lane = threadIdx.x;
  FwdRow<T, M> rw[1];
  const bool act[1] = {true};
  rw[0] = smx_fwd_row<T, M, false>(x, y, mask, klen, p, (smx_i64)blockIdx.x);
  const int seg = NCH * tpr;                                 // chunks per segment
  const int nvis = (rw[0].lim + rw[0].ofs + N - 1) / N;      // chunks holding a visible key
  const int nall = (p.sk + rw[0].ofs + N - 1) / N;           // chunks of the row

  float m[1] = {-SMX_INF}, s[1] = {0.0f}, fac[1];
  for (int c0 = 0; c0 < nvis; c0 += seg) {
    Chunk<T> cx[1][NCH];
    MaskChunk<M, N> cm[1][NCH];
    float v[1][NCH][N], mx[1];
    smx_fwd_load<T, M, NCH, 1, false>(cx, cm, rw, c0 + lane, tpr, p, x, (const typename M::S*)mask);
    smx_fwd_values<T, M, NCH, 1, false>(v, mx, cx, cm, rw, c0 + lane, tpr, p.scale);
    const float mu = smx_max_use(mx[0]);
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < NCH; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) t += smx_term(v[0][k][e], mu);
    smx_pair_merge(m[0], s[0], mx[0], t);
  }
  // Thread pairs -> warp pairs -> row: merge within the warp by shuffles first.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m[0], o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s[0], o);
    smx_pair_merge(m[0], s[0], m2, s2);
  }
  smx_row_stats<1>(m, s, fac, tpr, red);
  const float mu = smx_max_use(m[0]);
  for (int c0 = 0; c0 < nall; c0 += seg) {
    Chunk<T> cx[1][NCH];
    MaskChunk<M, N> cm[1][NCH];
    float v[1][NCH][N], mx[1];
    smx_fwd_load<T, M, NCH, 1, false>(cx, cm, rw, c0 + lane, tpr, p, x, (const typename M::S*)mask);
    smx_fwd_values<T, M, NCH, 1, false>(v, mx, cx, cm, rw, c0 + lane, tpr, p.scale);
#pragma unroll
    for (int k = 0; k < NCH; ++k)
#pragma unroll
      for (int e = 0; e < N; ++e) v[0][k][e] = smx_term(v[0][k][e], mu);
    smx_fwd_store<T, M, NCH, 1, false>(v, fac, rw, act, c0 + lane, tpr, p);
  }
}
