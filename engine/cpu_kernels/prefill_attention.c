/* Causal attention for prefill chunks, every sequence of a step in one call, tiled.
 *
 * paged_attention.c serves decodes: one query row a sequence, each key read once per row. A
 * prefill chunk has hundreds of query rows reading the same keys, and there that kernel (and
 * torch's SDPA, one call a sequence) ran at ~50 GFLOP/s: per row it reduces 16 dot products
 * across lanes, and it re-reads and re-widens every key for every row. Here an item is 16 query
 * rows of one sequence and one KV head (every query head of its GQA group): the keys are widened
 * once per item into a transposed tile of 16 positions, so a score is one vector FMA per
 * dimension shared by four query vectors, with no reduction across lanes; values are widened
 * once per item too. Items (sequence x KV head x row block) go to threads dynamically, so one
 * long prompt spreads over every thread.
 *
 * Same contract as paged_attention.c (layout, arguments, causal rule): sequence s owns query rows
 * query_start[s] .. + query_len[s], which sit at the last query_len[s] of its context_len[s]
 * positions; keys and values are read in place from the block-paged caches (a later chunk's
 * earlier context included). Arithmetic is float32 (bfloat16 widened on load, the output rounded
 * to nearest even) with the same two-pass softmax over a score buffer as the decode kernel.
 */
#include <omp.h>
#include "common.h"

#define ROWS_PER_ITEM 16
#define KEYS_PER_TILE 16

/* acc[v] += sum over the tile's 16 keys t of weights[v * stride + t] * tile[t] (rows of head_dim
 * floats), for n_vec vectors. */
static void weighted_tile_plain(const float *weights, int64_t stride, int64_t n_vec, const float *tile,
                                int32_t head_dim, float *acc) {
    for (int64_t v = 0; v < n_vec; v++) {
        float *a = acc + v * head_dim;
        for (int t = 0; t < KEYS_PER_TILE; t++) {
            const float p = weights[v * stride + t];
            const float *row = tile + t * head_dim;
            _Pragma("omp simd")
            for (int32_t d = 0; d < head_dim; d++) a[d] = __builtin_fmaf(p, row[d], a[d]);
        }
    }
}

#ifdef __AVX512F__
#include <immintrin.h>
/* VB vectors at a time, each accumulator (C vectors of 16: head_dim = 16 C) held in registers
 * across the tile, each value row loaded once for the VB of them. */
#define DEFINE_WEIGHTED_TILE(C, VB)                                                                     \
static int64_t weighted_tile_##C##_##VB(const float *weights, int64_t stride, int64_t n_vec,          \
                                        const float *tile, float *acc) {                                \
    int64_t v = 0;                                                                                      \
    for (; v + VB <= n_vec; v += VB) {                                                                  \
        __m512 a[VB][C];                                                                                \
        for (int b = 0; b < VB; b++)                                                                    \
            for (int c = 0; c < C; c++) a[b][c] = _mm512_loadu_ps(acc + (v + b) * 16 * C + 16 * c);      \
        for (int t = 0; t < KEYS_PER_TILE; t++) {                                                       \
            __m512 row[C];                                                                              \
            for (int c = 0; c < C; c++) row[c] = _mm512_loadu_ps(tile + t * 16 * C + 16 * c);            \
            for (int b = 0; b < VB; b++) {                                                              \
                const __m512 p = _mm512_set1_ps(weights[(v + b) * stride + t]);                         \
                for (int c = 0; c < C; c++) a[b][c] = _mm512_fmadd_ps(p, row[c], a[b][c]);              \
            }                                                                                           \
        }                                                                                               \
        for (int b = 0; b < VB; b++)                                                                    \
            for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (v + b) * 16 * C + 16 * c, a[b][c]);      \
    }                                                                                                   \
    return v;                                                                                           \
}
DEFINE_WEIGHTED_TILE(1, 4)
DEFINE_WEIGHTED_TILE(2, 4)
DEFINE_WEIGHTED_TILE(4, 4)
DEFINE_WEIGHTED_TILE(8, 2)
#endif

