/* Attention of packed spans over the KV pool, each row's arithmetic fixed by the code.
 *
 * A row (one query head of one token at position p) attends to its lane's keys 0..p in that order:
 *   scores  s_j = dot(q, k_j) * scale      dot: 16 partial sums by d mod 16, then a fixed tree
 *   weights w_j = exp(s_j - max_j s_j)     exp: the polynomial below, elementwise
 *   total       = sum_j w_j                 16 partial sums by j mod 16, then the tree
 *   out         = (sum_j w_j v_j) / total   added in key order, j = 0 first
 * Every step is written elementwise with explicit fmaf, and the build turns off contraction
 * (-ffp-contract=off), so a vector lane and the scalar tail round alike. Nothing depends on the
 * other rows of the pass, how the pass is cut into spans, or which rows share a block: a row has the
 * same bits alone, in a decode round, in a Verify, in a chunk or in a whole prefill.
 *
 * Rows are blocked for speed only: BLOCK_TOKENS consecutive tokens of a span under one KV head, with
 * their `group` query heads, share each key and value as it is loaded.
 *
 * With AVX-512 a row's scores are taken 16 keys at a time, their trees reduced together by shuffles
 * that pair the very partial sums dot() pairs, and the weighted values are summed in registers, four
 * rows at a time: the same IEEE operations on the same operands, so the same bits as the plain loops
 * (tp_attention_vectors switches between them; the tests compare the two).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VECTORS 1
#else
#define HAVE_VECTORS 0
#endif

#define W 16             /* partial sums; head_dim must be a multiple of W */
#define BLOCK_TOKENS 4

static int use_vectors = HAVE_VECTORS;

/* Turn the AVX-512 loops on (1) or off (0); returns whether this build has them. */
int tp_attention_vectors(int on) {
    use_vectors = on && HAVE_VECTORS;
    return HAVE_VECTORS;
}

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

#if HAVE_VECTORS
/* exp_one on 16 lanes, operation for operation (max(-87, x) keeps a NaN as x < -87 ? : does). */
static inline __m512 exp16(__m512 x) {
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
#endif

/* A row's n scores become w_j = exp(s_j - max s); returns their total, 16 partial sums by j mod 16
 * closed by the tree. (The maximum is exact whichever order finds it; a zero's sign there cannot
 * change a w_j.) */
static float softmax(float *restrict row, int n) {
    float m = row[0], part[W] = {0};
    int j = 0;
#if HAVE_VECTORS
    if (use_vectors) {
        __m512 top = _mm512_set1_ps(row[0]);
        for (; j + W <= n; j += W) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
        m = _mm512_reduce_max_ps(top);
        for (int t = j; t < n; t++) m = row[t] > m ? row[t] : m;
        __m512 sums = _mm512_setzero_ps();
        for (j = 0; j + W <= n; j += W) {
            __m512 w = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(m)));
            _mm512_storeu_ps(row + j, w);
            sums = _mm512_add_ps(sums, w);
        }
        _mm512_storeu_ps(part, sums);
    } else
#endif
    {
        for (int t = 1; t < n; t++) m = row[t] > m ? row[t] : m;
        for (; j + W <= n; j += W)
            for (int i = 0; i < W; i++) {
                row[j + i] = exp_one(row[j + i] - m);
                part[i] += row[j + i];
            }
    }
    for (; j < n; j++) {
        row[j] = exp_one(row[j] - m);
        part[j % W] += row[j];
    }
    return tree_of(part);
}

