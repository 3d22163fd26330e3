/* Attention of packed spans over the KV pool, each row's arithmetic fixed by the code.
 *
 * A row (one query head of one token at position p) attends to its lane's keys lo..p in that order,
 * lo = 0, or p - window + 1 in a sliding-window layer (the `window` latest keys, its own included):
 *   scores  s_j = dot(q, k_j) * scale      dot: 16 partial sums by d mod 16, then a fixed tree
 *   weights w_j = exp(s_j - m)             m = max(max_j s_j, sink); exp: the polynomial below
 *   total       = sum_j w_j (+ exp(sink - m))  16 partial sums by (j - lo) mod 16, then the tree,
 *                                              then the head's sink term where it has one
 *   out         = (sum_j w_j v_j) / total   added in key order, j = lo first
 * A sink (gpt-oss) is a per-head learned logit in the softmax's denominator that attends to no value.
 * An image's rows see each other (Gemma 3): a row inside an image span [first, end) of its lane reads
 * keys lo .. end - 1, the image's later keys too (the window's lower edge stays where it was, as
 * transformers' sliding mask is AND(window, OR(causal, image))); spans name no image: no row changes.
 * Keys before lo are never read: a window's blocks wholly behind every row of a span cost nothing.
 * Every step is written elementwise with explicit fmaf, and the build turns off contraction
 * (-ffp-contract=off), so a vector lane and the scalar tail round alike. Nothing depends on the
 * other rows of the pass, how the pass is cut into spans, or which rows share a block: a row has the
 * same bits alone, in a decode round, in a Verify, in a chunk or in a whole prefill.
 *
 * A span's keys live in KV blocks of block_size consecutive pool slots, named by its block table in
 * position order; runs_of() merges the blocks that happen to lie side by side into runs, and every
 * loop reads a run's keys as one contiguous stretch, keys still in order 0..p. A key's score and its
 * place in each sum are those of the contiguous layout, so the table changes no bit.
 *
 * Rows are blocked for speed only: BLOCK_TOKENS consecutive tokens of a span under one KV head, with
 * their `group` query heads, make a row block, whose rows the vector paths' values step sums
 * together, sharing each value as it is loaded.
 *
 * With AVX-512 (or AVX2) a row's scores are taken 16 (8) keys at a time, their trees reduced together
 * by shuffles that pair the very partial sums dot() pairs; exp runs on 16 (8) lanes, operation for
 * operation; the weighted values are summed in registers, 4 (3) rows at a time. These are the same
 * IEEE operations on the same operands as the plain loops', so the three paths give the same bits
 * (tp_attention_path picks one; the tests compare them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define X86 1
#define A512 __attribute__((target("avx512f")))
#define A256 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#else
#define X86 0
#endif

#define W 16 /* partial sums; head_dim must be a multiple of W */
#define BLOCK_TOKENS 4
#define MAX_ROWS (BLOCK_TOKENS * 64) /* a row block: 4 tokens, at most 64 query heads a KV head */
#define MAX_HEAD_DIM 512             /* native_attention.py's MAX_HEAD_DIM: a key row on the stack */

enum { PATH_PLAIN = 0, PATH_AVX2 = 1, PATH_AVX512 = 2 };

/* Keys first .. first + count - 1 of a span, in pool slots slot .. slot + count - 1. A span's runs are
 * in key order and end in a sentinel (first: the span's key count, count: past any key). */
typedef struct {
    int64_t first, count, slot;
} kv_run;

#define SENTINEL_COUNT (INT64_MAX / 4)

/* The runs of a span's num_keys keys, merging consecutive blocks; returns how many (sentinel not
 * counted). runs holds at least ceil(num_keys / block_size) + 1. */
static int64_t runs_of(const int64_t *blocks, int64_t block_size, int64_t num_keys, kv_run *runs) {
    int64_t num_runs = 0;
    for (int64_t key = 0; key < num_keys; key += block_size) {
        int64_t slot = blocks[key / block_size] * block_size;
        int64_t count = num_keys - key < block_size ? num_keys - key : block_size;
        if (num_runs && runs[num_runs - 1].slot + runs[num_runs - 1].count == slot)
            runs[num_runs - 1].count += count;
        else runs[num_runs++] = (kv_run){key, count, slot};
    }
    runs[num_runs] = (kv_run){num_keys, SENTINEL_COUNT, 0};
    return num_runs;
}

