/* LoRA's shrink and expand on a CPU, reading every adapter row in place in the pool's arena
 * through the row tables of lora_tables.py (the Triton kernels' inputs). Built and loaded
 * by lora_native.py; the contract is lora.py's `lora_sgmv`, split in two like the Triton
 * kernels so that tensor parallelism can sum h between them:
 *
 *   for each segment (s, e, slot), with R = ranks[slot] rows of A_cat:
 *     h[t, r] = x[t] . A_cat(slot)[r]                       t in [s, e), r < R   (shrink)
 *     y[t, cols[j]:cols[j + 1]] += h[t, hoff_j : hoff_j + r_j] @ Bt_j(slot)      (expand)
 *
 * One call per layer and group, whatever the number of adapters and of their row-chunks;
 * the work is split over the calling thread's OpenMP team where built with -fopenmp.
 * Float32 only. */
#include <stdint.h>

/* One step's tables (int64 fields; pointers as addresses), built once per step:
 * ranks [S, L, G] int32, a_rows [S, L, G, a_cap] int64, t_rank and t_hoff [S, L, G, J]
 * int32, b_rows [S, L, G, J, r_cap] int64, cols [G, J + 1] int32, seg [n_seg, 3] int64
 * (start, end, slot). */
typedef struct {
  int64_t arena, seg, n_seg, max_r;
  int64_t ranks, a_rows, t_rank, t_hoff, b_rows, cols;
  int64_t layers, groups, targets, a_cap, r_cap, max_w;
} step_t;

#define RB 4 /* rows of A a shrink item reads at once: four independent sums */

void lora_shrink(const step_t *st, int64_t layer, int64_t group, const float *x,
                 int64_t x_stride, int64_t in_w, float *h, int64_t h_stride) {
  const float *arena = (const float *)st->arena;
  const int64_t *seg = (const int64_t *)st->seg;
  int64_t lg = layer * st->groups + group, per_slot = st->layers * st->groups;
  const int32_t *ranks = (const int32_t *)st->ranks + lg;
  const int64_t *a_rows = (const int64_t *)st->a_rows + lg * st->a_cap;
  int64_t nrb = (st->max_r + RB - 1) / RB, items = st->n_seg * nrb;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < items; item++) {
    int64_t i = item / nrb, r0 = (item % nrb) * RB;
    int64_t s = seg[3 * i], e = seg[3 * i + 1], slot = seg[3 * i + 2];
    int64_t R = ranks[slot * per_slot];
    if (r0 >= R) continue;
    const int64_t *rows = a_rows + slot * per_slot * st->a_cap;
    const float *a0 = arena + rows[r0];
    const float *a1 = arena + rows[r0 + 1 < R ? r0 + 1 : r0];
    const float *a2 = arena + rows[r0 + 2 < R ? r0 + 2 : r0];
    const float *a3 = arena + rows[r0 + 3 < R ? r0 + 3 : r0];
    for (int64_t t = s; t < e; t++) {
      const float *xt = x + t * x_stride;
      float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
#pragma omp simd reduction(+ : c0, c1, c2, c3)
      for (int64_t k = 0; k < in_w; k++) {
        float xv = xt[k];
        c0 += xv * a0[k];
        c1 += xv * a1[k];
        c2 += xv * a2[k];
        c3 += xv * a3[k];
      }
      float *ht = h + t * h_stride + r0;
      ht[0] = c0;
      if (r0 + 1 < R) ht[1] = c1;
      if (r0 + 2 < R) ht[2] = c2;
      if (r0 + 3 < R) ht[3] = c3;
    }
  }
}

#define CB 128 /* columns of y an expand item writes */

void lora_expand(const step_t *st, int64_t layer, int64_t group, float *y, int64_t y_stride,
                 const float *h, int64_t h_stride) {
  const float *arena = (const float *)st->arena;
  const int64_t *seg = (const int64_t *)st->seg;
  int64_t J = st->targets, lg = layer * st->groups + group;
  int64_t per_slot = st->layers * st->groups * J;
  const int32_t *t_rank = (const int32_t *)st->t_rank + lg * J;
  const int32_t *t_hoff = (const int32_t *)st->t_hoff + lg * J;
  const int64_t *b_rows = (const int64_t *)st->b_rows + lg * J * st->r_cap;
  const int32_t *cols = (const int32_t *)st->cols + group * (J + 1);
  int64_t nblk = (st->max_w + CB - 1) / CB, items = st->n_seg * J * nblk;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < items; item++) {
    int64_t i = item / (J * nblk), j = (item / nblk) % J, blk = item % nblk;
    int64_t s = seg[3 * i], e = seg[3 * i + 1], slot = seg[3 * i + 2];
    int64_t r_t = t_rank[slot * per_slot + j];
    int64_t c0 = cols[j] + blk * CB, c1 = cols[j + 1];
    if (r_t == 0 || c0 >= c1) continue;
    if (c1 > c0 + CB) c1 = c0 + CB;
    int64_t w = c1 - c0, hoff = t_hoff[slot * per_slot + j];
    const int64_t *rows = b_rows + slot * per_slot * st->r_cap + j * st->r_cap;
    for (int64_t k = 0; k < r_t; k++) {
      const float *b = arena + rows[k] + blk * CB;
      for (int64_t t = s; t < e; t++) {
        float hv = h[t * h_stride + hoff + k];
        float *yt = y + t * y_stride + c0;
#pragma omp simd
        for (int64_t c = 0; c < w; c++) yt[c] += hv * b[c];
      }
    }
  }
}
