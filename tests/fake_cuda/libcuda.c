/* A stand-in CUDA driver for running examples/c/main.c on the CPU (tests/test_softmax_capi.py).
 *
 * "Device memory" is host memory.  cuLibraryLoadFromFile reads a real cubin or PTX file and
 * cuLibraryGetKernel finds the symbol in it (so the manifest's file and symbol must agree);
 * cuLaunchKernel runs the forward kernel's contract on the host from its symbol (dtype,
 * mask source, chunks and rows per thread) and its SmxFwdParams, reading row offsets
 * through the row maps as the kernels do (magic numbers under SMX_F_SMALL), after checking
 * that the grid and block cover every row and every chunk of a row.  The device reports
 * compute capability $FAKE_CUDA_CC (default 90).
 */
#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "drvsoftmax.h"

static int initialised, have_ctx;

CUresult cuInit(unsigned int flags) {
  initialised = flags == 0;
  return initialised ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_NOT_FOUND ? "CUDA_ERROR_NOT_FOUND" : e == CUDA_ERROR_LAUNCH_FAILED ? "CUDA_ERROR_LAUNCH_FAILED" : "CUDA_ERROR";
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  (void)e;
  *s = "stand-in driver";
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  *d = ordinal;
  return ordinal == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  const char* env = getenv("FAKE_CUDA_CC");
  const int cc = env ? atoi(env) : 90;
  (void)d;
  if (a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) *v = cc / 10;
  else if (a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) *v = cc % 10;
  else return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  (void)d;
  *c = (CUcontext)&have_ctx;
  return initialised ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d) {
  (void)d;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  have_ctx = c != NULL;
  return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) { return have_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

/* ---- libraries and kernels ---- */
struct CUlib_st {
  char* data;
  size_t size;
};
struct CUkern_st {
  char sym[512];
  int dtype, mask, mtype, loop, nch, rpt, whole; /* mask: 0 none, 1 hide (mtype: bytes), 2 add (mtype: 0 f16 1 bf16 2 f32 3 f64) */
};

CUresult cuLibraryLoadFromFile(CUlibrary* lib, const char* file, CUjit_option* o, void** ov, unsigned int no,
                               CUlibraryOption* lo, void** lov, unsigned int nlo) {
  (void)o, (void)ov, (void)no, (void)lo, (void)lov, (void)nlo;
  if (!have_ctx) return CUDA_ERROR_INVALID_VALUE;
  FILE* f = fopen(file, "rb");
  if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
  struct CUlib_st* l = (struct CUlib_st*)calloc(1, sizeof(*l));
  fseek(f, 0, SEEK_END);
  l->size = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  l->data = (char*)malloc(l->size + 1);
  if (fread(l->data, 1, l->size, f) != l->size) l->size = 0;
  l->data[l->size] = 0;
  fclose(f);
  if (l->size < 4 || (memcmp(l->data, "\x7f" "ELF", 4) != 0 && !strstr(l->data, ".version"))) return CUDA_ERROR_INVALID_IMAGE;
  *lib = l;
  return CUDA_SUCCESS;
}
CUresult cuLibraryUnload(CUlibrary lib) {
  free(lib->data);
  free(lib);
  return CUDA_SUCCESS;
}

static const char* eat(const char* p, const char* tok) { return p && !strncmp(p, tok, strlen(tok)) ? p + strlen(tok) : NULL; }
static const char* eat_int(const char* p, int* v) { /* Li<n>E */
  char* e;
  if (!(p = eat(p, "Li"))) return NULL;
  *v = (int)strtol(p, &e, 10);
  return *e == 'E' ? e + 1 : NULL;
}
static const char* eat_type(const char* p, int* t) { /* 0 f16, 1 bf16, 2 f32, 3 f64 */
  const char* q;
  if ((q = eat(p, "7smx_f16"))) return *t = 0, q;
  if ((q = eat(p, "8smx_bf16"))) return *t = 1, q;
  if ((q = eat(p, "f"))) return *t = 2, q;
  if ((q = eat(p, "d"))) return *t = 3, q;
  return NULL;
}

CUresult cuLibraryGetKernel(CUkernel* k, CUlibrary lib, const char* name) {
  size_t n = strlen(name);
  int found = 0;
  for (size_t i = 0; !found && i + n <= lib->size; ++i) {
    const unsigned char next = i + n < lib->size ? (unsigned char)lib->data[i + n] : 0;
    found = !memcmp(lib->data + i, name, n) && !isalnum(next) && next != '_';
  }
  if (!found || n >= sizeof((*k)->sym)) return CUDA_ERROR_NOT_FOUND;
  struct CUkern_st* kk = (struct CUkern_st*)calloc(1, sizeof(*kk));
  memcpy(kk->sym, name, n + 1);
  const char* p = eat(name, "_Z7smx_fwdI");
  if (!p && (p = eat(name, "_Z12smx_fwd_loopI"))) kk->loop = 1;
  if (!(p = eat_type(p, &kk->dtype)) || kk->dtype > 2) return CUDA_ERROR_NOT_FOUND;
  const char* q;
  if ((q = eat(p, "8MaskNone"))) {
    kk->mask = 0;
  } else if ((q = eat(p, "8MaskHideI"))) {
    kk->mask = 1;
    kk->mtype = *q == 'h' ? 1 : *q == 't' ? 2 : *q == 'j' ? 4 : *q == 'y' ? 8 : 0;
    q = kk->mtype ? eat(q + 1, "E") : NULL;
  } else if ((q = eat(p, "7MaskAddI"))) {
    kk->mask = 2;
    const char* s = eat(q, "S0_");
    if (s) kk->mtype = kk->dtype;
    q = eat(s ? s : eat_type(q, &kk->mtype), "E");
  }
  if (!q || !(q = eat_int(q, &kk->nch)) || (!kk->loop && !(q = eat_int(q, &kk->rpt)))) return CUDA_ERROR_NOT_FOUND;
  if (!kk->loop) { /* the whole-chunk flag: Lb0E or Lb1E */
    if ((p = eat(q, "Lb1E"))) kk->whole = 1;
    else if (!(p = eat(q, "Lb0E"))) return CUDA_ERROR_NOT_FOUND;
  }
  if (kk->loop) kk->rpt = 1;
  *k = kk;
  return CUDA_SUCCESS;
}
CUresult cuKernelGetFunction(CUfunction* f, CUkernel k) {
  *f = (CUfunction)k;
  return have_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- memory ---- */
CUresult cuMemAlloc(CUdeviceptr* p, size_t n) {
  void* m = aligned_alloc(256, (n + 255) / 256 * 256);
  *p = (CUdeviceptr)(uintptr_t)m;
  return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemFree(CUdeviceptr p) {
  free((void*)(uintptr_t)p);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoD(CUdeviceptr d, const void* s, size_t n) {
  memcpy((void*)(uintptr_t)d, s, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoH(void* d, CUdeviceptr s, size_t n) {
  memcpy(d, (const void*)(uintptr_t)s, n);
  return CUDA_SUCCESS;
}
CUresult cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) {
  memset((void*)(uintptr_t)d, v, n);
  return CUDA_SUCCESS;
}

/* ---- the forward kernel's contract ---- */
static float f16_to_f32(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 0x400), e - 25);
  return h & 0x8000 ? -v : v;
}
static uint16_t f32_to_f16(float f) { /* round to nearest even, through the double's exact rounding of a scaled value */
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const float a = fabsf(f);
  if (isnan(f)) return 0x7e00;
  if (a == 0.0f) return sign;
  if (a >= 65520.0f) return sign | 0x7c00;
  int e;
  frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
  if (e < -13) e = -13; /* subnormal: units of 2^-24 */
  const float q = nearbyintf(ldexpf(a, 11 - e)); /* 11 significant bits */
  const uint32_t bits = (uint32_t)q; /* 1024..2048 for normal numbers, less for subnormal */
  if (e == -13 && bits < 1024) return sign | (uint16_t)bits;
  const int be = e + 14 + (bits == 2048);
  return sign | (uint16_t)((be << 10) | ((bits == 2048 ? 1024 : bits) - 1024));
}
static float load_t(int t, const void* p, smx_i64 i) {
  if (t == 2) return ((const float*)p)[i];
  if (t == 3) return (float)((const double*)p)[i];
  const uint16_t b = ((const uint16_t*)p)[i];
  if (t == 0) return f16_to_f32(b);
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static void store_t(int t, void* p, smx_i64 i, float v) {
  if (t == 2) {
    ((float*)p)[i] = v;
  } else if (t == 0) {
    ((uint16_t*)p)[i] = f32_to_f16(v);
  } else {
    uint32_t u;
    memcpy(&u, &v, 4);
    ((uint16_t*)p)[i] = isnan(v) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}
static smx_i64 row_offset(const SmxRowMap* m, smx_i64 row, int small) {
  smx_i64 off = 0;
  for (int t = 0; t < m->nterms; ++t) {
    smx_i64 q;
    if (small) {
      uint32_t r = (uint32_t)row, qq = m->dmul[t] ? (uint32_t)(((uint64_t)r * m->dmul[t]) >> 32) >> m->dshr[t] : r;
      if (m->mod[t]) qq -= ((uint32_t)(((uint64_t)qq * m->mmul[t]) >> 32) >> m->mshr[t]) * (uint32_t)m->mod[t];
      q = qq;
    } else {
      q = row / m->div[t];
      if (m->mod[t]) q %= m->mod[t];
    }
    off += q * m->stride[t];
  }
  return off;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                        unsigned int bz, unsigned int shmem, CUstream s, void** args, void** extra) {
  const struct CUkern_st* k = (const struct CUkern_st*)f;
  (void)s;
  if (!have_ctx || gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem || extra || !args) return CUDA_ERROR_INVALID_VALUE;
  const char* x = (const char*)(uintptr_t) * (CUdeviceptr*)args[0];
  char* y = (char*)(uintptr_t) * (CUdeviceptr*)args[1];
  const char* mask = (const char*)(uintptr_t) * (CUdeviceptr*)args[2];
  const char* klen = (const char*)(uintptr_t) * (CUdeviceptr*)args[3];
  const SmxFwdParams* p = (const SmxFwdParams*)args[4];
  const int small = (p->flags & SMX_F_SMALL) != 0, item = smx_dtype_size(k->dtype), n = 16 / item;
  /* Threads per row: 2^tpr_log2, or the whole block where that is narrower (one row per block). */
  const int tpr = (1 << p->tpr_log2) < (int)bx ? 1 << p->tpr_log2 : (int)bx;
  const smx_i64 rpb = (smx_i64)(bx / tpr) * k->rpt;
  /* The launch covers every row (with no idle block), and every chunk of a row. */
  if (k->loop ? (bx != SMX_BLOCK_THREADS || gx != p->rows) : (bx % 32 || gx * rpb < p->rows || (gx - 1) * rpb >= p->rows)) {
    fprintf(stderr, "stand-in driver: grid %u x block %u (tpr %d, rpt %d) does not fit %lld rows\n", gx, bx, tpr, k->rpt, (long long)p->rows);
    return CUDA_ERROR_LAUNCH_FAILED;
  }
  float* v = (float*)malloc(sizeof(float) * (size_t)(p->sk > 0 ? p->sk : 1));
  for (smx_i64 r = 0; r < p->rows; ++r) {
    const smx_i64 ox = row_offset(&p->map_x, r, small);
    const smx_i64 oy = (p->flags & SMX_F_SAMEMAP) ? ox : row_offset(&p->map_y, r, small);
    const int ofs = (p->flags & SMX_F_VEC) ? (int)(((uintptr_t)(x + ox * item) & 15) / item) : 0;
    if (k->whole && (ofs || p->sk % n || !(p->flags & SMX_F_VEC))) {
      fprintf(stderr, "stand-in driver: a whole-chunk kernel on a row off the chunk grid\n");
      free(v);
      return CUDA_ERROR_LAUNCH_FAILED;
    }
    if (!k->loop && (smx_i64)tpr * k->nch * n < p->sk + ofs) {
      fprintf(stderr, "stand-in driver: %d threads x %d chunks do not cover a row of %d\n", tpr, k->nch, p->sk);
      free(v);
      return CUDA_ERROR_LAUNCH_FAILED;
    }
    smx_i64 lim = p->sk;
    if (p->flags & SMX_F_KLEN) {
      const smx_i64 i = row_offset(&p->map_k, r, small);
      const smx_i64 kl = (p->flags & SMX_F_KLEN64) ? ((const smx_i64*)klen)[i] : ((const int*)klen)[i];
      lim = kl < lim ? kl : lim;
    }
    if (p->flags & SMX_F_CAUSAL) {
      const smx_i64 c = row_offset(&p->map_q, r, small) + p->causal_shift + 1;
      lim = c < lim ? c : lim;
    }
    const smx_i64 om = k->mask ? row_offset(&p->map_m, r, small) : 0;
    float mx = -INFINITY, sum = 0.0f;
    for (int j = 0; j < p->sk; ++j) {
      float z = load_t(k->dtype, x, ox + j * p->sx) * p->scale;
      if (k->mask == 1) {
        const char* e = mask + (om + j * p->sm) * k->mtype;
        int hidden = 0;
        for (int b = 0; b < k->mtype; ++b) hidden |= e[b] != 0;
        if (hidden) z = -INFINITY;
      } else if (k->mask == 2) {
        z += load_t(k->mtype, mask, om + j * p->sm);
      }
      v[j] = j < lim ? z : -INFINITY;
      mx = fmaxf(mx, v[j]);
    }
    const float mu = mx == -INFINITY ? 0.0f : mx;
    for (int j = 0; j < p->sk; ++j) sum += v[j] == -INFINITY ? 0.0f : expf(v[j] - mu);
    for (int j = 0; j < p->sk; ++j) store_t(k->dtype, y, oy + j * p->sy, sum == 0.0f || v[j] == -INFINITY ? 0.0f : expf(v[j] - mu) / sum);
  }
  free(v);
  return CUDA_SUCCESS;
}
