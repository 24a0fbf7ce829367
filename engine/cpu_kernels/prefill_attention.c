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
 * bfloat16 on a CPU with AVX512_BF16 takes the pair-dot kernel at the end of this file instead
 * (head_dim 32, 64 or 128): keys and values packed once per call, products on vdpbf16ps, ~2x
 * faster (SmolLM2's heads, 8 x 256-token prompts: 7.2-8.5 ms a layer -> 3.6-4.4; one 2,048-token
 * prompt: 44 -> 20).
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
DEFINE_PREFILL_ATTENTION(prefill_attention_bf16_widened, uint16_t, LOAD_BF16, STORE_BF16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bfloat16 with AVX512_BF16: both products on the native pair dot product (vdpbf16ps, 32
 * bfloat16 multiply-adds an instruction into 16 float32 sums: twice the float32 FMA's rate).
 *
 * The widened kernel above spent its time converting: every item widened and transposed the keys
 * it reads into a float32 tile, so a 256-token prompt's keys were rebuilt for each of its 16 row
 * blocks, and its FMAs ran at float32's rate. Here a first pass packs each (sequence, KV head)'s
 * keys and values once per call, in the layouts the pair dot reads directly:
 *   keys    [tile of 16 positions][dimension pair p][position t]  word = (k_t[2p], k_t[2p+1])
 *   values  [position pair j][dimension d]                         word = (v_2j[d], v_2j+1[d])
 * (a word is two bfloat16, the even element in the low half, as vdpbf16ps pairs them). A score of
 * 16 positions is then head_dim / 2 pair dots, one query word broadcast to each; a weighted value
 * row pair is one pair dot per 16 dimensions, the two weights broadcast as one word.
 *
 * The numbers differ from the widened kernel's in two places, as in a GPU's flash attention:
 * products of bfloat16 pairs are summed in float32 in the instruction's own order, and the
 * softmax weights are rounded to bfloat16 before they weigh the values (their normalizer sums the
 * rounded weights, so each output is still a convex combination). The scale multiplies the float32
 * scores; the instruction flushes denormal inputs and results to zero. */
#define PAIR_DOT(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))

/* scores[v * stride + t] = scale * q_v . key t over TILES packed key tiles (consecutive), for
 * n_vec query vectors (rows of words, row v at q[v]); NB vectors at a time share each load of a
 * tile, and each query word's broadcast feeds the TILES tiles. */
#define DEFINE_PAIR_SCORES(NB, TILES)                                                                   \
static int64_t pair_scores_##NB##_##TILES(const uint32_t *const *q, int64_t n_vec, int32_t pairs,      \
                                          const uint32_t *tile, float scale, float *scores,            \
                                          int64_t stride) {                                             \
    const __m512 scale16 = _mm512_set1_ps(scale);                                                       \
    const int64_t tile_words = (int64_t)KEYS_PER_TILE * pairs;                                          \
    int64_t v = 0;                                                                                      \
    for (; v + NB <= n_vec; v += NB) {                                                                  \
        __m512 sum[NB][TILES];                                                                          \
        for (int b = 0; b < NB; b++)                                                                    \
            for (int j = 0; j < TILES; j++) sum[b][j] = _mm512_setzero_ps();                            \
        for (int32_t p = 0; p < pairs; p++) {                                                           \
            __m512i k[TILES];                                                                           \
            for (int j = 0; j < TILES; j++) k[j] = _mm512_loadu_si512(tile + j * tile_words + p * KEYS_PER_TILE); \
            for (int b = 0; b < NB; b++) {                                                              \
                const __m512i w = _mm512_set1_epi32((int)q[v + b][p]);                                  \
                for (int j = 0; j < TILES; j++) sum[b][j] = PAIR_DOT(sum[b][j], w, k[j]);               \
            }                                                                                           \
        }                                                                                               \
        for (int b = 0; b < NB; b++)                                                                    \
            for (int j = 0; j < TILES; j++)                                                             \
                _mm512_storeu_ps(scores + (v + b) * stride + j * KEYS_PER_TILE, _mm512_mul_ps(sum[b][j], scale16)); \
    }                                                                                                   \
    return v;                                                                                           \
}
DEFINE_PAIR_SCORES(8, 2)
DEFINE_PAIR_SCORES(1, 2)
DEFINE_PAIR_SCORES(8, 1)
DEFINE_PAIR_SCORES(1, 1)

/* acc[v] = sum over position pairs j < n_pairs of (w_v[2j], w_v[2j+1]) . value pair row j, for
 * n_vec vectors whose weights are rows of bfloat16 pairs (row v at weights + v * stride words);
 * VB vectors at a time hold their C x 16 float32 sums in registers (head_dim = 16 C). */
#define DEFINE_PAIR_VALUES(C, VB)                                                                       \
static int64_t pair_values_##C##_##VB(const uint32_t *weights, int64_t stride, int64_t n_vec,          \
                                      int64_t n_pairs, const uint32_t *values, float *acc) {            \
    int64_t v = 0;                                                                                      \
    for (; v + VB <= n_vec; v += VB) {                                                                  \
        __m512 a[VB][C];                                                                                \
        for (int b = 0; b < VB; b++)                                                                    \
            for (int c = 0; c < C; c++) a[b][c] = _mm512_setzero_ps();                                  \
        for (int64_t j = 0; j < n_pairs; j++) {                                                         \
            __m512i row[C];                                                                             \
            for (int c = 0; c < C; c++) row[c] = _mm512_loadu_si512(values + j * 16 * C + 16 * c);      \
            for (int b = 0; b < VB; b++) {                                                              \
                const __m512i w = _mm512_set1_epi32((int)weights[(v + b) * stride + j]);                \
                for (int c = 0; c < C; c++) a[b][c] = PAIR_DOT(a[b][c], w, row[c]);                     \
            }                                                                                           \
        }                                                                                               \
        for (int b = 0; b < VB; b++)                                                                    \
            for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (v + b) * 16 * C + 16 * c, a[b][c]);     \
    }                                                                                                   \
    return v;                                                                                           \
}
DEFINE_PAIR_VALUES(2, 4)
DEFINE_PAIR_VALUES(2, 1)
DEFINE_PAIR_VALUES(4, 4)
DEFINE_PAIR_VALUES(4, 1)
DEFINE_PAIR_VALUES(8, 2)
DEFINE_PAIR_VALUES(8, 1)

