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
 * nearest even), with a two-pass softmax over a score buffer of the thread's. With AVX-512 and a
 * head_dim that is a multiple of 16, the query-key dot products of 16 positions are reduced
 * together (one transposing add tree instead of 16 horizontal sums: the dot products were
 * two thirds of the kernel's time); elsewhere the same loops are left to the compiler.
 * With AVX512_BF16, bfloat16 query-key dot products take the native bf16 pair dot product
 * (vdpbf16ps: products exact in float32, summed in float32, denormals flushed to zero; the scale
 * is applied to the sum). The weighted sum of values keeps each query head's accumulator in
 * registers (head_dim 16, 32, 64 or 128; up to four query heads of a GQA group at a time, two at
 * head_dim 128, so each value row is widened once for them: SmolLM2's group of three in one pass
 * instead of two was ~10% faster); other head sizes take the plain loop.
 * OpenMP inside is the runtime torch loaded, so this shares torch's thread pool; a thread
 * allocates its score buffer once per call, at its first item, not once per (sequence, KV head).
 */
#include <omp.h>
#include "common.h"

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 vectors in, one out whose lane i is the sum of v[i]'s 16 lanes. */
static inline __m512 sum_lanes_of_16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* each 128-bit lane j: [sum v4i, v4i+1, v4i+2, v4i+3 over lane j] */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}
#define HAVE_WIDE_PATH 1
#else
#define HAVE_WIDE_PATH 0
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

/* Rows of one KV head sit num_kv_heads rows apart from the next token's, in blocks scattered
 * through the cache: the hardware prefetcher does not follow that, and the kernel waited on memory
 * more than it computed. Each 16 positions fetch the 16 rows PREFETCH_AHEAD positions ahead, into
 * L2 only (prefetcht2): prefetches into L1 held its few fill buffers, so the loads of the rows
 * being used waited behind them. SmolLM2's heads, 30 layers of bf16 caches at ~300 tokens, cold:
 * 6.8 -> 4.3 ms at batch 8, 47 -> 26 ms at batch 64 against 16 rows ahead into L1. */
#define PREFETCH_AHEAD 48
#define PREFETCH_ROWS(cache, from, limit, row_bytes)                                                   \
    for (int64_t ahead = (from); ahead < (from) + 16 && ahead < (limit); ahead++) {                      \
        const char *line = (const char *)ROW_AT(cache, ahead);                                          \
        for (int64_t byte = 0; byte < (row_bytes); byte += 64) __builtin_prefetch(line + byte, 0, 1);    \
    }
/* The rows up to PREFETCH_AHEAD, before the first 16 positions are read. */
#define PREFETCH_FIRST(cache, limit, row_bytes)                                                        \
    for (int64_t first = 0; first < PREFETCH_AHEAD; first += 16) PREFETCH_ROWS(cache, first, limit, row_bytes)

/* Where position pos's key (or value) row of this KV head lies. */
#define ROW_AT(cache, pos) \
    ((cache) + table[(pos) >> block_shift] * block_stride + ((pos) & (block_size - 1)) * token_stride + kv_offset)

/* Where one (sequence, KV head) item's rows lie in the cache: what ROW_AT needs. */
#define ITEM_GEOMETRY const int64_t *table, int32_t block_size, int block_shift, int64_t block_stride, \
                      int64_t token_stride, int64_t kv_offset
#define ITEM_ARGS table, block_size, block_shift, block_stride, token_stride, kv_offset

typedef float f32; /* the names the kernels' instantiations are suffixed with */
typedef uint16_t bf16;

#if HAVE_WIDE_PATH
/* acc[g] = sum over positions of probs[g][pos] * value row, for GB query heads at once, each
 * accumulator (C vectors of 16: head_dim = 16 C) held in registers; each value row is loaded and
 * widened once for the GB heads. */