/* The run holding key j (j at most the span's key count: then the sentinel). */
static inline const kv_run *run_of(const kv_run *runs, int64_t j) {
    while (runs->first + runs->count <= j) runs++;
    return runs;
}

/* Keys j = from .. to - 1 in order, `at` the element index of key j's row in its head (+ offset):
 * a pointer step per key inside a run, a lookup per run. */
#define FOR_KEYS(runs, from, to, j, at, offset)                                                          \
    for (const kv_run *run_ = run_of(runs, from); run_->first < (to); run_++)                             \
        for (int64_t j = (from) > run_->first ? (from) : run_->first,                                    \
                     stop_ = (to) < run_->first + run_->count ? (to) : run_->first + run_->count,        \
                     at = (run_->slot + j - run_->first) * head_dim + (offset);                           \
             j < stop_; j++, at += head_dim)

/* exp(x) for x <= 0 (a score less its row's maximum), about 2 ulp: Cody-Waite reduction by ln 2
 * and a degree-6 polynomial (Cephes' expf), then 2^n put in the exponent bits. */
static inline float exp_one(float x) {
    float v = x < -87.0f ? -87.0f : x;
    float k = floorf(fmaf(v, 1.44269504088896341f, 0.5f));
    float r = fmaf(k, -0.693359375f, v);
    r = fmaf(k, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

/* The tree dot() and softmax() close their 16 partial sums with: i + 8, i + 4, i + 2, i + 1. */
static inline float tree_of(float *part) {
    for (int s = W / 2; s > 0; s /= 2)
        for (int i = 0; i < s; i++) part[i] += part[i + s];
    return part[0];
}

static inline float dot(const float *restrict a, const float *restrict b, int dim) {
    float acc[W];
    for (int i = 0; i < W; i++) acc[i] = a[i] * b[i];
    for (int d = W; d < dim; d += W)
        for (int i = 0; i < W; i++) acc[i] = fmaf(a[d + i], b[d + i], acc[i]);
    return tree_of(acc);
}

/* The rest of a row's softmax from key j on, the partial sums so far in part (j a multiple of W); the
 * sink's term (where sink is not -inf) added after the tree. */
static float softmax_tail(float *restrict row, int j, int n, float m, float *part, float sink) {
    for (; j < n; j++) {
        row[j] = exp_one(row[j] - m);
        part[j % W] += row[j];
    }
    float total = tree_of(part);
    return sink == -INFINITY ? total : total + exp_one(sink - m);
}

/* One past the last key a row at position p sees: p + 1, or the end of the image span holding p
 * (images: num_images (first, end) position pairs of the row's lane). */
static inline int64_t keys_end(int64_t p, const int64_t *images, int64_t num_images) {
    for (int64_t i = 0; i < num_images; i++)
        if (images[2 * i] <= p && p < images[2 * i + 1]) return images[2 * i + 1];
    return p + 1;
}

/* Each path's three steps for a row block. scores: out[j] = dot(row, key j) * scale for lo <= j < n.
 * softmax: a row's n scores (from its first key) become w_j = exp(s_j - m), m the maximum of them
 * and the sink (-inf: none); returns their total, 16 partial sums by j mod 16 closed by the tree,
 * then the sink's term (the maximum is exact whichever order finds it, and a zero's sign there
 * cannot change a w_j). values: out[r] = (sum_j w[r][j] v_j, keys lo[r] .. n[r] - 1 in order, from
 * zero) / total[r], for rows whose lo[] and n[] rise, lo[last] <= n[0] (the rows share keys
 * lo[last] .. n[0] - 1), key j's value found through runs from
 * v_head (the head's slot 0), as scores finds key j from `keys`: each path loops over the runs itself,
 * so that a run of a block's keys costs a pointer, not a call. */
typedef struct {
    void (*widen)(const _Float16 *from, int64_t n, float *to); /* float16 keys or values to float32 */
    /* keys and v_head are float16 where half (a path with value_chunk reads them so itself, for
     * head_dim a multiple of value_chunk; else they are widened to float32 first) */
    void (*scores)(const float *row, const kv_run *runs, const void *keys, int half, int lo, int n, int head_dim,
                   float scale, float *out);
    float (*softmax)(float *row, int n, float sink);
    void (*values)(int num_rows, const float *const *w, const int *lo, const int *n, const float *total,
                   const kv_run *runs,
                   const void *v_head, int half, int head_dim, float *const *out);
    int value_chunk; /* floats of a value row values() takes at once; 0: float32 only */
} path_steps;

static void widen_plain(const _Float16 *from, int64_t n, float *to) {
    for (int64_t i = 0; i < n; i++) to[i] = (float)from[i];
}

/* Key j's dot with row, times scale; a float16 key widened first (exactly). */
static inline float score(const float *row, const void *keys, int half, int64_t j, int head_dim, float scale) {
    if (!half) return dot(row, (const float *)keys + j * head_dim, head_dim) * scale;
    float key[MAX_HEAD_DIM];
    widen_plain((const _Float16 *)keys + j * head_dim, head_dim, key);
    return dot(row, key, head_dim) * scale;
}

/* The part of a run that keys lo .. n - 1 cover: its keys first + j0 .. first + j1 - 1. */
#define RUN_PART(run, lo, n, j0, j1)                                                                    \
    int64_t j0 = (lo) > (run)->first ? (lo) - (run)->first : 0;                                          \
    int64_t j1 = (n) - (run)->first < (run)->count ? (n) - (run)->first : (run)->count

static void scores_plain(const float *row, const kv_run *runs, const void *keys, int half, int lo, int n,
                         int head_dim, float scale, float *out) {
    for (const kv_run *run = run_of(runs, lo); run->first < n; run++) {
        RUN_PART(run, lo, n, j0, j1);
        for (int64_t j = j0; j < j1; j++) out[run->first + j] = score(row, keys, half, run->slot + j, head_dim, scale);
    }
}

static float softmax_plain(float *row, int n, float sink) {
    float m = row[0], part[W] = {0};
    for (int t = 1; t < n; t++) m = row[t] > m ? row[t] : m;
    m = sink > m ? sink : m;
    return softmax_tail(row, 0, n, m, part, sink);
}

static void values_plain(int num_rows, const float *const *w, const int *lo, const int *n, const float *total,
                         const kv_run *runs, const void *values, int half, int head_dim, float *const *out) {
    const float *v_head = values; /* half is 0 here: value_chunk 0 */
    (void)half;
    for (int r = 0; r < num_rows; r++) {
        float *o = out[r];
        memset(o, 0, sizeof(float) * head_dim);
        FOR_KEYS(runs, lo[r], n[r], j, at, 0) {
            const float *v = v_head + at;
            for (int d = 0; d < head_dim; d++) o[d] = fmaf(w[r][j], v[d], o[d]);
        }
        for (int d = 0; d < head_dim; d++) o[d] /= total[r];
    }
}

/* How many of the first `most` rows (lo[] and n[] rising) a values step takes together: rows whose
 * windows all reach the first row's last key (lo[last] <= n[0]), so that they share keys. */
static inline int rows_sharing(const int *lo, const int *n, int most) {
    while (most > 1 && lo[most - 1] > n[0]) most--;
    return most;
}

#if X86
/* ---- AVX-512: 16 lanes ---- */

/* exp_one on 16 lanes (max(-87, x) keeps a NaN as x < -87 ? -87 : x does). */
A512 INLINE __m512 exp16(__m512 x) {
    __m512 v = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693359375f), v);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* 16 floats of a pool from element `at`: float32, or float16 widened exactly. */
A512 INLINE __m512 load16(const void *pool, int64_t at, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const _Float16 *)pool + at)))
                : _mm512_loadu_ps((const float *)pool + at);
}

