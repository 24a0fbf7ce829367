/* Paged attention on CPU that reads keys and values where they lie in the block-paged cache.
 *
 * The torch fallback first gathers every sequence's blocks into one padded tensor, then runs
 * SDPA over it: each layer and step copies the whole context once more than it needs to (at
 * batch 64 with 320-token contexts that gather alone was 40% of a SmolLM2 decode step). Here
 * each (sequence, KV head) pair walks its block table and reads every key and value once,
 * for the query heads that share that KV head (GQA) together.
 *
 * Layout (common/kv_layout.py): key_cache and value_cache are [num_blocks, block_size,
 * num_kv_heads, head_dim], contiguous. Query and output rows are [tokens, num_heads, head_dim]
 * with head_dim contiguous and heads adjacent. Sequence s owns query rows
 * query_start[s] .. query_start[s] + query_len[s] - 1; row i of it sits at position
 * context_len[s] - query_len[s] + i and attends to keys 0 .. that position (causal).
 *
 * Arithmetic is float32 throughout (bfloat16 inputs are widened on load, outputs rounded to
 * nearest even), with a two-pass softmax over a per-item score buffer. Plain C with OpenMP:
 * the process's OpenMP runtime is torch's, so this shares torch's thread pool.
 */
#include "common.h"

#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE)                                                   \
int NAME(const T *query, int64_t query_row_stride, const T *key_cache, const T *value_cache,           \
         T *out, int64_t out_row_stride, const int64_t *block_tables, int64_t block_table_stride,        \
         const int64_t *query_start, const int64_t *query_len, const int64_t *context_len,               \
         int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,                   \
         int32_t block_size, float scale) {                                                              \
    const int32_t group = num_heads / num_kv_heads;                                                      \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                       \
    const int64_t block_stride = token_stride * block_size;                                              \
    const int64_t num_items = (int64_t)num_seqs * num_kv_heads;                                          \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                   \
    for (int64_t item = 0; item < num_items; item++) {                                                  \
        const int64_t s = item / num_kv_heads;                                                           \
        const int32_t kv_head = (int32_t)(item % num_kv_heads);                                          \
        const int64_t ctx = context_len[s], rows = query_len[s];                                         \
        const int64_t *table = block_tables + s * block_table_stride;                                    \
        float *buf = (float *)malloc(sizeof(float) * (size_t)group * (size_t)(ctx + 2 * head_dim));     \
        if (buf == NULL) { failed = 1; continue; }                                                       \
        float *scores = buf, *q = buf + (size_t)group * ctx, *acc = q + (size_t)group * head_dim;       \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            const int64_t row = query_start[s] + r, limit = ctx - rows + r + 1;                         \
            const T *block = NULL;  /* the block holding position pos (block_size is a power of two) */ \
            for (int32_t g = 0; g < group; g++) {                                                        \
                const T *src = query + row * query_row_stride + (int64_t)(kv_head * group + g) * head_dim; \
                for (int32_t d = 0; d < head_dim; d++) q[g * head_dim + d] = LOAD(src + d) * scale;      \
            }                                                                                            \
            for (int64_t pos = 0; pos < limit; pos++) {                                                  \
                const int64_t in_block = pos & (block_size - 1);                                         \
                if (in_block == 0) block = key_cache + table[pos / block_size] * block_stride           \
                                           + (int64_t)kv_head * head_dim;                                \
                const T *k = block + in_block * token_stride;                                            \
                for (int32_t g = 0; g < group; g++) {                                                    \
                    const float *qg = q + g * head_dim;                                                  \
                    float dot = 0.0f;                                                                    \
                    _Pragma("omp simd reduction(+ : dot)")                                             \
                    for (int32_t d = 0; d < head_dim; d++) dot += qg[d] * LOAD(k + d);                   \
                    scores[g * ctx + pos] = dot;                                                         \
                }                                                                                        \
            }                                                                                            \
            for (int32_t g = 0; g < group; g++) {                                                        \
                float *sg = scores + g * ctx, best = -FLT_MAX, total = 0.0f;                             \
                for (int64_t pos = 0; pos < limit; pos++) best = sg[pos] > best ? sg[pos] : best;       \
                _Pragma("omp simd reduction(+ : total)")                                               \
                for (int64_t pos = 0; pos < limit; pos++) {                                              \
                    sg[pos] = exp_nonpositive(sg[pos] - best);                                           \
                    total += sg[pos];                                                                    \
                }                                                                                        \
                const float inv = 1.0f / total;                                                          \
                for (int64_t pos = 0; pos < limit; pos++) sg[pos] *= inv;                                \
            }                                                                                            \
            memset(acc, 0, sizeof(float) * (size_t)group * head_dim);                                    \
            for (int64_t pos = 0; pos < limit; pos++) {                                                  \
                const int64_t in_block = pos & (block_size - 1);                                         \
                if (in_block == 0) block = value_cache + table[pos / block_size] * block_stride         \
                                           + (int64_t)kv_head * head_dim;                                \
                const T *v = block + in_block * token_stride;                                            \
                for (int32_t g = 0; g < group; g++) {                                                    \
                    const float p = scores[g * ctx + pos];                                               \
                    float *ag = acc + g * head_dim;                                                      \
                    _Pragma("omp simd")                                                                \
                    for (int32_t d = 0; d < head_dim; d++) ag[d] += p * LOAD(v + d);                     \
                }                                                                                        \
            }                                                                                            \
            for (int32_t g = 0; g < group; g++) {                                                        \
                T *dst = out + row * out_row_stride + (int64_t)(kv_head * group + g) * head_dim;        \
                for (int32_t d = 0; d < head_dim; d++) STORE(dst + d, acc[g * head_dim + d]);           \
            }                                                                                            \
        }                                                                                                \
        free(buf);                                                                                       \
    }                                                                                                    \
    return failed ? -1 : 0;                                                                              \
}

DEFINE_PAGED_ATTENTION(paged_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, LOAD_BF16, STORE_BF16)
