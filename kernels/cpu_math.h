/* Math the compiled CPU loops share (native.py builds them). */
#ifndef LORAPLEX_CPU_MATH_H
#define LORAPLEX_CPU_MATH_H
#include <stdint.h>
#include <string.h>

/* e^x as a polynomial the compiler vectorises (Cephes' expf: within 2 ulp): 0 below -87,
 * x clamped to 88 above (e^88 ~ 1.7e38, finite) */
static inline float exp_approx(float x) {
  int under = x < -87.0f;
  x = under ? -87.0f : (x > 88.0f ? 88.0f : x);
  float t = x * 1.44269504088896341f;
  float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest (default rounding) */
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return under ? 0.0f : p * scale;
}

#endif