/* dot()'s first tree step for two keys at once: lanes 0..7 hold a's acc[i] + acc[i + 8], 8..15 b's. */
A512 INLINE __m512 pair_halves(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Scores of 16 keys from `keys` on, each key's tree as dot() adds it. */
A512 INLINE void scores_by_16(const float *restrict row, const void *keys, int64_t at, const int half,
                              int head_dim, float scale, float *restrict out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_mul_ps(_mm512_loadu_ps(row), load16(keys, at + j * head_dim, half));
    for (int d = W; d < head_dim; d += W) {
        __m512 a = _mm512_loadu_ps(row + d);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(a, load16(keys, at + j * head_dim + d, half), acc[j]);
    }
    /* i + 8: key pairs (2c, 2c + 1), 8 partials each */
    __m512 b[8];
    for (int c = 0; c < 8; c++) b[c] = pair_halves(acc[2 * c], acc[2 * c + 1]);
    /* i + 4: 128-bit chunk k of c4[q] is key 4q + k's 4 partials */
    __m512 c4[4];
    for (int q = 0; q < 4; q++)
        c4[q] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* i + 2: chunk k of e[h] holds keys 8h + k and 8h + k + 4, 2 partials each */
    __m512 e[2];
    for (int h = 0; h < 2; h++)
        e[h] = _mm512_add_ps(_mm512_shuffle_ps(c4[2 * h], c4[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c4[2 * h], c4[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* i + 1: lane 4k + m is key k + 4m's sum */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(key_order, sums), _mm512_set1_ps(scale)));
}

A512 static void widen_512(const _Float16 *from, int64_t n, float *to) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(to + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(from + i))));
    widen_plain(from + i, n - i, to + i);
}

A512 static void scores_512(const float *row, const kv_run *runs, const void *keys, int half, int lo, int n,
                            int head_dim, float scale, float *out) {
    for (const kv_run *run = run_of(runs, lo); run->first < n; run++) {
        RUN_PART(run, lo, n, j, count);
        float *o = out + run->first;
        for (; j + 16 <= count; j += 16) {
            int64_t at = (run->slot + j) * head_dim;
            if (half) scores_by_16(row, keys, at, 1, head_dim, scale, o + j);
            else scores_by_16(row, keys, at, 0, head_dim, scale, o + j);
        }
        for (; j < count; j++) o[j] = score(row, keys, half, run->slot + j, head_dim, scale);
    }
}

A512 static float softmax_512(float *row, int n, float sink) {
    float m = row[0], part[W];
    int j = 0;
    __m512 top = _mm512_set1_ps(row[0]);
    for (; j + W <= n; j += W) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
    m = _mm512_reduce_max_ps(top);
    for (; j < n; j++) m = row[j] > m ? row[j] : m;
    m = sink > m ? sink : m;
    __m512 sums = _mm512_setzero_ps();
    for (j = 0; j + W <= n; j += W) {
        __m512 w = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(m)));
        _mm512_storeu_ps(row + j, w);
        sums = _mm512_add_ps(sums, w);
    }
    _mm512_storeu_ps(part, sums);
    return softmax_tail(row, j, n, m, part, sink);
}