#if HAVE_VECTORS
/* dot()'s first tree step for two keys at once: lanes 0..7 hold a's acc[i] + acc[i + 8], 8..15 b's. */
static inline __m512 pair_halves(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Scores of keys k0 .. k0 + 15 for one row: dot(row, k_j) * scale, each key's tree as dot() adds it. */
static void scores_by_16(const float *restrict row, const float *restrict keys, int head_dim, float scale,
                         float *restrict out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(keys + j * head_dim));
    for (int d = W; d < head_dim; d += W) {
        __m512 a = _mm512_loadu_ps(row + d);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(a, _mm512_loadu_ps(keys + j * head_dim + d), acc[j]);
    }
    /* step 1, i + 8: key pairs (2c, 2c + 1), 8 partials each */
    __m512 b[8];
    for (int c = 0; c < 8; c++) b[c] = pair_halves(acc[2 * c], acc[2 * c + 1]);
    /* step 2, i + 4: 128-bit chunk k of c[q] is key 4q + k's 4 partials */
    __m512 c4[4];
    for (int q = 0; q < 4; q++)
        c4[q] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* step 3, i + 2: chunk k of e[h] holds keys 8h + k and 8h + k + 4, 2 partials each */
    __m512 e[2];
    for (int h = 0; h < 2; h++)
        e[h] = _mm512_add_ps(_mm512_shuffle_ps(c4[2 * h], c4[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c4[2 * h], c4[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* step 4, i + 1: lane 4k + m is key k + 4m's sum */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    sums = _mm512_permutexvar_ps(key_order, sums);
    _mm512_storeu_ps(out, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
}

#define V_ROWS 4   /* rows whose weighted values one pass sums */
#define V_CHUNK 64 /* floats of a value each pass takes: 4 vectors */

/* out[r] = sum_j w[r][j] v_j over keys 0 .. n_r - 1 (key order, from zero), divided by total[r], for
 * R (1 to V_ROWS) rows whose key counts n[] rise; 64 floats of the head from d0. */
static inline __attribute__((always_inline)) void weighted_values(
    const int R, const float *const *w, const int *n, const float *total, const float *restrict v_head,
    int head_dim, int d0, float *const *out) {
    __m512 acc[V_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    int j = 0;
    for (; j < n[0]; j++) { /* keys every row sees */
        const float *v = v_head + (int64_t)j * head_dim + d0;
        for (int c = 0; c < 4; c++) {
            __m512 vc = _mm512_loadu_ps(v + 16 * c);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][j]), vc, acc[r][c]);
        }
    }
    for (int r = 1; r < R; r++) /* the later tokens' own keys */
        for (int jr = j; jr < n[r]; jr++) {
            const float *v = v_head + (int64_t)jr * head_dim + d0;
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][jr]), _mm512_loadu_ps(v + 16 * c), acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(out[r] + d0 + 16 * c, _mm512_div_ps(acc[r][c], _mm512_set1_ps(total[r])));
}
#endif

/* spans: num_spans x (offset, base, start, length): rows offset.. of q, the lane's first pool slot,
 * the first token's position, its number of tokens.
 * q: [T, num_kv_heads * group, head_dim], row stride q_stride floats per token;
 * keys, values: [num_kv_heads, slots, head_dim] (head stride head_stride floats);
 * out: [T, num_kv_heads * group, head_dim] contiguous. Returns 0, or -1 if out of memory. */
int tp_span_attention(const float *q, int64_t q_stride, const float *keys, const float *values,
                      int64_t head_stride, int num_kv_heads, int group, int head_dim,
                      const int64_t *spans, int num_spans, float scale, float *out) {
    int64_t max_keys = 1;
    for (int s = 0; s < num_spans; s++) {
        int64_t end = spans[4 * s + 2] + spans[4 * s + 3];
        if (end > max_keys) max_keys = end;
    }
    int max_rows = BLOCK_TOKENS * group;
    float *scores = malloc(sizeof(float) * max_rows * max_keys);
    float *acc = malloc(sizeof(float) * max_rows * head_dim);
    if (!scores || !acc) {
        free(scores);
        free(acc);
        return -1;
    }
    int num_heads = num_kv_heads * group;
    for (int s = 0; s < num_spans; s++) {
        int64_t offset = spans[4 * s], base = spans[4 * s + 1], start = spans[4 * s + 2];
        int64_t length = spans[4 * s + 3];
        for (int h = 0; h < num_kv_heads; h++) {
            const float *k_head = keys + h * head_stride + base * head_dim;
            const float *v_head = values + h * head_stride + base * head_dim;
            for (int64_t t0 = 0; t0 < length; t0 += BLOCK_TOKENS) {
                int num_tokens = length - t0 < BLOCK_TOKENS ? (int)(length - t0) : BLOCK_TOKENS;
                int num_rows = num_tokens * group;
                int64_t first = start + t0;      /* position of the block's first token */
                int64_t num_keys = first + num_tokens; /* keys the block's last token sees */
                /* row r: token t = r / group (position first + t), query head h * group + r % group */
                const float *rows[BLOCK_TOKENS * 64];
                for (int r = 0; r < num_rows; r++)
                    rows[r] = q + (offset + t0 + r / group) * q_stride + (h * group + r % group) * head_dim;
#if HAVE_VECTORS
                if (use_vectors) {
                    for (int r = 0; r < num_rows; r++) {
                        int n = (int)(first + r / group + 1), j = 0;
                        for (; j + 16 <= n; j += 16)
                            scores_by_16(rows[r], k_head + (int64_t)j * head_dim, head_dim, scale,
                                         scores + r * max_keys + j);
                        for (; j < n; j++)
                            scores[r * max_keys + j] = dot(rows[r], k_head + (int64_t)j * head_dim, head_dim) * scale;
                    }
                } else
#endif
                for (int64_t j = 0; j < num_keys; j++) {
                    const float *k = k_head + j * head_dim;
                    /* tokens whose position is below j do not see key j: rows from t_min on do */
                    int t_min = j > first ? (int)(j - first) : 0;
                    for (int r = t_min * group; r < num_rows; r++)
                        scores[r * max_keys + j] = dot(rows[r], k, head_dim) * scale;
                }
                float totals[BLOCK_TOKENS * 64];
                for (int r = 0; r < num_rows; r++)
                    totals[r] = softmax(scores + r * max_keys, (int)(first + r / group + 1));
#if HAVE_VECTORS
                if (use_vectors && head_dim % V_CHUNK == 0) {
                    for (int r0 = 0; r0 < num_rows;) {
                        int R = num_rows - r0 >= V_ROWS ? V_ROWS : num_rows - r0;
                        const float *w[V_ROWS];
                        float *o[V_ROWS];
                        int n[V_ROWS];
                        for (int r = 0; r < R; r++) {
                            int rr = r0 + r;
                            w[r] = scores + rr * max_keys;
                            n[r] = (int)(first + rr / group + 1);
                            o[r] = out + ((offset + t0 + rr / group) * num_heads + h * group + rr % group) * head_dim;
                        }
                        for (int d0 = 0; d0 < head_dim; d0 += V_CHUNK) {
                            /* R a constant in each call, so that acc stays in registers */
                            if (R == 4) weighted_values(4, w, n, totals + r0, v_head, head_dim, d0, o);
                            else if (R == 3) weighted_values(3, w, n, totals + r0, v_head, head_dim, d0, o);
                            else if (R == 2) weighted_values(2, w, n, totals + r0, v_head, head_dim, d0, o);
                            else weighted_values(1, w, n, totals + r0, v_head, head_dim, d0, o);
                        }
                        r0 += R;
                    }
                    continue;
                }
#endif
                memset(acc, 0, sizeof(float) * num_rows * head_dim);
                for (int64_t j = 0; j < num_keys; j++) {
                    const float *v = v_head + j * head_dim;
                    int t_min = j > first ? (int)(j - first) : 0;
                    for (int r = t_min * group; r < num_rows; r++) {
                        float w = scores[r * max_keys + j];
                        float *a = acc + r * head_dim;
                        for (int d = 0; d < head_dim; d++) a[d] = fmaf(w, v[d], a[d]);
                    }
                }
                for (int r = 0; r < num_rows; r++) {
                    float *o = out + ((offset + t0 + r / group) * num_heads + h * group + r % group) * head_dim;
                    const float *a = acc + r * head_dim;
                    for (int d = 0; d < head_dim; d++) o[d] = a[d] / totals[r];
                }
            }
        }
    }
    free(scores);
    free(acc);
    return 0;
}

/* x * cos + roll(x, D/2) * signed_sin for one head's row (sin's first half negated): rotate-half,
 * as kernels/rotary.py computes it (a multiply, a multiply, an add). */
static void rotate(const float *restrict x, const float *restrict cos, const float *restrict sin,
                   int head_dim, float *restrict y) {
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) y[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int i = half; i < head_dim; i++) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* One layer's attention block after its q/k/v product, in one call: q and k rotated, k and v
 * written to the pool at their slots, then every span's attention (tp_span_attention). The rotated
 * q is kept in `out`, which each row block reads before it writes its own rows there.
 * q, k, v: [T, heads, head_dim] rows of token stride q_stride, k_stride, v_stride (views of the
 * fused product); cos, sin: [T, head_dim]; slots: [num_real] (the pass's real tokens; rows past
 * them are padding, neither stored nor attended). */
int tp_rotate_store_attend(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                           const float *v, int64_t v_stride, const float *cos, const float *sin,
                           const int64_t *slots, int64_t num_real, float *pool_k, float *pool_v,
                           int64_t head_stride, int num_kv_heads, int group, int head_dim,
                           const int64_t *spans, int num_spans, float scale, float *out) {
    int num_heads = num_kv_heads * group;
    for (int64_t t = 0; t < num_real; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int j = 0; j < num_heads; j++)
            rotate(q + t * q_stride + j * head_dim, c, s, head_dim, out + (t * num_heads + j) * head_dim);
        for (int h = 0; h < num_kv_heads; h++) {
            int64_t at = h * head_stride + slots[t] * head_dim;
            rotate(k + t * k_stride + h * head_dim, c, s, head_dim, pool_k + at);
            memcpy(pool_v + at, v + t * v_stride + h * head_dim, sizeof(float) * head_dim);
        }
    }
    return tp_span_attention(out, (int64_t)num_heads * head_dim, pool_k, pool_v, head_stride, num_kv_heads,
                             group, head_dim, spans, num_spans, scale, out);
}
