/* Test harness of drvsoftmax.h (tests/test_softmax_capi.py): reads launch descriptions from
 * stdin, one per line, and prints what the header's C functions make of them, so the test
 * can compare every byte of the parameter struct and every launch number with Python's.
 *
 *   F dtype nd shape.. x_strides.. y_strides.. mask_kind mask_nd mask_shape.. mask_strides..
 *     klen_bytes klen_stride causal scale aligned mask_aligned
 *   B dtype nd shape.. dy_strides.. y_strides.. dx_strides.. scale aligned
 *   P                      (prints the packaged kernel list)
 *
 * Output per F/B line: rc|kernel|loop nch rpt tpr_log2 block grid vector whole packaged|params hex
 */
#include <stdlib.h>

#include "drvsoftmax.h"

static long long rd(void) {
  long long v;
  if (scanf("%lld", &v) != 1) {
    fprintf(stderr, "harness: malformed input\n");
    exit(2);
  }
  return v;
}

static void rd_dims(int n, smx_i64* out) {
  for (int i = 0; i < n; ++i) out[i] = rd();
}

static float rd_float(void) {
  char buf[64];
  if (scanf("%63s", buf) != 1) exit(2);
  return (float)strtod(buf, NULL);
}

static void print_result(int rc, const SmxLaunch* l, const void* params, size_t size) {
  printf("%d|%s|%d %d %d %d %d %lld %d %d %d|", rc, l->kernel, l->loop, l->nch, l->rpt, l->tpr_log2, l->block,
         (long long)l->grid, l->vector, l->whole, l->kernel[0] ? smx_is_packaged(l->kernel) : 0);
  for (size_t i = 0; i < size; ++i) printf("%02x", ((const unsigned char*)params)[i]);
  printf("\n");
}

int main(void) {
  char op[4];
  while (scanf("%3s", op) == 1) {
    if (op[0] == 'P') {
      for (int i = 0; i < SMX_NUM_PACKAGED_KERNELS; ++i) printf("%s\n", smx_packaged_kernel(i));
      printf("--\n");
    } else if (op[0] == 'F') {
      SmxFwdDesc d;
      SmxFwdParams p;
      SmxLaunch l;
      memset(&d, 0, sizeof(d));
      d.dtype = (int)rd();
      d.ndim = (int)rd();
      rd_dims(d.ndim, d.shape);
      rd_dims(d.ndim, d.x_strides);
      rd_dims(d.ndim, d.y_strides);
      d.mask_kind = (int)rd();
      d.mask_ndim = (int)rd();
      rd_dims(d.mask_ndim, d.mask_shape);
      rd_dims(d.mask_ndim, d.mask_strides);
      d.klen_bytes = (int)rd();
      d.klen_stride = rd();
      d.causal = (int)rd();
      d.scale = rd_float();
      d.aligned = (int)rd();
      d.mask_aligned = (int)rd();
      const int rc = smx_fill_forward(&d, &p, &l);
      print_result(rc, &l, &p, sizeof(p));
    } else if (op[0] == 'B') {
      SmxBwdDesc d;
      SmxBwdParams p;
      SmxLaunch l;
      memset(&d, 0, sizeof(d));
      d.dtype = (int)rd();
      d.ndim = (int)rd();
      rd_dims(d.ndim, d.shape);
      rd_dims(d.ndim, d.dy_strides);
      rd_dims(d.ndim, d.y_strides);
      rd_dims(d.ndim, d.dx_strides);
      d.scale = rd_float();
      d.aligned = (int)rd();
      const int rc = smx_fill_backward(&d, &p, &l);
      print_result(rc, &l, &p, sizeof(p));
    } else {
      fprintf(stderr, "harness: unknown op %s\n", op);
      return 2;
    }
  }
  return 0;
}