/* values for R rows (a constant at each call, so that acc stays in registers), 64 floats from d0. */
A512 INLINE void values_by_64(const int R, const float *const *w, const int *lo, const int *n, const float *total,
                              const kv_run *runs, const void *v_head, const int half, int head_dim, int d0,
                              float *const *out) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int r = 0; r < R - 1; r++) /* the earlier tokens' own keys, before the window of the last */
        FOR_KEYS(runs, lo[r], lo[R - 1], jr, v, d0) {
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][jr]), load16(v_head, v + 16 * c, half), acc[r][c]);
        }
    const kv_run *tail = R > 1 ? run_of(runs, n[0]) : runs; /* where the later rows' own keys begin */
    FOR_KEYS(runs, lo[R - 1], n[0], j, v, d0) { /* keys every row sees */
        for (int c = 0; c < 4; c++) {
            __m512 vc = load16(v_head, v + 16 * c, half);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][j]), vc, acc[r][c]);
        }
    }
    for (int r = 1; r < R; r++) /* the later tokens' own keys */
        FOR_KEYS(tail, n[0], n[r], jr, v, d0) {
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][jr]), load16(v_head, v + 16 * c, half), acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(out[r] + d0 + 16 * c, _mm512_div_ps(acc[r][c], _mm512_set1_ps(total[r])));
}

/* R and half constants at each call, so that acc stays in registers and the loads are one kind. */
#define VALUES_512(R, HALF) \
    values_by_64(R, w + r0, lo + r0, n + r0, total + r0, runs, v_head, HALF, head_dim, d0, out + r0)

A512 static void values_512(int num_rows, const float *const *w, const int *lo, const int *n, const float *total,
                            const kv_run *runs, const void *v_head, int half, int head_dim, float *const *out) {
    if (head_dim % 64) { /* half is 0 here (value_chunk) */
        values_plain(num_rows, w, lo, n, total, runs, v_head, 0, head_dim, out);
        return;
    }
    for (int r0 = 0, R; r0 < num_rows; r0 += R) {
        R = rows_sharing(lo + r0, n + r0, num_rows - r0 < 4 ? num_rows - r0 : 4);
        for (int d0 = 0; d0 < head_dim; d0 += 64) {
            if (half) {
                if (R == 4) VALUES_512(4, 1);
                else if (R == 3) VALUES_512(3, 1);
                else if (R == 2) VALUES_512(2, 1);
                else VALUES_512(1, 1);
            } else {
                if (R == 4) VALUES_512(4, 0);
                else if (R == 3) VALUES_512(3, 0);
                else if (R == 2) VALUES_512(2, 0);
                else VALUES_512(1, 0);
            }
        }
    }
}

