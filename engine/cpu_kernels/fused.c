/* The Llama layer's elementwise steps, each one pass over memory instead of torch's several
 * (RMSNorm alone was 7 ops; at batch 1 every op costs its dispatch, at 2,048 rows its memory
 * traffic). Each function matches the arithmetic of the torch expression it replaces, op for op
 * and with the same roundings: float32 results are identical except where a reduction (RMSNorm's
 * sum of squares) or exp (SiLU) is computed in another order; bfloat16 rounds after each op as
 * torch does. Built with -ffp-contract=off so no multiply-add is fused behind our back.
 */
#include <math.h>
#include "common.h"

/* Threads only where there is enough work to pay for waking them (the loop variable is `rows`). */
#define PARALLEL_ROWS _Pragma("omp parallel for schedule(static) if (rows > 8)")

/* residual = x + delta (when delta is given, written back into x); out = weight * norm(residual).
 * Hugging Face's LlamaRMSNorm: variance in float32, x * rsqrt(variance + eps) cast to the model
 * dtype, then multiplied by the weight. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                     \
void NAME(T *x, int64_t x_stride, const T *delta, int64_t delta_stride, const T *weight, T *out,         \
          int64_t out_stride, int64_t rows, int32_t hidden, float eps) {                                  \
    PARALLEL_ROWS                                                                                    \
    for (int64_t r = 0; r < rows; r++) {                                                                   \
        T *xr = x + r * x_stride;                                                                          \
        if (delta != NULL) {                                                                               \
            const T *dr = delta + r * delta_stride;                                                        \
            for (int32_t i = 0; i < hidden; i++) STORE(xr + i, LOAD(xr + i) + LOAD(dr + i));               \
        }                                                                                                  \
        float sum = 0.0f;                                                                                  \
        _Pragma("omp simd reduction(+ : sum)")                                                           \
        for (int32_t i = 0; i < hidden; i++) {                                                             \
            const float v = LOAD(xr + i);                                                                  \
            sum += v * v;                                                                                  \
        }                                                                                                  \
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);                                         \
        T *o = out + r * out_stride;                                                                       \
        for (int32_t i = 0; i < hidden; i++) {                                                             \
            const float normed = ROUND(LOAD(xr + i) * inv);                                                \
            STORE(o + i, LOAD(weight + i) * normed);                                                       \
        }                                                                                                  \
    }                                                                                                      \
}

/* out = silu(gate) * up, where each row of gate_up is [gate | up] (the fused gate_up_proj). */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                                 \
void NAME(const T *gate_up, int64_t in_stride, T *out, int64_t out_stride, int64_t rows, int32_t size) { \
    PARALLEL_ROWS                                                                                    \
    for (int64_t r = 0; r < rows; r++) {                                                                   \
        const T *gate = gate_up + r * in_stride, *up = gate + size;                                        \
        T *o = out + r * out_stride;                                                                       \
        _Pragma("omp simd")                                                                              \
        for (int32_t i = 0; i < size; i++) {                                                               \
            const float g = LOAD(gate + i);                                                                \
            const float e = exp_nonpositive(-fabsf(g));                                                    \
            const float silu = g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);                            \
            STORE(o + i, ROUND(silu) * LOAD(up + i));                                                      \
        }                                                                                                  \
    }                                                                                                      \
}

/* In place, Hugging Face's rotate-half form: x * cos + rotate_half(x) * sin, per head, for the
 * query heads and the key heads of each token (cos/sin rows gathered by the token's position). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                       \
void NAME(T *q, int64_t q_stride, int32_t num_q_heads, T *k, int64_t k_stride, int32_t num_k_heads,      \
          const T *cos, const T *sin, const int64_t *positions, int64_t tokens, int32_t head_dim) {       \
    const int32_t half = head_dim / 2;                                                                     \
    const int64_t rows = tokens;                                                                           \
    PARALLEL_ROWS                                                                                          \
    for (int64_t t = 0; t < rows; t++) {                                                                 \
        const T *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;                    \
        for (int32_t h = 0; h < num_q_heads + num_k_heads; h++) {                                          \
            T *x = h < num_q_heads ? q + t * q_stride + (int64_t)h * head_dim                              \
                                   : k + t * k_stride + (int64_t)(h - num_q_heads) * head_dim;             \
            _Pragma("omp simd")                                                                          \
            for (int32_t i = 0; i < half; i++) {                                                           \
                const float a = LOAD(x + i), b = LOAD(x + i + half);                                       \
                const float lo = ROUND(ROUND(a * LOAD(c + i)) + ROUND(-b * LOAD(s + i)));                  \
                const float hi = ROUND(ROUND(b * LOAD(c + i + half)) + ROUND(a * LOAD(s + i + half)));     \
                STORE(x + i, lo);                                                                          \
                STORE(x + i + half, hi);                                                                   \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_RMS_NORM(rms_norm_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)
DEFINE_ROTARY(rotary_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_ROTARY(rotary_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)

/* The step's new keys and values into their cache slots (one row of kv_heads x head_dim per
 * token): what two index_copy_ calls did, in one call. Rows of k and v may be strided (views
 * into the fused qkv output). */
#define DEFINE_WRITE_KV(NAME, T)                                                                         \
void NAME(const T *k, int64_t k_stride, const T *v, int64_t v_stride, T *key_cache, T *value_cache,     \
          const int64_t *slots, int64_t tokens, int64_t row_elems) {                                    \
    const int64_t rows = tokens;                                                                           \
    PARALLEL_ROWS                                                                                          \
    for (int64_t t = 0; t < rows; t++) {                                                                   \
        memcpy(key_cache + slots[t] * row_elems, k + t * k_stride, sizeof(T) * (size_t)row_elems);       \
        memcpy(value_cache + slots[t] * row_elems, v + t * v_stride, sizeof(T) * (size_t)row_elems);     \
    }                                                                                                      \
}

DEFINE_WRITE_KV(write_kv_f32, float)
DEFINE_WRITE_KV(write_kv_bf16, uint16_t)
