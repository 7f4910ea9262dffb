// drvsoftmax backward: dx = scale * y * (dy - sum(dy * y)) over the last axis.
//
// The forward's skeleton without a mask: LOAD every chunk of dy and y a thread owns, raw;
// the row's dot product; STORE dx.  Positions where y == 0 (hidden keys, fully hidden
// rows) get exactly 0.  dy and y are only read.
//   smx_bwd<T, NCH, RPT>   a row in registers (tpr threads x NCH chunks, RPT rows each)
//   smx_bwd_loop<T, NCH>   a block per row, any length: the dot product, then a pass
//                          that reloads and writes.
#include "softmax_common.cuh"

template <typename T> struct BwdRow {
  const T* dy;
  const T* y;
  T* dx;
  int ofs;   // as FwdRow::ofs
  bool act;
  int c0, c1;  // chunks c0 <= c < c1 are whole 16-byte blocks inside the row (vector access)
};

template <typename T, bool AL>
__device__ __forceinline__ BwdRow<T> smx_bwd_row(const T* dy, const T* y, T* dx, const SmxBwdParams& p,
                                                 smx_i64 row) {
  BwdRow<T> r;
  r.dy = dy;
  r.y = y;
  r.dx = dx;
  r.ofs = 0;
  r.act = row < p.rows;
  r.c0 = r.c1 = 0;
  if (!r.act) return r;
  const bool small = (p.flags & SMX_F_SMALL) != 0;
  const smx_i64 oy = smx_row_offset(p.map_y, row, small);
  const bool same = (p.flags & SMX_F_SAMEMAP) != 0;
  r.dy = dy + (same ? oy : smx_row_offset(p.map_dy, row, small));
  r.y = y + oy;
  r.dx = dx + (same ? oy : smx_row_offset(p.map_dx, row, small));
  if (!AL && (p.flags & SMX_F_VEC)) {
    enum { N = Chunk<T>::N };
    r.ofs = (int)(((smx_u64)r.y & 15) / sizeof(T));
    r.c0 = r.ofs > 0;
    r.c1 = max(r.c0, (p.sk + r.ofs) / N);  // an empty range stays empty for smx_in
  }
  return r;
}

// One chunk of a row (elements j0 .. j0 + N - 1), raw; element-wise where it is not a
// whole aligned chunk inside the row.
template <typename T>
__device__ __forceinline__ void smx_load_chunk(Chunk<T>& ch, const T* row, smx_i64 st, int j0, int sk, bool vec,
                                               const T* base, smx_i64 span) {
  enum { N = Chunk<T>::N };
  if (j0 < sk && j0 + N > 0) {
    if (vec && ((j0 >= 0 && j0 + N <= sk) || (row + j0 >= base && row + j0 + N <= base + span))) {
      ch.raw = smx_ld16(row + j0);
    } else {
      smx_gather<sizeof(T), 4>(ch.w, row, st, j0, sk, N);
    }
  }
}

template <typename T, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_bwd_load(Chunk<T> (&cd)[RPT][NCH], Chunk<T> (&cy)[RPT][NCH],
                                             const BwdRow<T> (&rw)[RPT], int c0, int tpr, const SmxBwdParams& p,
                                             const T* dy, const T* y) {
  enum { N = Chunk<T>::N };
  const bool vec = (p.flags & SMX_F_VEC) != 0;
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int sk = rw[r].act ? p.sk : 0;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = c0 + k * tpr;
      const int j0 = c * N - rw[r].ofs;
      if (AL) {
        if (j0 < sk) {
          cd[r][k].raw = smx_ld16(rw[r].dy + j0);
          cy[r][k].raw = smx_ld16(rw[r].y + j0);
        }
        continue;
      }
      if (smx_in(c, rw[r].c0, rw[r].c1)) {
        cd[r][k].raw = smx_ld16(rw[r].dy + j0);
        cy[r][k].raw = smx_ld16(rw[r].y + j0);
        continue;
      }
      smx_load_chunk<T>(cd[r][k], rw[r].dy, p.sdy, j0, sk, vec, dy, p.span_dy);
      smx_load_chunk<T>(cy[r][k], rw[r].y, p.sy, j0, sk, vec, y, p.span_y);
    }
  }
}

// Each row's partial dot product of dy and y over this thread's chunks (0 outside the row).
template <typename T, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_bwd_dot(float (&dot)[RPT], const Chunk<T> (&cd)[RPT][NCH],
                                            const Chunk<T> (&cy)[RPT][NCH], const BwdRow<T> (&rw)[RPT], int c0,
                                            int tpr, int sk_) {
  enum { N = Chunk<T>::N };
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int sk = rw[r].act ? sk_ : 0;
    dot[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = c0 + k * tpr;
      const int j0 = c * N - rw[r].ofs;
      if (AL ? j0 < sk : (smx_in(c, rw[r].c0, rw[r].c1) || (j0 >= 0 && j0 + N <= sk))) {
#pragma unroll
        for (int e = 0; e < N; ++e) dot[r] = fmaf(smx_to_f32(cd[r][k].e[e]), smx_to_f32(cy[r][k].e[e]), dot[r]);
      } else {  // a chunk not wholly inside the row: rare
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const int j = j0 + e;
          if (j >= 0 && j < sk) dot[r] = fmaf(smx_to_f32(cd[r][k].e[e]), smx_to_f32(cy[r][k].e[e]), dot[r]);
        }
      }
    }
  }
}