static void weighted_tile(const float *weights, int64_t stride, int64_t n_vec, const float *tile,
                          int32_t head_dim, float *acc) {
    int64_t done = 0;
#ifdef __AVX512F__
    switch (head_dim) {
    case 16: done = weighted_tile_1_4(weights, stride, n_vec, tile, acc); break;
    case 32: done = weighted_tile_2_4(weights, stride, n_vec, tile, acc); break;
    case 64: done = weighted_tile_4_4(weights, stride, n_vec, tile, acc); break;
    case 128: done = weighted_tile_8_2(weights, stride, n_vec, tile, acc); break;
    default: break;
    }
#endif
    weighted_tile_plain(weights + done * stride, stride, n_vec - done, tile, head_dim, acc + done * head_dim);
}

/* scores[v * stride + t] = q[v] . key t, for the tile's 16 keys (tile[d][t]: dimension d of key
 * t) and n_vec query vectors of head_dim floats. */
static void tile_scores_plain(const float *q, int64_t n_vec, int32_t head_dim, const float *tile, float *scores,
                              int64_t stride) {
    for (int64_t v = 0; v < n_vec; v++) {
        float sum[KEYS_PER_TILE] = {0};
        const float *qv = q + v * head_dim;
        for (int32_t d = 0; d < head_dim; d++) {
            const float *kd = tile + d * KEYS_PER_TILE;
            _Pragma("omp simd")
            for (int t = 0; t < KEYS_PER_TILE; t++) sum[t] = __builtin_fmaf(qv[d], kd[t], sum[t]);
        }
        memcpy(scores + v * stride, sum, sizeof sum);
    }
}

#ifdef __AVX512F__
/* Eight query vectors at a time: each tile row is loaded once for the eight sums it feeds. */
static int64_t tile_scores_wide(const float *q, int64_t n_vec, int32_t head_dim, const float *tile, float *scores,
                                int64_t stride) {
    int64_t v = 0;
    for (; v + 8 <= n_vec; v += 8) {
        __m512 sum[8];
        for (int b = 0; b < 8; b++) sum[b] = _mm512_setzero_ps();
        const float *qv = q + v * head_dim;
        for (int32_t d = 0; d < head_dim; d++) {
            const __m512 k = _mm512_loadu_ps(tile + d * KEYS_PER_TILE);
            for (int b = 0; b < 8; b++) sum[b] = _mm512_fmadd_ps(_mm512_set1_ps(qv[b * head_dim + d]), k, sum[b]);
        }
        for (int b = 0; b < 8; b++) _mm512_storeu_ps(scores + (v + b) * stride, sum[b]);
    }
    return v;
}
#endif

static void tile_scores(const float *q, int64_t n_vec, int32_t head_dim, const float *tile, float *scores,
                        int64_t stride) {
    int64_t done = 0;
#ifdef __AVX512F__
    done = tile_scores_wide(q, n_vec, head_dim, tile, scores, stride);
#endif
    tile_scores_plain(q + done * head_dim, n_vec - done, head_dim, tile, scores + done * stride, stride);
}

#define ROW_AT(cache, pos) \
    ((cache) + table[(pos) >> block_shift] * block_stride + ((pos) & (block_size - 1)) * token_stride + kv_offset)