/* ---- AVX2: 8 lanes, a key's 16 partial sums in two vectors ---- */

A256 INLINE __m256 exp8(__m256 x) {
    __m256 v = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    __m256 k = _mm256_round_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(k, _mm256_set1_ps(-0.693359375f), v);
    r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* 8 floats of a pool from element `at`: float32, or float16 widened exactly. */
A256 INLINE __m256 load8(const void *pool, int64_t at, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const _Float16 *)pool + at)))
                : _mm256_loadu_ps((const float *)pool + at);
}

/* Four keys' trees to their last step: 128-bit half 0 holds keys 0 and 2, half 1 keys 1 and 3, each
 * as its two partials acc'[0] and acc'[1] before dot()'s final acc[0] + acc[1]. */
A256 INLINE __m256 four_keys(const float *restrict row, const void *keys, int64_t at, const int half,
                              int head_dim) {
    __m256 lo[4], hi[4]; /* acc[0..7] and acc[8..15] */
    for (int k = 0; k < 4; k++) {
        lo[k] = _mm256_mul_ps(_mm256_loadu_ps(row), load8(keys, at + k * head_dim, half));
        hi[k] = _mm256_mul_ps(_mm256_loadu_ps(row + 8), load8(keys, at + k * head_dim + 8, half));
    }
    for (int d = W; d < head_dim; d += W) {
        __m256 a0 = _mm256_loadu_ps(row + d), a1 = _mm256_loadu_ps(row + d + 8);
        for (int k = 0; k < 4; k++) {
            lo[k] = _mm256_fmadd_ps(a0, load8(keys, at + k * head_dim + d, half), lo[k]);
            hi[k] = _mm256_fmadd_ps(a1, load8(keys, at + k * head_dim + d + 8, half), hi[k]);
        }
    }
    __m256 s[4]; /* i + 8 */
    for (int k = 0; k < 4; k++) s[k] = _mm256_add_ps(lo[k], hi[k]);
    /* i + 4: half 0 key 2p's 4 partials, half 1 key 2p + 1's */
    __m256 t[2];
    for (int p = 0; p < 2; p++)
        t[p] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * p], s[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * p], s[2 * p + 1], 0x31));
    /* i + 2 */
    return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

A256 static void widen_256(const _Float16 *from, int64_t n, float *to) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(from + i))));
    widen_plain(from + i, n - i, to + i);
}

/* Keys j .. j + 7's scores (half a constant at each call). */
A256 INLINE void scores_by_8(const float *row, const void *keys, int64_t at, const int half, int head_dim,
                             float scale, float *out) {
    /* i + 1: 128-bit half 0 holds keys 0, 2, 4, 6, half 1 keys 1, 3, 5, 7 */
    __m256 sums = _mm256_hadd_ps(four_keys(row, keys, at, half, head_dim),
                                 four_keys(row, keys, at + 4 * head_dim, half, head_dim));
    sums = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

A256 static void scores_256(const float *row, const kv_run *runs, const void *keys, int half, int lo, int n,
                            int head_dim, float scale, float *out) {
    for (const kv_run *run = run_of(runs, lo); run->first < n; run++) {
        RUN_PART(run, lo, n, j, count);
        float *o = out + run->first;
        for (; j + 8 <= count; j += 8) {
            int64_t at = (run->slot + j) * head_dim;
            if (half) scores_by_8(row, keys, at, 1, head_dim, scale, o + j);
            else scores_by_8(row, keys, at, 0, head_dim, scale, o + j);
        }
        for (; j < count; j++) o[j] = score(row, keys, half, run->slot + j, head_dim, scale);
    }
}

A256 static float softmax_256(float *row, int n, float sink) {
    float m = row[0], part[W], lanes[8];
    int j = 0;
    __m256 top = _mm256_set1_ps(row[0]);
    for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; j < n; j++) m = row[j] > m ? row[j] : m;
    m = sink > m ? sink : m;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (j = 0; j + W <= n; j += W) {
        __m256 w0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(m)));
        __m256 w1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8), _mm256_set1_ps(m)));
        _mm256_storeu_ps(row + j, w0);
        _mm256_storeu_ps(row + j + 8, w1);
        lo = _mm256_add_ps(lo, w0);
        hi = _mm256_add_ps(hi, w1);
    }
    _mm256_storeu_ps(part, lo);
    _mm256_storeu_ps(part + 8, hi);
    return softmax_tail(row, j, n, m, part, sink);
}

