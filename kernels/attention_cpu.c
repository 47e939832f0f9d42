/* Paged attention, decode form, on a CPU: one query token per sequence, every key and value
 * read where the paged pool keeps it (no gathered copy), GQA. Built and loaded with the
 * LoRA loops (native.py); the contract is the Triton kernel's (triton_paged_attention.py):
 *
 *   for b < B, hq < H:  kvh = hq / (H / KVH),  p = ctx_lens[b] - 1
 *     keys = j < ctx_lens[b] with j > p - window
 *     out[b, hq] = softmax(q[b, hq] . K[b, keys, kvh] * scale) @ V[b, keys, kvh]
 *
 * One work item is a sequence and kv head: it reads each key and value once for the GQA
 * group of query heads sharing them, in tiles of keys with a running max and sum (the
 * softmax of the whole row without a buffer as long as the context). Every line of a
 * tile's rows is prefetched before its first is read (one row after another, each load
 * waited on memory: 17.6 ms a step of SmolLM2's shape on two threads against 14.1, keys
 * flushed from the cache between layers); dot products go four keys at a time and the
 * product with V four vectors at a time, in vectors of 8 floats (GCC/clang vector
 * extensions; 16-float ones went through the stack where the compiler prefers 256-bit
 * registers: 2.8x slower on one thread), summed across lanes as a tree. exp is a
 * polynomial the compiler vectorises (cpu_math.h). Scores, softmax and
 * the product with V are float32; the cache is float32 or bfloat16
 * (widened as a tile is read). */
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#define TILE 32      /* keys scored before their values are read */
#define MAX_DIM 256  /* head_dim, a multiple of 4 * VEC */
#define MAX_GROUP 8  /* query heads a kv head serves */
#define VEC 8

typedef float vec __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));

static inline vec load(const float *p) {
  vec v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

typedef float half __attribute__((vector_size(VEC / 2 * sizeof(float))));

static inline float hsum(vec v) { /* a tree of adds: halves, then four lanes */
  half h0, h1;
  memcpy(&h0, &v, sizeof h0);
  memcpy(&h1, (const char *)&v + sizeof h0, sizeof h1);
  h0 += h1;
  return (h0[0] + h0[2]) + (h0[1] + h0[3]);
}

typedef struct {
  float *out;
  const float *q;
  int64_t q_sb, q_sh;
  const void *k, *v;
  int64_t c_sp, c_st, c_sh, bf16;
  const int64_t *block_tables;
  int64_t bt_stride;
  const int32_t *ctx_lens;
  int64_t B, H, KVH, D, block_size;
  float scale;
  int64_t window;
} args_t;

/* n rows of the cache as float32 pointers: in place, or widened into buf [n, D] */
static inline void rows(const void *cache, const int64_t *off, int64_t n, int64_t bf16,
                        int64_t D, float *buf, const float **out) {
  for (int64_t t = 0; t < n; t++) {
    if (!bf16) {
      out[t] = (const float *)cache + off[t];
      continue;
    }
    const uint16_t *src = (const uint16_t *)cache + off[t];
    float *dst = buf + t * D;
#pragma omp simd
    for (int64_t i = 0; i < D; i++) {
      uint32_t w = (uint32_t)src[i] << 16;
      memcpy(&dst[i], &w, sizeof w);
    }
    out[t] = dst;
  }
}

/* one sequence and kv head; G, the group's size, is a constant where this is inlined */
static void item(const args_t *a, int64_t b, int64_t kvh, float *kbuf, float *vbuf) {
  const int64_t D = a->D, nv = D / VEC, bs = a->block_size;
  const int64_t ctx = a->ctx_lens[b], first = ctx > a->window ? ctx - a->window : 0;
  const int64_t *pages = a->block_tables + b * a->bt_stride;
  const int64_t G = a->H / a->KVH;
  float qs[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][TILE + 3];
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int g = 0; g < G; g++) {
    const float *qg = a->q + b * a->q_sb + (kvh * G + g) * a->q_sh;
    for (int64_t d = 0; d < D; d++) qs[g][d] = qg[d] * a->scale, acc[g][d] = 0.0f;
    m[g] = -1e30f, l[g] = 0.0f;
  }
  int64_t page = first / bs, tok = first % bs;
  for (int64_t j0 = first; j0 < ctx; j0 += TILE) {
    const int64_t n = ctx - j0 < TILE ? ctx - j0 : TILE;
    int64_t off[TILE];
    const float *kr[TILE + 3], *vr[TILE];
    for (int64_t t = 0; t < n; t++) { /* the tile's rows: no division per key */
      off[t] = pages[page] * a->c_sp + tok * a->c_st + kvh * a->c_sh;
      if (++tok == bs) page++, tok = 0;
    }
    /* every line of the tile's rows asked for at once: the loads below then wait on
     * memory together, not one row after another */
    const int64_t row_bytes = D * (a->bf16 ? 2 : 4);
    for (int64_t t = 0; t < n; t++)
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch((const char *)a->k + off[t] * (a->bf16 ? 2 : 4) + byte);
        __builtin_prefetch((const char *)a->v + off[t] * (a->bf16 ? 2 : 4) + byte);
      }
    rows(a->k, off, n, a->bf16, D, kbuf, kr);
    /* four keys at a time */
    for (int64_t t = n; t % 4; t++) kr[t] = kr[0]; /* a whole last four: repeats, unused */
    for (int64_t g = 0; g < G; g++)
      for (int64_t t = 0; t < n; t += 4) {
        vec d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
        for (int64_t c = 0; c < D; c += VEC) {
          vec qv = load(qs[g] + c);
          d0 += qv * load(kr[t] + c);
          d1 += qv * load(kr[t + 1] + c);
          d2 += qv * load(kr[t + 2] + c);
          d3 += qv * load(kr[t + 3] + c);
        }
        s[g][t] = hsum(d0), s[g][t + 1] = hsum(d1), s[g][t + 2] = hsum(d2), s[g][t + 3] = hsum(d3);
      }
    for (int g = 0; g < G; g++) {
      float mt = m[g], sum = 0.0f;
      for (int64_t t = 0; t < n; t++) mt = s[g][t] > mt ? s[g][t] : mt;
      float c = exp_approx(m[g] - mt);
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; t++) {
        s[g][t] = exp_approx(s[g][t] - mt);
        sum += s[g][t];
      }
      l[g] = l[g] * c + sum, m[g] = mt;
      for (int64_t d = 0; d < D; d++) acc[g][d] *= c;
    }
    rows(a->v, off, n, a->bf16, D, vbuf, vr);
    /* four vectors of each value row at a time */
    for (int64_t g = 0; g < G; g++)
      for (int64_t c = 0; c < D; c += 4 * VEC) {
        float *o = acc[g] + c;
        vec o0 = load(o), o1 = load(o + VEC), o2 = load(o + 2 * VEC), o3 = load(o + 3 * VEC);
        for (int64_t t = 0; t < n; t++) {
          const float *vt = vr[t] + c;
          float p = s[g][t];
          o0 += p * load(vt), o1 += p * load(vt + VEC);
          o2 += p * load(vt + 2 * VEC), o3 += p * load(vt + 3 * VEC);
        }
        store(o, o0), store(o + VEC, o1), store(o + 2 * VEC, o2), store(o + 3 * VEC, o3);
      }
  }
  for (int g = 0; g < G; g++) {
    float *og = a->out + (b * a->H + kvh * G + g) * D, inv = 1.0f / l[g];
    for (int64_t d = 0; d < D; d++) og[d] = acc[g][d] * inv;
  }
}