// dx of this thread's chunks, converting dy and y again from the raw chunks.
template <typename T, int NCH, int RPT, bool AL>
__device__ __forceinline__ void smx_bwd_store(const Chunk<T> (&cd)[RPT][NCH], const Chunk<T> (&cy)[RPT][NCH],
                                              const float (&dot)[RPT], const BwdRow<T> (&rw)[RPT], int c0, int tpr,
                                              const SmxBwdParams& p) {
  enum { N = Chunk<T>::N };
  const bool vec = (p.flags & SMX_F_VEC) != 0;
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    if (!rw[r].act) continue;
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      const int c = c0 + k * tpr;
      const int j0 = c * N - rw[r].ofs;
      float o[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float yv = smx_to_f32(cy[r][k].e[e]);
        o[e] = yv == 0.0f ? 0.0f : p.scale * yv * (smx_to_f32(cd[r][k].e[e]) - dot[r]);
      }
      Chunk<T> ch;
      ch.raw = smx_pack_chunk<T>(o);
      if (AL) {
        if (j0 < p.sk) smx_st16(rw[r].dx + j0, ch.raw);
      } else if (smx_in(c, rw[r].c0, rw[r].c1) || (vec && j0 >= 0 && j0 + N <= p.sk)) {
        smx_st16(rw[r].dx + j0, ch.raw);
      } else if (j0 < p.sk && j0 + N > 0) {
        if (vec) {  // as the forward's STORE
          smx_st_part(rw[r].dx + j0, ch.w, max(0, -j0) * (int)sizeof(T), min(N, p.sk - j0) * (int)sizeof(T));
        } else {
          smx_scatter<sizeof(T), 4>(rw[r].dx, p.sdx, ch.w, j0, p.sk, N);
        }
      }
    }
  }
}

// Sum of each row over all its threads (every lane of the row gets it).
template <int RPT>
__device__ __forceinline__ void smx_row_sum(float (&v)[RPT], int tpr, float (*red)[SMX_BLOCK / 32]) {
  smx_warp_allreduce<OpSum, RPT>(v, tpr);
  if (tpr <= 32) return;
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) red[r][warp] = v[r];
  }
  __syncthreads();
  const int wpr = tpr >> 5;
  const int first = tpr == (int)blockDim.x ? 0 : warp & ~(wpr - 1);  // the row's first warp
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    float t = red[r][first];
#pragma unroll
    for (int i = 1; i < SMX_BLOCK / 32; ++i)
      if (i < wpr) t += red[r][first + i];
    v[r] = t;
  }
}

template <typename T, int NCH, int RPT, bool AL>
__global__ void __launch_bounds__(SMX_BLOCK)
smx_bwd(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[RPT][SMX_BLOCK / 32];
  smx_rows_of_block rb(p.tpr_log2);
  const int tpr = rb.tpr, lane = rb.lane, rpb = rb.rpb;
  const smx_i64 row0 = (smx_i64)blockIdx.x * rpb * RPT + rb.first_row;
  BwdRow<T> rw[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) rw[r] = smx_bwd_row<T, AL>(dy, y, dx, p, row0 + (smx_i64)r * rpb);
  Chunk<T> cd[RPT][NCH], cy[RPT][NCH];
  smx_bwd_load<T, NCH, RPT, AL>(cd, cy, rw, lane, tpr, p, dy, y);
  float dot[RPT];
  smx_bwd_dot<T, NCH, RPT, AL>(dot, cd, cy, rw, lane, tpr, p.sk);
  smx_row_sum<RPT>(dot, tpr, red);
  smx_bwd_store<T, NCH, RPT, AL>(cd, cy, dot, rw, lane, tpr, p);
}

template <typename T, int NCH>
__global__ void __launch_bounds__(256)
smx_bwd_loop(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, const SmxBwdParams p) {
  enum { N = Chunk<T>::N };
  __shared__ float red[1][SMX_BLOCK / 32];
  const int tpr = blockDim.x;
  const int lane = threadIdx.x;
  BwdRow<T> rw[1];
  rw[0] = smx_bwd_row<T, false>(dy, y, dx, p, (smx_i64)blockIdx.x);
  const int seg = NCH * tpr;
  const int nall = (p.sk + rw[0].ofs + N - 1) / N;
  float dot[1] = {0.0f};
  for (int c0 = 0; c0 < nall; c0 += seg) {
    Chunk<T> cd[1][NCH], cy[1][NCH];
    float t[1];
    smx_bwd_load<T, NCH, 1, false>(cd, cy, rw, c0 + lane, tpr, p, dy, y);
    smx_bwd_dot<T, NCH, 1, false>(t, cd, cy, rw, c0 + lane, tpr, p.sk);
    dot[0] += t[0];
  }
  smx_row_sum<1>(dot, tpr, red);
  for (int c0 = 0; c0 < nall; c0 += seg) {
    Chunk<T> cd[1][NCH], cy[1][NCH];
    smx_bwd_load<T, NCH, 1, false>(cd, cy, rw, c0 + lane, tpr, p, dy, y);
    smx_bwd_store<T, NCH, 1, false>(cd, cy, dot, rw, c0 + lane, tpr, p);
  }
}
