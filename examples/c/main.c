/* A masked softmax forward on the GPU from C, through drvsoftmax's packaged cubins and the
 * CUDA driver API alone (no runtime API, no Python), checked against a double-precision
 * reference on the host.
 *
 *   softmax_demo [--dtype float16|bfloat16|float32] [--shape B H Sq Sk] [--scale S] ARTIFACTS
 *   softmax_demo [options] --cubin FILE --symbol SYMBOL
 *
 * ARTIFACTS is a folder with manifest.json and the cubins: an installed wheel's
 * drvsoftmax/_prebuilt, or the --out folder of `python build_ptx.py`.  The program computes
 * y = softmax(x * scale + mask) for x of shape [B, H, Sq, Sk] and a bool mask [B, 1, Sq, Sk]
 * (nonzero hides; one row is hidden entirely and must come out as zeros), prints PASS or
 * FAIL and exits 0 only on PASS.  Build (examples/c/README.md):
 *
 *   cc -O2 -std=c11 -I<drvsoftmax include dir> -I/usr/local/cuda/include main.c \
 *      -o softmax_demo -L/usr/local/cuda/lib64/stubs -lcuda
 */
#include <cuda.h>
#include <math.h> /* INFINITY only: nothing of libm is linked */
#include <stdint.h>
#include <stdlib.h>

#include "drvsoftmax.h"

#define CHECK(call)                                                                               \
  do {                                                                                            \
    CUresult err_ = (call);                                                                       \
    if (err_ != CUDA_SUCCESS) {                                                                   \
      const char *name_ = "?", *what_ = "?";                                                      \
      cuGetErrorName(err_, &name_);                                                               \
      cuGetErrorString(err_, &what_);                                                             \
      fprintf(stderr, "softmax_demo: %s failed: %s (%s)\n", #call, name_, what_);                 \
      exit(2);                                                                                    \
    }                                                                                             \
  } while (0)

static void die(const char* msg, const char* detail) {
  fprintf(stderr, "softmax_demo: %s%s\n", msg, detail ? detail : "");
  exit(2);
}

/* ------------------------------------------------------------------------------------------
 * Storage formats: float32, and 16-bit float16 / bfloat16 bit patterns (round to nearest even). */
static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t float_to_half(float f) {
  const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
  if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
    if (ax <= 0x33000000u) return (uint16_t)sign;
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return (uint16_t)(sign | q);
  }
  const uint32_t r = ax - 0x38000000u; /* rebias the exponent from 127 to 15 */
  return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return f32_from_bits(sign | 0x7f800000u | (m << 13));
  if (e) return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
  if (!m) return f32_from_bits(sign);
  e = 113;
  while (!(m & 0x400u)) {
    m <<= 1;
    --e;
  }
  return f32_from_bits(sign | (e << 23) | ((m & 0x3ffu) << 13));
}

static uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_to_float(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

static void store(int dtype, void* buf, size_t i, float v) {
  if (dtype == SMX_FLOAT32)
    ((float*)buf)[i] = v;
  else
    ((uint16_t*)buf)[i] = dtype == SMX_FLOAT16 ? float_to_half(v) : float_to_bf16(v);
}
static double load(int dtype, const void* buf, size_t i) {
  if (dtype == SMX_FLOAT32) return ((const float*)buf)[i];
  const uint16_t b = ((const uint16_t*)buf)[i];
  return dtype == SMX_FLOAT16 ? half_to_float(b) : bf16_to_float(b);
}

/* e^x for x <= 0 in double precision, without libm: x = k ln2 + r, a series for e^r. */
static double exp_nonpositive(double x) {
  const double ln2 = 0.69314718055994530942;
  if (x < -745.0) return 0.0;
  int k = (int)(x / ln2);
  const double r = x - k * ln2;
  double term = 1.0, sum = 1.0;
  for (int i = 1; i < 30; ++i) {
    term *= r / i;
    sum += term;
  }
  for (; k < 0; ++k) sum *= 0.5;
  return sum;
}

/* ------------------------------------------------------------------------------------------
 * The manifest: a minimal reader of the `symbols` table build_ptx.py writes (sorted keys,
 * no escapes in names).  A larger program would use its JSON library. */
static char* read_text(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  const long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* s = (char*)malloc((size_t)n + 1);
  if (!s || fread(s, 1, (size_t)n, f) != (size_t)n) die("cannot read ", path);
  s[n] = 0;
  fclose(f);
  return s;
}

/* The position just after `"key":` at or after p, or NULL. */
static const char* after_key(const char* p, const char* key) {
  const size_t n = strlen(key);
  for (const char* q = p; (q = strchr(q, '"')) != NULL; ++q) {
    if (strncmp(q + 1, key, n) == 0 && q[n + 1] == '"') {
      const char* c = q + n + 2;
      while (*c == ' ' || *c == '\n') ++c;
      if (*c == ':') return c + 1;
    }
  }
  return NULL;
}

/* The JSON string at p (after spaces) into out; the position after it, or NULL. */
static const char* read_string(const char* p, char* out, size_t cap) {
  while (*p == ' ' || *p == '\n') ++p;
  if (*p != '"') return NULL;
  const char* e = strchr(p + 1, '"');
  if (!e || (size_t)(e - p - 1) >= cap) return NULL;
  memcpy(out, p + 1, (size_t)(e - p - 1));
  out[e - p - 1] = 0;
  return e + 1;
}

/* In the object at p ({"sm_80": "file", ...}), the file for a device of compute capability
 * cc: `prefix` "sm_" takes the same major with the highest minor <= the device's, "compute_"
 * the highest version <= cc (PTX, compiled by the driver).  1 if found. */
static int pick_file(const char* p, const char* prefix, int cc, char* file, size_t cap) {
  const size_t plen = strlen(prefix);
  const char* end = strchr(p, '}');
  int best = -1;
  char key[64], val[256];
  while ((p = strchr(p, '"')) != NULL && p < end) {
    if (!(p = read_string(p, key, sizeof(key))) || !(p = strchr(p, ':')) || !(p = read_string(p + 1, val, sizeof(val))))
      return 0;
    char* tail = key;
    const long v = strncmp(key, prefix, plen) == 0 ? strtol(key + plen, &tail, 10) : -1;
    if (v < 0 || *tail) continue; /* other kinds, and architecture-specific sm_XYa cubins */
    const int ok = prefix[0] == 's' ? (v / 10 == cc / 10 && v <= cc) : v <= cc;
    if (ok && v > best) {
      best = (int)v;
      snprintf(file, cap, "%s", val);
    }
  }
  return best >= 0;
}

/* ------------------------------------------------------------------------------------------ */
static void usage(void) {
  fprintf(stderr,
          "usage: softmax_demo [--dtype float16|bfloat16|float32] [--shape B H Sq Sk] [--scale S] ARTIFACTS\n"
          "       softmax_demo [options] --cubin FILE --symbol SYMBOL\n");
  exit(2);
}

int main(int argc, char** argv) {
  int dtype = SMX_FLOAT16;
  smx_i64 B = 2, H = 3, Sq = 37, Sk = 203;
  float scale = 0.35f;
  const char *dir = NULL, *cubin = NULL, *symbol = NULL;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
      const char* d = argv[++i];
      dtype = -1;
      for (int k = 0; k < SMX_NUM_DTYPES; ++k)
        if (!strcmp(d, smx_dtype_name(k))) dtype = k;
      if (dtype < 0) die("--dtype must be float16, bfloat16 or float32, got ", d);
    } else if (!strcmp(argv[i], "--shape") && i + 4 < argc) {
      B = atoll(argv[++i]);
      H = atoll(argv[++i]);
      Sq = atoll(argv[++i]);
      Sk = atoll(argv[++i]);
      if (B < 1 || H < 1 || Sq < 2 || Sk < 1) die("--shape needs B, H, Sk >= 1 and Sq >= 2", NULL);
    } else if (!strcmp(argv[i], "--scale") && i + 1 < argc) {
      scale = (float)atof(argv[++i]);
    } else if (!strcmp(argv[i], "--cubin") && i + 1 < argc) {
      cubin = argv[++i];
    } else if (!strcmp(argv[i], "--symbol") && i + 1 < argc) {
      symbol = argv[++i];
    } else if (argv[i][0] != '-' && !dir) {
      dir = argv[i];
    } else {
      usage();
    }
  }
  if (!dir && !(cubin && symbol)) usage();

  /* 1. The launch: parameter struct, kernel and shape, from the header alone. */
  SmxFwdDesc d;
  memset(&d, 0, sizeof(d));
  d.dtype = dtype;
  d.ndim = 4;
  const smx_i64 shape[4] = {B, H, Sq, Sk}, mshape[4] = {B, 1, Sq, Sk};
  memcpy(d.shape, shape, sizeof(shape));
  smx_contiguous_strides(4, d.shape, d.x_strides);
  memcpy(d.y_strides, d.x_strides, sizeof(d.x_strides));
  d.mask_kind = SMX_MASK_HIDE1; /* bool / uint8: nonzero hides */
  d.mask_ndim = 4;
  memcpy(d.mask_shape, mshape, sizeof(mshape));
  smx_contiguous_strides(4, d.mask_shape, d.mask_strides);
  d.scale = scale;
  d.aligned = d.mask_aligned = 1; /* cuMemAlloc memory is 256-byte aligned */
  SmxFwdParams params;
  SmxLaunch launch;
  const int rc = smx_fill_forward(&d, &params, &launch);
  if (rc) die("smx_fill_forward: ", smx_error_string(rc));
  printf("x [%lld, %lld, %lld, %lld] %s, mask [%lld, 1, %lld, %lld] bool, scale %g\n", (long long)B, (long long)H,
         (long long)Sq, (long long)Sk, smx_dtype_name(dtype), (long long)B, (long long)Sq, (long long)Sk, scale);
  printf("kernel %s%s: grid %lld x block %d, %d threads per row\n", launch.kernel,
         smx_is_packaged(launch.kernel) ? "" : " (not among the packaged kernels)", (long long)launch.grid,
         launch.block, 1 << launch.tpr_log2);

  /* 2. The device and its primary context. */
  CUdevice dev;
  CUcontext ctx;
  int major, minor;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cuCtxSetCurrent(ctx));

  /* 3. The kernel's file and symbol: from the manifest, or as given. */
  char path[4096], sym[512], file[256];
  if (!cubin) {
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    char* m = read_text(path);
    if (!m) die("cannot open ", path);
    const char* table = after_key(m, "symbols");
    const char* entry = table ? after_key(table, launch.kernel) : NULL;
    if (!entry) die("the manifest lists no kernel ", launch.kernel);
    const char* s = after_key(entry, "symbol");
    if (!s || !read_string(s, sym, sizeof(sym))) die("no symbol in the manifest for ", launch.kernel);
    const char* c = after_key(entry, "cubins");
    const char* x = after_key(entry, "ptx");
    if (!(c && pick_file(c, "sm_", major * 10 + minor, file, sizeof(file))) &&
        !(x && pick_file(x, "compute_", major * 10 + minor, file, sizeof(file)))) {
      fprintf(stderr, "softmax_demo: %s holds no cubin or PTX of %s for sm_%d%d; build one with\n", path, launch.kernel,
              major, minor);
      fprintf(stderr, "  python build_ptx.py --arch sm_%d%d --ptx --kernels '%s' --out DIR\n", major, minor,
              launch.kernel);
      return 2;
    }
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    free(m);
    cubin = path;
    symbol = sym;
  }
  printf("loading %s from %s (device sm_%d%d)\n", symbol, cubin, major, minor);
  CUlibrary lib;
  CUkernel kern;
  CUfunction fn;
  CHECK(cuLibraryLoadFromFile(&lib, cubin, NULL, NULL, 0, NULL, NULL, 0));
  CHECK(cuLibraryGetKernel(&kern, lib, symbol));
  CHECK(cuKernelGetFunction(&fn, kern));

  /* 4. Inputs: x uniform in [-4, 4), ~30% of the mask hidden, row (b=0, q=1) hidden wholly. */
  const size_t n = (size_t)(B * H * Sq * Sk), nm = (size_t)(B * Sq * Sk), item = (size_t)smx_dtype_size(dtype);
  void* hx = malloc(n * item);
  void* hy = malloc(n * item);
  unsigned char* hm = (unsigned char*)malloc(nm);
  if (!hx || !hy || !hm) die("out of host memory", NULL);
  srand(12345);
  for (size_t i = 0; i < n; ++i) store(dtype, hx, i, 8.0f * (float)rand() / ((float)RAND_MAX + 1.0f) - 4.0f);
  for (size_t i = 0; i < nm; ++i) hm[i] = rand() % 10 < 3;
  for (smx_i64 j = 0; j < Sk; ++j) hm[1 * Sk + j] = 1;

  CUdeviceptr dx, dy, dm, dk = 0; /* no key_lengths */
  CHECK(cuMemAlloc(&dx, n * item));
  CHECK(cuMemAlloc(&dy, n * item));
  CHECK(cuMemAlloc(&dm, nm));
  CHECK(cuMemcpyHtoD(dx, hx, n * item));
  CHECK(cuMemcpyHtoD(dm, hm, nm));
  CHECK(cuMemsetD8(dy, 0xff, n * item)); /* NaN everywhere: every output must be written */

  /* 5. One launch: (x, y, mask, key_lengths, params), the struct passed by value. */
  void* args[SMX_FWD_NUM_ARGS] = {&dx, &dy, &dm, &dk, &params};
  CHECK(cuLaunchKernel(fn, (unsigned)launch.grid, 1, 1, (unsigned)launch.block, 1, 1, 0, NULL, args, NULL));
  CHECK(cuCtxSynchronize());
  CHECK(cuMemcpyDtoH(hy, dy, n * item));

  /* 6. The reference in double precision, from the same (rounded) inputs. */
  const double rtol = dtype == SMX_FLOAT16 ? 2e-3 : dtype == SMX_BFLOAT16 ? 1.6e-2 : 2e-5;
  const double atol = dtype == SMX_FLOAT16 ? 2e-5 : dtype == SMX_BFLOAT16 ? 1e-5 : 1e-7;
  double worst = 0.0, *z = (double*)malloc((size_t)Sk * sizeof(double));
  size_t bad = 0;
  if (!z) die("out of host memory", NULL);
  for (smx_i64 r = 0; r < B * H * Sq; ++r) {
    const smx_i64 b = r / (H * Sq), q = r % Sq;
    const unsigned char* mrow = hm + (b * Sq + q) * Sk;
    double mx = -INFINITY, sum = 0.0;
    for (smx_i64 j = 0; j < Sk; ++j) {
      z[j] = mrow[j] ? -INFINITY : load(dtype, hx, (size_t)(r * Sk + j)) * (double)scale;
      if (z[j] > mx) mx = z[j];
    }
    for (smx_i64 j = 0; j < Sk; ++j) sum += mrow[j] ? 0.0 : exp_nonpositive(z[j] - mx);
    for (smx_i64 j = 0; j < Sk; ++j) {
      const double ref = (mrow[j] || sum == 0.0) ? 0.0 : exp_nonpositive(z[j] - mx) / sum;
      const double got = load(dtype, hy, (size_t)(r * Sk + j));
      const double err = got > ref ? got - ref : ref - got;
      /* NaN fails both tests; hidden positions must be exactly 0 */
      if (!(err <= atol + rtol * ref) || (ref == 0.0 && got != 0.0)) ++bad;
      if (!(err <= worst)) worst = err;
    }
  }
  if (bad)
    printf("FAIL: %zu of %zu outputs outside |y - ref| <= %g + %g |ref| (worst %g)\n", bad, n, atol, rtol, worst);
  else
    printf("PASS: %zu outputs within %g + %g |ref| of the float64 reference (worst %.3g)\n", n, atol, rtol, worst);

  free(z);
  free(hx);
  free(hy);
  free(hm);
  CHECK(cuMemFree(dx));
  CHECK(cuMemFree(dy));
  CHECK(cuMemFree(dm));
  CHECK(cuLibraryUnload(lib));
  CHECK(cuDevicePrimaryCtxRelease(dev));
  return bad ? 1 : 0;
}