/* The cache strides (page, token, head) are in elements of the cache's dtype; q's d
 * contiguous, out [B, H, D] contiguous. Returns 0, or -1 for a shape it does not take
 * (head_dim not a multiple of 32 or over 256, a group of more than 8 query heads). */
static int takes(const args_t *a) {
  const int64_t G = a->H / a->KVH;
  return !(a->D % (4 * VEC) || a->D > MAX_DIM || G < 1 || G > MAX_GROUP || G * a->KVH != a->H);
}

int decode_attention(const args_t *a) {
  if (!takes(a)) return -1;
#pragma omp parallel
  {
    float kbuf[TILE * MAX_DIM], vbuf[TILE * MAX_DIM];
#pragma omp for schedule(static)
    for (int64_t it = 0; it < a->B * a->KVH; it++) {
      int64_t b = it / a->KVH, kvh = it % a->KVH;
      item(a, b, kvh, kbuf, vbuf);
    }
  }
  return 0;
}

/* small_ops_cpu.c's, in the same library */
void rope(float *x, int64_t x_st, int64_t x_sh, int64_t T, int64_t heads, int64_t D,
          const float *cos, const float *ssin, int64_t tab_stride);
void write_kv(void *cache, int64_t width, int64_t bf16, const float *k, int64_t k_stride,
              const float *v, int64_t v_stride, const int64_t *k_rows, const int64_t *v_rows,
              int64_t T);

typedef struct {
  args_t att; /* q = the qkv rows (q_sb their stride, q_sh = D); B = the step's rows */
  const float *cos, *ssin;
  int64_t tab_stride;
  void *cache_rows; /* the pool as rows of KVH * D, where k_rows and v_rows point */
  const int64_t *k_rows, *v_rows;
} layer_t;

/* A decode layer's attention from its fused qkv rows, one call where the forward pass made
 * three (each a Python wrapper and a ctypes call, their code and data cold after the GEMM
 * before them): the rotary embedding on q and k in place, this step's k and v written to
 * the cache, then decode_attention with q read from the qkv rows. Returns what it returns,
 * -1 having written nothing. */
int decode_layer(const layer_t *l) {
  const args_t *a = &l->att;
  const int64_t D = a->D, H = a->H, KVH = a->KVH;
  float *qkv = (float *)a->q;
  if (!takes(a) || a->q_sh != D) return -1; /* before anything is written */
  rope(qkv, a->q_sb, D, a->B, H + KVH, D, l->cos, l->ssin, l->tab_stride);
  write_kv(l->cache_rows, KVH * D, a->bf16, qkv + H * D, a->q_sb, qkv + (H + KVH) * D, a->q_sb,
           l->k_rows, l->v_rows, a->B);
  return decode_attention(a);
}