#define DEFINE_WEIGHTED_VALUES(NAME, T, LOAD16, C, GB)                                                 \
static void NAME(const float *probs, int64_t padded, const T *value_cache, int64_t limit,              \
                 int32_t head_dim, ITEM_GEOMETRY, float *acc_out) {                                      \
    __m512 acc[GB][C];                                                                                   \
    for (int g = 0; g < GB; g++)                                                                         \
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();                                     \
    PREFETCH_FIRST(value_cache, limit, head_dim * (int64_t)sizeof(T))                                  \
    for (int64_t pos = 0; pos < limit; pos++) {                                                          \
        if ((pos & 15) == 0) PREFETCH_ROWS(value_cache, pos + PREFETCH_AHEAD, limit, head_dim * (int64_t)sizeof(T))  \
        const T *v = ROW_AT(value_cache, pos);                                                           \
        __m512 row[C];                                                                                   \
        for (int c = 0; c < C; c++) row[c] = LOAD16(v + 16 * c);                                         \
        for (int g = 0; g < GB; g++) {                                                                   \
            const __m512 p = _mm512_set1_ps(probs[g * padded + pos]);                                    \
            for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(p, row[c], acc[g][c]);              \
        }                                                                                                \
    }                                                                                                    \
    for (int g = 0; g < GB; g++)                                                                         \
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc_out + g * head_dim + 16 * c, acc[g][c]);       \
}

#define DEFINE_WEIGHTED_VALUES_FOR(T, LOAD16)                                                          \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_1_1, T, LOAD16, 1, 1)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_1_2, T, LOAD16, 1, 2)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_1_3, T, LOAD16, 1, 3)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_1_4, T, LOAD16, 1, 4)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_2_1, T, LOAD16, 2, 1)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_2_2, T, LOAD16, 2, 2)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_2_3, T, LOAD16, 2, 3)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_2_4, T, LOAD16, 2, 4)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_4_1, T, LOAD16, 4, 1)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_4_2, T, LOAD16, 4, 2)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_4_3, T, LOAD16, 4, 3)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_4_4, T, LOAD16, 4, 4)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_8_1, T, LOAD16, 8, 1)                                  \
    DEFINE_WEIGHTED_VALUES(weighted_values_##T##_8_2, T, LOAD16, 8, 2)                                  \
    /* 1 if this head_dim has a register path (the caller then needs no other loop). Up to four     \
     * query heads of the group share each value row's load (two at head_dim 128, whose 8 vectors   \
     * an accumulator each would not fit the registers for more). */                                \
    static int weighted_values_##T(const float *probs, int64_t padded, const T *value_cache,            \
                                   int64_t limit, int32_t group, int32_t head_dim, ITEM_GEOMETRY,       \
                                   float *acc) {                                                        \
        const int most = head_dim == 128 ? 2 : 4;                                                       \
        for (int32_t g = 0; g < group;) {                                                               \
            const int heads = group - g < most ? group - g : most;                                      \
            const float *pg = probs + g * padded;                                                       \
            float *ag = acc + g * head_dim;                                                             \
            switch (head_dim * 8 + heads) {                                                             \
            case 129: weighted_values_##T##_1_1(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 130: weighted_values_##T##_1_2(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 131: weighted_values_##T##_1_3(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 132: weighted_values_##T##_1_4(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 257: weighted_values_##T##_2_1(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 258: weighted_values_##T##_2_2(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 259: weighted_values_##T##_2_3(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 260: weighted_values_##T##_2_4(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 513: weighted_values_##T##_4_1(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 514: weighted_values_##T##_4_2(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 515: weighted_values_##T##_4_3(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 516: weighted_values_##T##_4_4(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 1025: weighted_values_##T##_8_1(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            case 1026: weighted_values_##T##_8_2(pg, padded, value_cache, limit, head_dim, ITEM_ARGS, ag); break; \
            default: return 0;                                                                          \
            }                                                                                           \
            g += heads;                                                                                 \
        }                                                                                               \
        return 1;                                                                                       \
    }

DEFINE_WEIGHTED_VALUES_FOR(f32, load16_f32)
DEFINE_WEIGHTED_VALUES_FOR(bf16, load16_bf16)
#define WEIGHTED_VALUES(T) weighted_values_##T
#else
#define WEIGHTED_VALUES(T) weighted_values_none
static int weighted_values_none(const float *probs, int64_t padded, const void *value_cache, int64_t limit,
                                int32_t group, int32_t head_dim, ITEM_GEOMETRY, float *acc) {
    (void)probs; (void)padded; (void)value_cache; (void)limit; (void)group; (void)head_dim; (void)acc;
    (void)table; (void)block_size; (void)block_shift; (void)block_stride; (void)token_stride; (void)kv_offset;
    return 0;
}
#endif