/* values for R rows (a constant at each call), 32 floats from d0. */
A256 INLINE void values_by_32(const int R, const float *const *w, const int *lo, const int *n, const float *total,
                              const kv_run *runs, const void *v_head, const int half, int head_dim, int d0,
                              float *const *out) {
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int r = 0; r < R - 1; r++)
        FOR_KEYS(runs, lo[r], lo[R - 1], jr, v, d0) {
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][jr]), load8(v_head, v + 8 * c, half), acc[r][c]);
        }
    const kv_run *tail = R > 1 ? run_of(runs, n[0]) : runs;
    FOR_KEYS(runs, lo[R - 1], n[0], j, v, d0) {
        for (int c = 0; c < 4; c++) {
            __m256 vc = load8(v_head, v + 8 * c, half);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][j]), vc, acc[r][c]);
        }
    }
    for (int r = 1; r < R; r++)
        FOR_KEYS(tail, n[0], n[r], jr, v, d0) {
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[r][jr]), load8(v_head, v + 8 * c, half), acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(out[r] + d0 + 8 * c, _mm256_div_ps(acc[r][c], _mm256_set1_ps(total[r])));
}

#define VALUES_256(R, HALF) \
    values_by_32(R, w + r0, lo + r0, n + r0, total + r0, runs, v_head, HALF, head_dim, d0, out + r0)

A256 static void values_256(int num_rows, const float *const *w, const int *lo, const int *n, const float *total,
                            const kv_run *runs, const void *v_head, int half, int head_dim, float *const *out) {
    if (head_dim % 32) { /* half is 0 here (value_chunk) */
        values_plain(num_rows, w, lo, n, total, runs, v_head, 0, head_dim, out);
        return;
    }
    for (int r0 = 0, R; r0 < num_rows; r0 += R) {
        R = rows_sharing(lo + r0, n + r0, num_rows - r0 < 3 ? num_rows - r0 : 3);
        for (int d0 = 0; d0 < head_dim; d0 += 32) {
            if (half) {
                if (R == 3) VALUES_256(3, 1);
                else if (R == 2) VALUES_256(2, 1);
                else VALUES_256(1, 1);
            } else {
                if (R == 3) VALUES_256(3, 0);
                else if (R == 2) VALUES_256(2, 0);
                else VALUES_256(1, 0);
            }
        }
    }
}
#endif

static const path_steps PATHS[] = {
    {widen_plain, scores_plain, softmax_plain, values_plain, 0},
#if X86
    {widen_256, scores_256, softmax_256, values_256, 32},
    {widen_512, scores_512, softmax_512, values_512, 64},
#endif
};

/* Bit p set: path p runs on this CPU. */
int tp_attention_paths(void) {
    int paths = 1 << PATH_PLAIN;
#if X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        paths |= 1 << PATH_AVX2;
    if (__builtin_cpu_supports("avx512f")) paths |= 1 << PATH_AVX512;
#endif
    return paths;
}

static int chosen_path = -1;

/* Run `path` from now on (-1: the fastest here); returns it, or -1 where it does not run here. */
int tp_attention_path(int path) {
    int paths = tp_attention_paths();
    if (path < 0) path = paths & (1 << PATH_AVX512) ? PATH_AVX512 : paths & (1 << PATH_AVX2) ? PATH_AVX2 : PATH_PLAIN;
    if (path > PATH_AVX512 || !(paths & (1 << path))) return -1;
    return chosen_path = path;
}

