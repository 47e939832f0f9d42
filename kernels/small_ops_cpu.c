/* A decode step's small ops on a CPU, each one pass over its rows where torch runs two to
 * six ops (each dispatched, each writing a tensor the next reads): RMSNorm with the
 * residual add before it, SwiGLU's silu(gate) * up, the rotary embedding in place, and
 * the KV cache write. Built and loaded with the other loops (native.py); contracts and
 * references in small_ops_native.py. Float32 activations; the cache float32 or bfloat16. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

/* elements past which the work is split over the OpenMP team (whose threads spin between
 * the step's GEMMs): on SmolLM2's decode step (batch 32) SwiGLU's product (49k elements)
 * took 1.8 ms a step on two threads against 2.3-2.5 on one, the norms (18k) 2.9 against
 * 3.2-3.4 */
#define PARALLEL_ELEMS (1 << 13)

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; with res, x[r] += res[r] first (x written) */
void rms_norm(float *y, int64_t y_stride, float *x, int64_t x_stride, const float *res,
              int64_t res_stride, const float *w, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ELEMS)
  for (int64_t r = 0; r < rows; r++) {
    float *xr = x + r * x_stride, *yr = y + r * y_stride;
    if (res) {
      const float *rr = res + r * res_stride;
#pragma omp simd
      for (int64_t c = 0; c < cols; c++) xr[c] += rr[c];
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < cols; c++) ss += xr[c] * xr[c];
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) yr[c] = xr[c] * inv * w[c];
  }
}

/* out[r, c] = silu(gu[r, c]) * gu[r, inter + c]: gate and up side by side in one row */
void silu_mul(float *out, int64_t out_stride, const float *gu, int64_t gu_stride, int64_t rows,
              int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_ELEMS)
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gu + r * gu_stride, *u = g + inter;
    float *o = out + r * out_stride;
#pragma omp simd
    for (int64_t c = 0; c < inter; c++) o[c] = g[c] / (1.0f + exp_approx(-g[c])) * u[c];
  }
}

/* x[t, h] rotated in place: halves (a, b) -> (a cos - b sin, b cos + a sin), the tables'
 * rows [T, D] (cos, and sin with its first half negated) */
void rope(float *x, int64_t x_st, int64_t x_sh, int64_t T, int64_t heads, int64_t D,
          const float *cos, const float *ssin, int64_t tab_stride) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T * heads * D >= PARALLEL_ELEMS)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos + t * tab_stride, *s = ssin + t * tab_stride;
    for (int64_t h = 0; h < heads; h++) {
      float *a = x + t * x_st + h * x_sh, *b = a + half;
#pragma omp simd
      for (int64_t i = 0; i < half; i++) {
        float ai = a[i], bi = b[i];
        a[i] = ai * c[i] + bi * s[i];
        b[i] = bi * c[half + i] + ai * s[half + i];
      }
    }
  }
}

/* rows of the pool: cache[k_rows[t]] = k[t] and cache[v_rows[t]] = v[t], width elements
 * each (float32, or bfloat16 rounded to nearest even as torch converts) */
void write_kv(void *cache, int64_t width, int64_t bf16, const float *k, int64_t k_stride,
              const float *v, int64_t v_stride, const int64_t *k_rows, const int64_t *v_rows,
              int64_t T) {
  for (int64_t t = 0; t < 2 * T; t++) {
    const float *src = t < T ? k + t * k_stride : v + (t - T) * v_stride;
    int64_t row = t < T ? k_rows[t] : v_rows[t - T];
    if (!bf16) {
      memcpy((float *)cache + row * width, src, width * sizeof(float));
      continue;
    }
    uint16_t *dst = (uint16_t *)cache + row * width;
#pragma omp simd
    for (int64_t i = 0; i < width; i++) {
      uint32_t u;
      memcpy(&u, &src[i], sizeof u);
      u += 0x7fffu + ((u >> 16) & 1u);
      dst[i] = (uint16_t)(u >> 16);
    }
  }
}

/* out[r] = the first index of row r's largest value (of its first NaN, as torch's argmax
 * gives): a vectorised max, then a search for its first place */
void argmax_rows(int64_t *out, const float *x, int64_t x_stride, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_ELEMS)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * x_stride;
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t c = 0; c < cols; c++) {
      best = xr[c] > best ? xr[c] : best;
      nan |= xr[c] != xr[c];
    }
    int64_t at = 0;
    for (int64_t c = 0; c < cols; c++)
      if (nan ? xr[c] != xr[c] : xr[c] == best) {
        at = c;
        break;
      }
    out[r] = at;
  }
}