#if HAVE_BF16_DOT
/* scores[g][pos] = scale * q_g . k_pos with bfloat16 q and k multiplied pairwise in float32
 * (vdpbf16ps), 16 positions at a time reduced together; head_dim a multiple of 32. */
static void scores_bf16_dot(const uint16_t *q, float scale, const uint16_t *key_cache, int64_t limit,
                            int32_t group, int32_t head_dim, ITEM_GEOMETRY, float *scores, int64_t padded) {
    const int32_t chunks = head_dim / 32;
    const __m512 scale16 = _mm512_set1_ps(scale);
    PREFETCH_FIRST(key_cache, limit, head_dim * (int64_t)sizeof(uint16_t))
    for (int64_t start = 0; start < limit; start += 16) {
        PREFETCH_ROWS(key_cache, start + PREFETCH_AHEAD, limit, head_dim * (int64_t)sizeof(uint16_t))
        const int64_t n = limit - start < 16 ? limit - start : 16;
        const uint16_t *rows_k[16];
        for (int64_t t = 0; t < n; t++) rows_k[t] = ROW_AT(key_cache, start + t);
        for (int32_t g = 0; g < group; g++) {
            const uint16_t *qg = q + (int64_t)g * head_dim;
            __m512 partial[16];
            for (int64_t t = 0; t < 16; t++) {
                __m512 sum = _mm512_setzero_ps();
                if (t < n)
                    for (int32_t c = 0; c < chunks; c++)
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(qg + 32 * c),
                                               (__m512bh)_mm512_loadu_si512(rows_k[t] + 32 * c));
                partial[t] = sum;
            }
            _mm512_storeu_ps(scores + g * padded + start, _mm512_mul_ps(sum_lanes_of_16(partial), scale16));
        }
    }
}
#endif

/* Whether bfloat16 scores take the native pair dot product (then the query is read unscaled). */
#define BF16_DOT_f32(head_dim) 0
#define BF16_DOT_bf16(head_dim) (HAVE_BF16_DOT && (head_dim) % 32 == 0)