/* spans: num_spans x (offset, table, start, length): rows offset.. of q, where the span's block table
 * begins in blocks, the first token's position, its number of tokens. blocks: the block tables, a
 * span's keys 0 .. start + length - 1 in blocks[table + p / block_size] at slot p % block_size of it
 * (pool slots b * block_size ..).
 * q: [T, num_kv_heads * group, head_dim], row stride q_stride floats per token;
 * keys, values: [num_kv_heads, slots, head_dim] (head stride head_stride elements), float32, or
 * float16 where kv_half (read so by a vector path, else each span widened once, exactly, to float32);
 * window: a row at position p sees keys p - window + 1 .. p (0: keys 0 .. p); sinks: NULL, or a logit
 * per query head [num_kv_heads * group] in every row's softmax denominator;
 * image_index: NULL, or [num_spans + 1]: span s's image spans are image_ranges[2 * image_index[s] ..
 * 2 * image_index[s + 1] - 1], (first, end) position pairs within the span's positions, whose rows
 * see each other's keys (keys_end);
 * out: [T, num_kv_heads * group, head_dim] contiguous (it may be q itself: a row block reads its
 * rows of q before it writes its rows of out). Returns 0, or -1 if out of memory. */
int tp_span_attention(const float *q, int64_t q_stride, const void *keys, const void *values,
                      int64_t head_stride, int kv_half, int num_kv_heads, int group, int head_dim,
                      const int64_t *spans, int num_spans, const int64_t *blocks, int64_t block_size,
                      int64_t window, const float *sinks, const int64_t *image_index,
                      const int64_t *image_ranges, float scale, float *out) {
    if (chosen_path < 0) tp_attention_path(-1);
    const path_steps *steps = &PATHS[chosen_path];
    int64_t max_keys = 1;
    for (int s = 0; s < num_spans; s++) {
        int64_t end = spans[4 * s + 2] + spans[4 * s + 3];
        if (end > max_keys) max_keys = end;
    }
    float *scores = malloc(sizeof(float) * BLOCK_TOKENS * group * max_keys);
    kv_run *runs = malloc(sizeof(kv_run) * ((max_keys + block_size - 1) / block_size + 1));
    /* a path that reads float16 itself does; any other gets each span widened to float32 first,
     * its keys in order 0.. (one run) */
    int widen = kv_half && !(steps->value_chunk && head_dim % steps->value_chunk == 0);
    int half = kv_half && !widen;
    float *wide = widen ? malloc(sizeof(float) * 2 * max_keys * head_dim) : NULL;
    if (!scores || !runs || (widen && !wide)) {
        free(scores);
        free(runs);
        free(wide);
        return -1;
    }
    int num_heads = num_kv_heads * group;
    size_t element = kv_half ? sizeof(_Float16) : sizeof(float);
    for (int s = 0; s < num_spans; s++) {
        int64_t offset = spans[4 * s], table = spans[4 * s + 1], start = spans[4 * s + 2];
        int64_t length = spans[4 * s + 3];
        const int64_t *images = image_index ? image_ranges + 2 * image_index[s] : NULL;
        int64_t num_images = image_index ? image_index[s + 1] - image_index[s] : 0;
        runs_of(blocks + table, block_size, start + length, runs);
        kv_run whole[2] = {{0, start + length, 0}, {start + length, SENTINEL_COUNT, 0}};
        int64_t seen = window && start + 1 > window ? start + 1 - window : 0; /* the span's first key */
        const kv_run *key_runs = widen ? whole : runs;
        for (int h = 0; h < num_kv_heads; h++) {
            int64_t at = h * head_stride;
            const void *k_head = (const char *)keys + at * element, *v_head = (const char *)values + at * element;
            if (widen) {
                for (const kv_run *run = run_of(runs, seen); run->first < start + length; run++) {
                    int64_t from = at + run->slot * head_dim, num = run->count * head_dim;
                    steps->widen((const _Float16 *)keys + from, num, wide + run->first * head_dim);
                    steps->widen((const _Float16 *)values + from, num, wide + (max_keys + run->first) * head_dim);
                }
                k_head = wide;
                v_head = wide + max_keys * head_dim;
            }
            for (int64_t t0 = 0; t0 < length; t0 += BLOCK_TOKENS) {
                int num_tokens = length - t0 < BLOCK_TOKENS ? (int)(length - t0) : BLOCK_TOKENS;
                int num_rows = num_tokens * group;
                int64_t first = start + t0; /* position of the block's first token */
                /* row r: token t = r / group at position first + t, query head h * group + r % group;
                 * it sees keys lo .. first + t (its image's last key, inside one) */
                const float *w[MAX_ROWS];
                float *o[MAX_ROWS], totals[MAX_ROWS];
                int lo[MAX_ROWS], n[MAX_ROWS];
                for (int r = 0; r < num_rows; r++) {
                    int64_t token = offset + t0 + r / group, head = h * group + r % group;
                    float *row_scores = scores + r * max_keys; /* key j's score at j */
                    int64_t position = first + r / group;
                    lo[r] = window && position + 1 > window ? (int)(position + 1 - window) : 0;
                    n[r] = (int)keys_end(position, images, num_images); /* rising with r: images lie apart */
                    steps->scores(q + token * q_stride + head * head_dim, key_runs, k_head, half, lo[r], n[r],
                                  head_dim, scale, row_scores);
                    float sink = sinks ? sinks[head] : -INFINITY;
                    totals[r] = steps->softmax(row_scores + lo[r], n[r] - lo[r], sink);
                    w[r] = row_scores;
                    o[r] = out + (token * num_heads + head) * head_dim;
                }
                steps->values(num_rows, w, lo, n, totals, key_runs, v_head, half, head_dim, o);
            }
        }
    }
    free(scores);
    free(runs);
    free(wide);
    return 0;
}

