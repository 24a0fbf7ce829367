/* Helpers shared by the CPU kernels: bfloat16 conversion and a vectorizable exp. */
#ifndef PDSERVE_CPU_KERNELS_COMMON_H
#define PDSERVE_CPU_KERNELS_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 to ~2 ulp, branch-free so the loop calling it vectorizes (libm's expf does
 * not without -ffast-math, and -ffast-math in a shared object can flip the process's denormal mode). */
static inline float exp_nonpositive(float x) {
    /* Clamped where the result is a denormal or zero anyway; written as arithmetic because gcc
     * vectorizes neither fmaxf nor a ternary on x here ("control flow in loop"). */
    x = (float)(x < -87.0f) * -87.0f + (float)(x >= -87.0f) * x;
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float n = (float)(int)(x * log2e - 0.5f); /* floor of x*log2e rounded to nearest, for x <= 0 */
    float r = x - n * ln2_hi - n * ln2_lo;
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
    return p * scale;
}

static inline float bf16_value(float x) { uint16_t b = bf16_round(x); return bf16_load(&b); }

#define LOAD_F32(p) (*(p))
#define STORE_F32(p, x) (*(p) = (x))
#define ROUND_F32(x) (x)
#define LOAD_BF16(p) bf16_load(p)
#define STORE_BF16(p, x) (*(p) = bf16_round(x))
#define ROUND_BF16(x) bf16_value(x)

#endif