#define DEFINE_PREFILL_ATTENTION(NAME, T, LOAD, STORE)                                                  \
int NAME(const T *query, int64_t query_row_stride, const T *key_cache, const T *value_cache,           \
         T *out, int64_t out_row_stride, const int64_t *block_tables, int64_t block_table_stride,        \
         const int64_t *query_start, const int64_t *query_len, const int64_t *context_len,               \
         int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,                   \
         int32_t block_size, float scale) {                                                              \
    const int32_t group = num_heads / num_kv_heads;                                                      \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                       \
    const int64_t block_stride = token_stride * block_size;                                              \
    const int block_shift = __builtin_ctz((unsigned)block_size);                                         \
    /* first_item[s]: the first item of sequence s (items: its row blocks x KV heads) */                \
    int64_t *first_item = (int64_t *)malloc(sizeof(int64_t) * ((size_t)num_seqs + 1));                  \
    if (first_item == NULL) return -1;                                                                   \
    int64_t longest = 0, work = 0;                                                                       \
    first_item[0] = 0;                                                                                   \
    for (int32_t s = 0; s < num_seqs; s++) {                                                             \
        const int64_t blocks = (query_len[s] + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;                       \
        first_item[s + 1] = first_item[s] + blocks * num_kv_heads;                                       \
        longest = context_len[s] > longest ? context_len[s] : longest;                                   \
        work += context_len[s] * query_len[s] * num_kv_heads;                                            \
    }                                                                                                    \
    const int64_t num_items = first_item[num_seqs];                                                      \
    const int64_t padded_longest = (longest + KEYS_PER_TILE - 1) / KEYS_PER_TILE * KEYS_PER_TILE;        \
    const int64_t vectors = (int64_t)ROWS_PER_ITEM * group; /* query vectors an item holds at most */   \
    int failed = 0;                                                                                      \
    /* Below ~512 query-key pairs (a prompt of a dozen tokens) waking the other threads costs more \
     * than they save, as in the decode kernel. */                                                      \
    _Pragma("omp parallel if (num_items > 1 && work > 512)")                                          \
    {                                                                                                    \
    /* per thread: queries, scores, one transposed key tile (or widened value rows), outputs */        \
    float *buf = (float *)malloc(sizeof(float) * (size_t)(vectors * head_dim + vectors * padded_longest \
                                                          + (int64_t)KEYS_PER_TILE * head_dim + vectors * head_dim)); \
    if (buf == NULL) {                                                                                   \
        _Pragma("omp atomic write")                                                                   \
        failed = 1;                                                                                      \
    }                                                                                                    \
    _Pragma("omp for schedule(dynamic, 1)")                                                       \
    for (int64_t item = 0; item < num_items; item++) {                                                  \
        if (buf == NULL) continue;                                                                       \
        int32_t s = 0;                                                                                   \
        while (first_item[s + 1] <= item) s++;                                                           \
        const int64_t local = item - first_item[s];                                                      \
        const int64_t row_block = local / num_kv_heads;                                                  \
        const int32_t kv_head = (int32_t)(local % num_kv_heads);                                         \
        const int64_t kv_offset = (int64_t)kv_head * head_dim;                                           \
        const int64_t *table = block_tables + s * block_table_stride;                                    \
        const int64_t ctx = context_len[s], rows = query_len[s], first_pos = ctx - rows;                 \
        const int64_t r0 = row_block * ROWS_PER_ITEM;                                                    \
        const int64_t r1 = r0 + ROWS_PER_ITEM < rows ? r0 + ROWS_PER_ITEM : rows;                        \
        const int64_t n_vec = (r1 - r0) * group, limit = first_pos + r1; /* keys the last row sees */   \
        const int64_t padded = (limit + KEYS_PER_TILE - 1) / KEYS_PER_TILE * KEYS_PER_TILE;              \
        float *q = buf, *scores = q + vectors * head_dim, *tile = scores + vectors * padded_longest;    \
        float *acc = tile + (int64_t)KEYS_PER_TILE * head_dim;                                           \
        /* vector v = (row r0 + v / group, query head kv_head * group + v % group), scaled */           \
        for (int64_t v = 0; v < n_vec; v++) {                                                            \
            const T *src = query + (query_start[s] + r0 + v / group) * query_row_stride                 \
                           + (int64_t)(kv_head * group + v % group) * head_dim;                          \
            for (int32_t d = 0; d < head_dim; d++) q[v * head_dim + d] = LOAD(src + d) * scale;          \
        }                                                                                                \
        for (int64_t start = 0; start < padded; start += KEYS_PER_TILE) {                                \
            /* tile[d][t]: dimension d of key start + t (zero past the last key) */                    \
            for (int64_t t = 0; t < KEYS_PER_TILE; t++) {                                                \
                if (start + t < limit) {                                                                 \
                    const T *k = ROW_AT(key_cache, start + t);                                           \
                    for (int32_t d = 0; d < head_dim; d++) tile[d * KEYS_PER_TILE + t] = LOAD(k + d);    \
                } else {                                                                                 \
                    for (int32_t d = 0; d < head_dim; d++) tile[d * KEYS_PER_TILE + t] = 0.0f;           \
                }                                                                                        \
            }                                                                                            \
            tile_scores(q, n_vec, head_dim, tile, scores + start, padded);                               \
        }                                                                                                \
        /* Softmax of each vector over the keys its row sees; the rest weigh zero. */                  \
        for (int64_t v = 0; v < n_vec; v++) {                                                            \
            float *sv = scores + v * padded, best = -FLT_MAX, total = 0.0f;                              \
            const int64_t seen = first_pos + r0 + v / group + 1;                                         \
            _Pragma("omp simd reduction(max : best)")                                                  \
            for (int64_t pos = 0; pos < seen; pos++) best = sv[pos] > best ? sv[pos] : best;             \
            _Pragma("omp simd reduction(+ : total)")                                                   \
            for (int64_t pos = 0; pos < seen; pos++) {                                                   \
                sv[pos] = exp_nonpositive(sv[pos] - best);                                               \
                total += sv[pos];                                                                        \
            }                                                                                            \
            for (int64_t pos = seen; pos < padded; pos++) sv[pos] = 0.0f;                                \
            q[v * head_dim] = 1.0f / total; /* the normalizer, where the spent query was */             \
        }                                                                                                \
        /* Weighted values, a tile of 16 value rows at a time (widened once for every vector), into  \
         * each vector's float32 sum; the normalizer is applied once per output at the end. */         \
        memset(acc, 0, sizeof(float) * (size_t)(n_vec * head_dim));                                     \
        for (int64_t start = 0; start < padded; start += KEYS_PER_TILE) {                                \
            for (int64_t t = 0; t < KEYS_PER_TILE; t++) {                                                \
                float *row = tile + t * head_dim;                                                        \
                if (start + t < limit) {                                                                 \
                    const T *vr = ROW_AT(value_cache, start + t);                                        \
                    for (int32_t d = 0; d < head_dim; d++) row[d] = LOAD(vr + d);                        \
                } else {                                                                                 \
                    memset(row, 0, sizeof(float) * (size_t)head_dim); /* weight 0 x NaN would be NaN */ \
                }                                                                                        \
            }                                                                                            \
            weighted_tile(scores + start, padded, n_vec, tile, head_dim, acc);                           \
        }                                                                                                \
        for (int64_t v = 0; v < n_vec; v++) {                                                            \
            const float inv = q[v * head_dim];                                                           \
            T *dst = out + (query_start[s] + r0 + v / group) * out_row_stride                           \
                     + (int64_t)(kv_head * group + v % group) * head_dim;                                \
            for (int32_t d = 0; d < head_dim; d++) STORE(dst + d, acc[v * head_dim + d] * inv);          \
        }                                                                                                \
    }                                                                                                    \
    free(buf);                                                                                           \
    }                                                                                                    \
    free(first_item);                                                                                    \
    return failed ? -1 : 0;                                                                              \
}

DEFINE_PREFILL_ATTENTION(prefill_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_PREFILL_ATTENTION(prefill_attention_bf16, uint16_t, LOAD_BF16, STORE_BF16)