/* x * cos + roll(x, D/2) * signed_sin for one head's row (sin's first half negated): rotate-half,
 * as tpserve/kernels/rotary.py computes it (a multiply, a multiply, an add). */
static void rotate(const float *restrict x, const float *restrict cos, const float *restrict sin,
                   int head_dim, float *restrict y) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) y[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int i = half; i < head_dim; i++) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* A row of head_dim floats into the pool at `to`: as they are, or rounded to the nearest float16
 * (ties to even, as torch's copy to float16 rounds). */
static void store_row(const float *restrict row, int head_dim, int kv_half, void *to) {
    if (!kv_half) {
        memcpy(to, row, sizeof(float) * head_dim);
        return;
    }
    _Float16 *half = to;
    for (int i = 0; i < head_dim; i++) half[i] = (_Float16)row[i];
}

/* One layer's attention block after its q/k/v product, in one call: q and k rotated, k and v
 * written to the pool at their slots, then every span's attention (tp_span_attention). The rotated
 * q is kept in `out`, which each row block reads before it writes its own rows there.
 * q, k, v: [T, heads, head_dim] rows of token stride q_stride, k_stride, v_stride (views of the
 * fused product); cos, sin: [T, head_dim]; slots: [num_real] pool slots (tpserve/kernels/attention.py
 * kv_slots: each token's through its span's block table) of the pass's real tokens (rows past them
 * are padding, neither stored nor attended); spans, blocks, window, sinks, images: as tp_span_attention reads
 * them. head_dim
 * is at most MAX_HEAD_DIM. */
int tp_rotate_store_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                           const float *v, int64_t v_stride, const float *cos, const float *sin,
                           const int64_t *slots, int64_t num_real, void *pool_k, void *pool_v,
                           int64_t head_stride, int kv_half, int num_kv_heads, int group, int head_dim,
                           const int64_t *spans, int num_spans, const int64_t *blocks, int64_t block_size,
                           int64_t window, const float *sinks, const int64_t *image_index,
                           const int64_t *image_ranges, float scale, float *out) {
    int num_heads = num_kv_heads * group;
    size_t element = kv_half ? sizeof(_Float16) : sizeof(float);
    float rotated[MAX_HEAD_DIM];
    if (head_dim > MAX_HEAD_DIM) return -1;
    for (int64_t t = 0; t < num_real; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int j = 0; j < num_heads; j++)
            rotate(q + t * q_stride + j * head_dim, c, s, head_dim, out + (t * num_heads + j) * head_dim);
        for (int h = 0; h < num_kv_heads; h++) {
            int64_t at = (h * head_stride + slots[t] * head_dim) * (int64_t)element;
            rotate(k + t * k_stride + h * head_dim, c, s, head_dim, rotated);
            store_row(rotated, head_dim, kv_half, (char *)pool_k + at);
            store_row(v + t * v_stride + h * head_dim, head_dim, kv_half, (char *)pool_v + at);
        }
    }
    return tp_span_attention(out, (int64_t)num_heads * head_dim, pool_k, pool_v, head_stride, kv_half,
                             num_kv_heads, group, head_dim, spans, num_spans, blocks, block_size, window, sinks,
                             image_index, image_ranges, scale, out);
}