static void pair_values(const uint32_t *weights, int64_t stride, int64_t n_vec, int64_t n_pairs,
                        const uint32_t *values, int32_t head_dim, float *acc) {
    int64_t v = 0;
    switch (head_dim) {
    case 32:
        v = pair_values_2_4(weights, stride, n_vec, n_pairs, values, acc);
        pair_values_2_1(weights + v * stride, stride, n_vec - v, n_pairs, values, acc + v * head_dim);
        break;
    case 64:
        v = pair_values_4_4(weights, stride, n_vec, n_pairs, values, acc);
        pair_values_4_1(weights + v * stride, stride, n_vec - v, n_pairs, values, acc + v * head_dim);
        break;
    default: /* 128 */
        v = pair_values_8_2(weights, stride, n_vec, n_pairs, values, acc);
        pair_values_8_1(weights + v * stride, stride, n_vec - v, n_pairs, values, acc + v * head_dim);
        break;
    }
}

static int prefill_attention_bf16_pairs(const uint16_t *query, int64_t query_row_stride, const uint16_t *key_cache,
                                        const uint16_t *value_cache, uint16_t *out, int64_t out_row_stride,
                                        const int64_t *block_tables, int64_t block_table_stride,
                                        const int64_t *query_start, const int64_t *query_len,
                                        const int64_t *context_len, int32_t num_seqs, int32_t num_heads,
                                        int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale) {
    const int32_t group = num_heads / num_kv_heads, pairs = head_dim / 2;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = token_stride * block_size;
    const int block_shift = __builtin_ctz((unsigned)block_size);
    /* Per sequence: its first item, its first key tile, and where its packed keys/values start. */
    int64_t *first_item = (int64_t *)malloc(sizeof(int64_t) * 3 * ((size_t)num_seqs + 1));
    if (first_item == NULL) return -1;
    int64_t *first_tile = first_item + num_seqs + 1, *packed_at = first_tile + num_seqs + 1;
    int64_t longest = 0, work = 0;
    first_item[0] = first_tile[0] = packed_at[0] = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int64_t blocks = (query_len[s] + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
        const int64_t tiles = (context_len[s] + KEYS_PER_TILE - 1) / KEYS_PER_TILE;
        first_item[s + 1] = first_item[s] + blocks * num_kv_heads;
        first_tile[s + 1] = first_tile[s] + tiles;
        packed_at[s + 1] = packed_at[s] + tiles * KEYS_PER_TILE * num_kv_heads * pairs; /* words */
        longest = context_len[s] > longest ? context_len[s] : longest;
        work += context_len[s] * query_len[s] * num_kv_heads;
    }
    const int64_t num_items = first_item[num_seqs], num_tiles = first_tile[num_seqs];
    const int64_t padded_longest = (longest + KEYS_PER_TILE - 1) / KEYS_PER_TILE * KEYS_PER_TILE;
    const int64_t vectors = (int64_t)ROWS_PER_ITEM * group;
    uint32_t *packed_keys = (uint32_t *)malloc(sizeof(uint32_t) * 2 * (size_t)packed_at[num_seqs]);
    if (packed_keys == NULL) {
        free(first_item);
        return -1;
    }
    uint32_t *packed_values = packed_keys + packed_at[num_seqs];
    int failed = 0;
    _Pragma("omp parallel if (num_items > 1 && work > 512)")
    {
    /* Pack: a unit is one key tile of one sequence, for every KV head. */
    _Pragma("omp for schedule(dynamic, 4)")
    for (int64_t unit = 0; unit < num_tiles; unit++) {
        int32_t s = 0;
        while (first_tile[s + 1] <= unit) s++;
        const int64_t *table = block_tables + s * block_table_stride;
        const int64_t ctx = context_len[s], start = (unit - first_tile[s]) * KEYS_PER_TILE;
        const int64_t head_words = (first_tile[s + 1] - first_tile[s]) * KEYS_PER_TILE * pairs;
        for (int32_t h = 0; h < num_kv_heads; h++) {
            const int64_t kv_offset = (int64_t)h * head_dim;
            uint32_t *keys = packed_keys + packed_at[s] + h * head_words + start * pairs;
            uint32_t *values = packed_values + packed_at[s] + h * head_words + start * pairs;
            for (int64_t t = 0; t < KEYS_PER_TILE; t++) {
                if (start + t < ctx) {
                    const uint32_t *k = (const uint32_t *)ROW_AT(key_cache, start + t);
                    for (int32_t p = 0; p < pairs; p++) keys[p * KEYS_PER_TILE + t] = k[p];
                } else {
                    for (int32_t p = 0; p < pairs; p++) keys[p * KEYS_PER_TILE + t] = 0;
                }
            }
            /* Zero rows past the context: a weight of 0 times a NaN left in a free slot is NaN. */
            for (int64_t t = 0; t < KEYS_PER_TILE; t += 2) {
                const uint16_t *even = start + t < ctx ? ROW_AT(value_cache, start + t) : NULL;
                const uint16_t *odd = start + t + 1 < ctx ? ROW_AT(value_cache, start + t + 1) : NULL;
                uint32_t *row = values + (t / 2) * head_dim;
                for (int32_t d = 0; d < head_dim; d++)
                    row[d] = (even ? (uint32_t)even[d] : 0u) | ((odd ? (uint32_t)odd[d] : 0u) << 16);
            }
        }
    }
    /* Attend (the loop above ends with a barrier): items as in the widened kernel. */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(vectors * padded_longest + vectors * head_dim + vectors)
                                 + sizeof(uint32_t *) * (size_t)vectors);
    if (buf == NULL) {
        _Pragma("omp atomic write")
        failed = 1;
    }
    _Pragma("omp for schedule(dynamic, 1)")
    for (int64_t item = 0; item < num_items; item++) {
        if (buf == NULL) continue;
        int32_t s = 0;
        while (first_item[s + 1] <= item) s++;
        const int64_t local = item - first_item[s];
        const int64_t row_block = local / num_kv_heads;
        const int32_t kv_head = (int32_t)(local % num_kv_heads);
        const int64_t head_words = (first_tile[s + 1] - first_tile[s]) * KEYS_PER_TILE * pairs;
        const uint32_t *keys = packed_keys + packed_at[s] + kv_head * head_words;
        const uint32_t *values = packed_values + packed_at[s] + kv_head * head_words;
        const int64_t ctx = context_len[s], rows = query_len[s], first_pos = ctx - rows;
        const int64_t r0 = row_block * ROWS_PER_ITEM;
        const int64_t r1 = r0 + ROWS_PER_ITEM < rows ? r0 + ROWS_PER_ITEM : rows;
        const int64_t n_vec = (r1 - r0) * group, limit = first_pos + r1; /* keys the last row sees */
        const int64_t padded = (limit + KEYS_PER_TILE - 1) / KEYS_PER_TILE * KEYS_PER_TILE;
        float *scores = buf, *acc = scores + vectors * padded_longest, *inverse = acc + vectors * head_dim;
        const uint32_t **q = (const uint32_t **)(inverse + vectors);
        /* vector v = (row r0 + v / group, query head kv_head * group + v % group) */
        for (int64_t v = 0; v < n_vec; v++)
            q[v] = (const uint32_t *)(query + (query_start[s] + r0 + v / group) * query_row_stride
                                      + (int64_t)(kv_head * group + v % group) * head_dim);
        int64_t start = 0;
        for (; start + 2 * KEYS_PER_TILE <= padded; start += 2 * KEYS_PER_TILE) {
            const uint32_t *tile = keys + start * pairs;
            const int64_t done = pair_scores_8_2(q, n_vec, pairs, tile, scale, scores + start, padded);
            pair_scores_1_2(q + done, n_vec - done, pairs, tile, scale, scores + done * padded + start, padded);
        }
        if (start < padded) {
            const uint32_t *tile = keys + start * pairs;
            const int64_t done = pair_scores_8_1(q, n_vec, pairs, tile, scale, scores + start, padded);
            pair_scores_1_1(q + done, n_vec - done, pairs, tile, scale, scores + done * padded + start, padded);
        }
        /* Softmax of each vector over the keys its row sees, the weights rounded to bfloat16 in
         * place (a row of padded floats becomes padded bfloat16: the writes trail the reads). */
        for (int64_t v = 0; v < n_vec; v++) {
            float *sv = scores + v * padded, best = -FLT_MAX;
            const int64_t seen = first_pos + r0 + v / group + 1;
            _Pragma("omp simd reduction(max : best)")
            for (int64_t pos = 0; pos < seen; pos++) best = sv[pos] > best ? sv[pos] : best;
            _Pragma("omp simd")
            for (int64_t pos = 0; pos < seen; pos++) sv[pos] = exp_nonpositive(sv[pos] - best);
            for (int64_t pos = seen; pos < padded; pos++) sv[pos] = 0.0f;
            __m512 total = _mm512_setzero_ps();
            uint16_t *weights = (uint16_t *)sv;
            for (int64_t pos = 0; pos < padded; pos += 16) {
                const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sv + pos));
                total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
                _mm256_storeu_si256((__m256i *)(weights + pos), rounded);
            }
            inverse[v] = 1.0f / _mm512_reduce_add_ps(total);
        }
        pair_values((const uint32_t *)scores, padded, n_vec, padded / 2, values, head_dim, acc);
        for (int64_t v = 0; v < n_vec; v++) {
            uint16_t *dst = out + (query_start[s] + r0 + v / group) * out_row_stride
                            + (int64_t)(kv_head * group + v % group) * head_dim;
            const __m512 inv = _mm512_set1_ps(inverse[v]);
            for (int32_t d = 0; d < head_dim; d += 16) /* vcvtneps2bf16: denormal results flush to zero */
                _mm256_storeu_si256((__m256i *)(dst + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + v * head_dim + d), inv)));
        }
    }
    free(buf);
    }
    free(packed_keys);
    free(first_item);
    return failed ? -1 : 0;
}
#define HAVE_PAIR_PREFILL 1
#else
#define HAVE_PAIR_PREFILL 0
#endif

int prefill_attention_bf16(const uint16_t *query, int64_t query_row_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, uint16_t *out, int64_t out_row_stride,
                           const int64_t *block_tables, int64_t block_table_stride, const int64_t *query_start,
                           const int64_t *query_len, const int64_t *context_len, int32_t num_seqs,
                           int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                           float scale) {
#if HAVE_PAIR_PREFILL
    if (head_dim == 32 || head_dim == 64 || head_dim == 128)
        return prefill_attention_bf16_pairs(query, query_row_stride, key_cache, value_cache, out, out_row_stride,
                                            block_tables, block_table_stride, query_start, query_len, context_len,
                                            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale);
#endif
    return prefill_attention_bf16_widened(query, query_row_stride, key_cache, value_cache, out, out_row_stride,
                                          block_tables, block_table_stride, query_start, query_len, context_len,
                                          num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale);
}
