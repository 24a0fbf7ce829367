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
            /* g / (1 + e) or g e / (1 + e): the numerator chosen first, so one division, not two */    \
            const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);                                       \
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
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_ROTARY(rotary_f32, float, LOAD_F32, STORE_F32, ROUND_F32)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* bfloat16 with AVX-512 written out: gcc vectorizes the loops above, but at half width and with
 * each bf16 rounding as a dozen scalar-shaped steps, so bfloat16 ran at a third of float32's
 * speed per element (SiLU-and-mul over 2,048 x 1,536: 2.1 ms against 1.0). These compute the same
 * values, op for op and rounding for rounding (round to nearest even, NaN kept quiet), for every
 * finite input; RMSNorm's sum of squares is added in another order, and the exp clamps -inf to -87
 * where the portable arithmetic clamp gives NaN (SiLU of an infinite gate is then +-inf here, NaN
 * there). With AVX512_BF16 each rounding is the CPU's own conversion (vcvtneps2bf16, one
 * instruction for the integer sequence of bf16_round: at 2,048 rows rotary 1.04 -> 0.38 ms,
 * RMSNorm 0.40 -> 0.31, SiLU-and-mul 1.50 -> 1.32), which also flushes results below bf16's
 * smallest normal (1.2e-38) to zero, as oneDNN's bf16 products do; elsewhere bf16_round's
 * integer sequence, which keeps them. */
#include <immintrin.h>

static inline __mmask16 lanes_left(int32_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* bf16_round on 16 lanes: each 32-bit word's high half is the rounded value. */
static inline __m512i bf16x16_round_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
}

#ifdef __AVX512BF16__
static inline void bf16x16_store(uint16_t *p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}

/* ROUND_BF16: x rounded to bfloat16, widened back. */
static inline __m512 bf16x16_value(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#else
static inline void bf16x16_store(uint16_t *p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16x16_round_bits(x), 16)));
}

/* ROUND_BF16: x rounded to bfloat16, widened back. */
static inline __m512 bf16x16_value(__m512 x) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16x16_round_bits(x), _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

/* exp_nonpositive on 16 lanes, step for step (no fused multiply-adds). */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_cvtepi32_ps(_mm512_cvttps_epi32(
        _mm512_sub_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f))));
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

void rms_norm_bf16(uint16_t *x, int64_t x_stride, const uint16_t *delta, int64_t delta_stride,
                   const uint16_t *weight, uint16_t *out, int64_t out_stride, int64_t rows, int32_t hidden,
                   float eps) {
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * x_stride;
        __m512 squares = _mm512_setzero_ps();
        for (int32_t i = 0; i < hidden; i += 16) {
            const __mmask16 m = lanes_left(hidden - i);
            __m512 v = bf16x16_load(xr + i, m);
            if (delta != NULL) {
                v = bf16x16_value(_mm512_add_ps(v, bf16x16_load(delta + r * delta_stride + i, m)));
                bf16x16_store(xr + i, v, m);
            }
            squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
        uint16_t *o = out + r * out_stride;
        for (int32_t i = 0; i < hidden; i += 16) {
            const __mmask16 m = lanes_left(hidden - i);
            const __m512 normed = bf16x16_value(_mm512_mul_ps(bf16x16_load(xr + i, m), inv));
            bf16x16_store(o + i, _mm512_mul_ps(bf16x16_load(weight + i, m), normed), m);
        }
    }
}

void silu_and_mul_bf16(const uint16_t *gate_up, int64_t in_stride, uint16_t *out, int64_t out_stride,
                       int64_t rows, int32_t size) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    PARALLEL_ROWS
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * in_stride, *up = gate + size;
        uint16_t *o = out + r * out_stride;
        for (int32_t i = 0; i < size; i += 16) {
            const __mmask16 m = lanes_left(size - i);
            const __m512 g = bf16x16_load(gate + i, m);
            const __m512 e = exp_nonpositive16(_mm512_or_ps(g, sign)); /* exp(-|g|) */
            const __mmask16 nonnegative = _mm512_cmp_ps_mask(g, zero, _CMP_GE_OQ);
            const __m512 numerator = _mm512_mask_blend_ps(nonnegative, _mm512_mul_ps(g, e), g);
            const __m512 silu = bf16x16_value(_mm512_div_ps(numerator, _mm512_add_ps(one, e)));
            bf16x16_store(o + i, _mm512_mul_ps(silu, bf16x16_load(up + i, m)), m);
        }
    }
}

void rotary_bf16(uint16_t *q, int64_t q_stride, int32_t num_q_heads, uint16_t *k, int64_t k_stride,
                 int32_t num_k_heads, const uint16_t *cos, const uint16_t *sin, const int64_t *positions,
                 int64_t tokens, int32_t head_dim) {
    const int32_t half = head_dim / 2;
    const int64_t rows = tokens;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    PARALLEL_ROWS
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        for (int32_t h = 0; h < num_q_heads + num_k_heads; h++) {
            uint16_t *x = h < num_q_heads ? q + t * q_stride + (int64_t)h * head_dim
                                          : k + t * k_stride + (int64_t)(h - num_q_heads) * head_dim;
            for (int32_t i = 0; i < half; i += 16) {
                const __mmask16 m = lanes_left(half - i);
                const __m512 a = bf16x16_load(x + i, m), b = bf16x16_load(x + i + half, m);
                const __m512 lo = _mm512_add_ps(bf16x16_value(_mm512_mul_ps(a, bf16x16_load(c + i, m))),
                                                bf16x16_value(_mm512_mul_ps(_mm512_xor_ps(b, sign),
                                                                            bf16x16_load(s + i, m))));
                const __m512 hi = _mm512_add_ps(bf16x16_value(_mm512_mul_ps(b, bf16x16_load(c + i + half, m))),
                                                bf16x16_value(_mm512_mul_ps(a, bf16x16_load(s + i + half, m))));
                bf16x16_store(x + i, lo, m);
                bf16x16_store(x + i + half, hi, m);
            }
        }
    }
}
#else
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)
DEFINE_ROTARY(rotary_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)
#endif

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

/* Whether bfloat16 results round through the CPU's conversion (and flush denormals): the build's
 * answer, which -march=native and the compiler decide, not the CPU's flags alone. */
int bf16_rounding_is_native(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
