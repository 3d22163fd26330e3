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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16             /* partial sums; head_dim must be a multiple of W */
#define BLOCK_TOKENS 4

static inline float dot(const float *restrict a, const float *restrict b, int dim) {
    float acc[W];
    for (int i = 0; i < W; i++) acc[i] = a[i] * b[i];
    for (int d = W; d < dim; d += W)
        for (int i = 0; i < W; i++) acc[i] = fmaf(a[d + i], b[d + i], acc[i]);
    for (int w = W / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) acc[i] += acc[i + w];
    return acc[0];
}

/* exp(x) for x <= 0 (a score less its row's maximum), about 2 ulp: Cody-Waite reduction by ln 2
 * and a degree-6 polynomial (Cephes' expf), then 2^n put in the exponent bits. */
static void exp_inplace(float *restrict x, int n) {
    for (int j = 0; j < n; j++) {
        float v = x[j] < -87.0f ? -87.0f : x[j];
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
        x[j] = p * two_k;
    }
}

static float total_of(const float *restrict w, int n) {
    float part[W] = {0};
    int j = 0;
    for (; j + W <= n; j += W)
        for (int i = 0; i < W; i++) part[i] += w[j + i];
    for (; j < n; j++) part[j % W] += w[j];
    for (int s = W / 2; s > 0; s /= 2)
        for (int i = 0; i < s; i++) part[i] += part[i + s];
    return part[0];
}

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
                for (int64_t j = 0; j < num_keys; j++) {
                    const float *k = k_head + j * head_dim;
                    /* tokens whose position is below j do not see key j: rows from t_min on do */
                    int t_min = j > first ? (int)(j - first) : 0;
                    for (int r = t_min * group; r < num_rows; r++)
                        scores[r * max_keys + j] = dot(rows[r], k, head_dim) * scale;
                }
                float totals[BLOCK_TOKENS * 64];
                for (int r = 0; r < num_rows; r++) {
                    float *row = scores + r * max_keys;
                    int n = (int)(first + r / group + 1);
                    float m = row[0];
                    for (int j = 1; j < n; j++) m = row[j] > m ? row[j] : m;
                    for (int j = 0; j < n; j++) row[j] -= m;
                    exp_inplace(row, n);
                    totals[r] = total_of(row, n);
                }
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