#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE, LOAD16)                                            \
static void NAME##_scores(const float *q, const T *query_row, float scale, const T *key_cache,          \
                          int64_t limit, int32_t group, int32_t head_dim, ITEM_GEOMETRY,                 \
                          float *scores, int64_t ctx) {                                                  \
    (void)query_row; (void)scale;                                                                        \
    if (BF16_DOT_##T(head_dim)) {                                                                        \
        SCORES_BF16_DOT(query_row, scale, key_cache, limit, group, head_dim, scores, ctx)                \
        return;                                                                                          \
    }                                                                                                    \
    if (HAVE_WIDE_PATH && head_dim % 16 == 0) {                                                         \
        WIDE_SCORES(T, LOAD16)                                                                          \
        return;                                                                                         \
    }                                                                                                   \
    PREFETCH_FIRST(key_cache, limit, head_dim * (int64_t)sizeof(T))                                     \
    for (int64_t pos = 0; pos < limit; pos++) {                                                         \
        if ((pos & 15) == 0) PREFETCH_ROWS(key_cache, pos + PREFETCH_AHEAD, limit, head_dim * (int64_t)sizeof(T))   \
        const T *k = ROW_AT(key_cache, pos);                                                            \
        for (int32_t g = 0; g < group; g++) {                                                           \
            const float *qg = q + g * head_dim;                                                         \
            float dot = 0.0f;                                                                           \
            _Pragma("omp simd reduction(+ : dot)")                                                    \
            for (int32_t d = 0; d < head_dim; d++) dot += qg[d] * LOAD(k + d);                          \
            scores[g * ctx + pos] = dot;                                                                \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
int NAME(const T *query, int64_t query_row_stride, const T *key_cache, const T *value_cache,           \
         T *out, int64_t out_row_stride, const int64_t *block_tables, int64_t block_table_stride,        \
         const int64_t *query_start, const int64_t *query_len, const int64_t *context_len,               \
         int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,                   \
         int32_t block_size, float scale) {                                                              \
    const int32_t group = num_heads / num_kv_heads;                                                      \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                       \
    const int64_t block_stride = token_stride * block_size;                                              \
    const int block_shift = __builtin_ctz((unsigned)block_size);                                         \
    const int64_t num_items = (int64_t)num_seqs * num_kv_heads;                                          \
    const int bf16_dot = BF16_DOT_##T(head_dim);                                                         \
    int failed = 0;                                                                                      \
    /* Query-key pairs to visit: below ~512 (a sequence of a few dozen tokens) waking the other    \
     * threads costs more than they save (far more when another process holds their core).          \
     * Batch 1 at 320 tokens (960 pairs) still gains: 35-48 us across 2 threads, 52-80 on one. */    \
    int64_t work = 0, longest = 0;                                                                       \
    for (int32_t s = 0; s < num_seqs; s++) {                                                             \
        work += context_len[s] * query_len[s] * num_kv_heads;                                            \
        longest = context_len[s] > longest ? context_len[s] : longest;                                   \
    }                                                                                                    \
    /* scores padded to whole 16s: the wide paths write them 16 at a time */                           \
    const int64_t longest_padded = (longest + 15) & ~(int64_t)15;                                        \
    _Pragma("omp parallel if (work > 512)")                                                           \
    {                                                                                                    \
    float *buf = NULL;                                                                                   \
    /* Runs of 8 consecutive items a grab (a sequence's KV heads, then the next sequence's): they    \
     * read neighbouring cache lines, and runs keep threads balanced when contexts differ. Cold     \
     * cache, one layer of 64 sequences: at 324 tokens each 1.40 ms against 1.52 for single items   \
     * and 1.33 for one static run a thread; at 16-647 tokens (sorted) 1.72 against 1.91 and 2.17.  \
     * A few items (batch 1: one per KV head) go one a grab: a run of 8 would give them all to the  \
     * first thread to arrive and leave the others waiting at the barrier. */                       \
    const int64_t run = num_items >= 16 * (int64_t)omp_get_num_threads() ? 8 : 1;                        \
    _Pragma("omp for schedule(dynamic, run)")                                                     \
    for (int64_t item = 0; item < num_items; item++) {                                                  \
        if (buf == NULL) {                                                                               \
            buf = (float *)malloc(sizeof(float) * (size_t)group * (size_t)(longest_padded + 2 * head_dim)); \
            if (buf == NULL) {                                                                           \
                _Pragma("omp atomic write")                                                           \
                failed = 1;                                                                              \
                continue;                                                                                \
            }                                                                                            \
        }                                                                                                \
        const int64_t s = item / num_kv_heads;                                                           \
        const int32_t kv_head = (int32_t)(item % num_kv_heads);                                          \
        const int64_t kv_offset = (int64_t)kv_head * head_dim;                                           \
        const int64_t ctx = context_len[s], rows = query_len[s];                                         \
        const int64_t *table = block_tables + s * block_table_stride;                                    \
        const int64_t padded = (ctx + 15) & ~(int64_t)15;                                                \
        float *scores = buf, *q = buf + (size_t)group * padded, *acc = q + (size_t)group * head_dim;    \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            const int64_t row = query_start[s] + r, limit = ctx - rows + r + 1;                         \
            const T *query_row = query + row * query_row_stride + (int64_t)(kv_head * group) * head_dim; \
            if (!bf16_dot)                                                                               \
                for (int32_t i = 0; i < group * head_dim; i++) q[i] = LOAD(query_row + i) * scale;       \
            NAME##_scores(q, query_row, scale, key_cache, limit, group, head_dim, ITEM_ARGS, scores, padded); \
            float inv[group];                                                                            \
            for (int32_t g = 0; g < group; g++) {                                                        \
                float *sg = scores + g * padded, best = -FLT_MAX, total = 0.0f;                          \
                _Pragma("omp simd reduction(max : best)")                                              \
                for (int64_t pos = 0; pos < limit; pos++) best = sg[pos] > best ? sg[pos] : best;       \
                _Pragma("omp simd reduction(+ : total)")                                               \
                for (int64_t pos = 0; pos < limit; pos++) {                                              \
                    sg[pos] = exp_nonpositive(sg[pos] - best);                                           \
                    total += sg[pos];                                                                    \
                }                                                                                        \
                inv[g] = 1.0f / total;                                                                   \
            }                                                                                            \
            /* Unnormalized weights summed, then scaled once: one multiply per output, not per key. */ \
            if (!WEIGHTED_VALUES(T)(scores, padded, value_cache, limit, group, head_dim, ITEM_ARGS, acc)) { \
                memset(acc, 0, sizeof(float) * (size_t)group * head_dim);                                \
                PREFETCH_FIRST(value_cache, limit, head_dim * (int64_t)sizeof(T))                      \
                for (int64_t pos = 0; pos < limit; pos++) {                                              \
                    if ((pos & 15) == 0) PREFETCH_ROWS(value_cache, pos + PREFETCH_AHEAD, limit, head_dim * (int64_t)sizeof(T)) \
                    const T *v = ROW_AT(value_cache, pos);                                               \
                    for (int32_t g = 0; g < group; g++) {                                                \
                        const float p = scores[g * padded + pos];                                        \
                        float *ag = acc + g * head_dim;                                                  \
                        _Pragma("omp simd")                                                            \
                        for (int32_t d = 0; d < head_dim; d++) ag[d] += p * LOAD(v + d);                 \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (int32_t g = 0; g < group; g++) {                                                        \
                T *dst = out + row * out_row_stride + (int64_t)(kv_head * group + g) * head_dim;        \
                for (int32_t d = 0; d < head_dim; d++) STORE(dst + d, acc[g * head_dim + d] * inv[g]);  \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    free(buf);                                                                                           \
    }                                                                                                    \
    return failed ? -1 : 0;                                                                              \
}

#if HAVE_WIDE_PATH
/* 16 positions at a time: each dot product left as a vector of 16 partial sums, then the 16 of
 * them reduced together. Positions past `limit` get a zero vector and are never read. */
#define WIDE_SCORES(T, LOAD16)                                                                         \
    const int32_t chunks = head_dim / 16;                                                               \
    PREFETCH_FIRST(key_cache, limit, head_dim * (int64_t)sizeof(T))                                   \
    for (int64_t start = 0; start < limit; start += 16) {                                               \
        PREFETCH_ROWS(key_cache, start + PREFETCH_AHEAD, limit, head_dim * (int64_t)sizeof(T))                      \
        const int64_t n = limit - start < 16 ? limit - start : 16;                                      \
        const T *rows_k[16];                                                                            \
        for (int64_t t = 0; t < n; t++) rows_k[t] = ROW_AT(key_cache, start + t);                       \
        for (int32_t g = 0; g < group; g++) {                                                           \
            const float *qg = q + g * head_dim;                                                         \
            __m512 partial[16];                                                                         \
            for (int64_t t = 0; t < 16; t++) {                                                          \
                __m512 sum = _mm512_setzero_ps();                                                       \
                if (t < n)                                                                              \
                    for (int32_t c = 0; c < chunks; c++)                                                \
                        sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), LOAD16(rows_k[t] + 16 * c), sum); \
                partial[t] = sum;                                                                       \
            }                                                                                           \
            _mm512_storeu_ps(scores + g * ctx + start, sum_lanes_of_16(partial));                       \
        }                                                                                               \
    }
#else
#define WIDE_SCORES(T, LOAD16)
#endif

#if HAVE_BF16_DOT
#define SCORES_BF16_DOT(query_row, scale, key_cache, limit, group, head_dim, scores, ctx) \
    scores_bf16_dot((const uint16_t *)(query_row), scale, (const uint16_t *)(key_cache), limit, group, head_dim, \
                    ITEM_ARGS, scores, ctx);
#else
#define SCORES_BF16_DOT(query_row, scale, key_cache, limit, group, head_dim, scores, ctx)
#endif

DEFINE_PAGED_ATTENTION(paged_attention_f32, f32, LOAD_F32, STORE_F32, load16_f32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, bf16, LOAD_BF16, STORE_BF16, load16_bf16)
