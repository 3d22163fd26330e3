/* 8-bit block weights times 8-bit activations (GGUF's Q8_0 x Q8_1), each output's arithmetic fixed by
 * the code; and the weight's rows dequantized, for an embedding that reads the head's own copy.
 *
 * Inputs go in blocks of 32. A weight is w[n, 32b+i] = d[n,b] * q[n,b,i] with q in -128..127; an input
 * row t is quantized per block on its own exactly as for the 4-bit kernel (block_quantize.h): da[t,b]
 * = absmax / 127, qa = rint(x * (1 / da)) in -127..127. Then, for b = 0, 1, 2, ... in that order,
 *     dot = sum_i q[n,b,i] * qa[t,b,i]                        an exact int32 (|dot| <= 520192)
 *     acc = fmaf(d[n,b] * da[t,b], (float)dot, acc)           acc starts at 0
 * and out[t,n] = acc. Integer sums are exact in any order and |dot| < 2^24 converts exactly; every
 * float step is elementwise with explicit fmaf (the build turns off contraction), so the AVX-512 VNNI,
 * AVX2 and scalar paths give the same bits, and a row's bits never depend on the rows beside it.
 *
 * How each path gets the exact dot: vpdpbusd multiplies u8 by s8, so VNNI feeds it q + 128 (q xor
 * 0x80) against qa and takes 128 * sum_i qa[t,b,i] off, per row and block. AVX2's vpmaddubsw would
 * saturate its int16 pairs on u8 x s8 (2 * 255 * 127 > 32767), so it multiplies |q| (u8, at most
 * 128) by qa carrying q's sign (vpsignb, as llama.cpp does): a pair is at most 2 * 128 * 127 = 32512,
 * and vpmaddwd takes each pair to int32 before any sum can overflow.
 *
 * The weight is stored in groups of 16 outputs, block by block, one stream of 544 bytes per (group,
 * block): 8 chunks of 64 bytes of int8 values, then d[16] as float16 (Q8_0's 34 bytes per 32
 * weights). Byte 4o+j of chunk c is output o's input 4c+j, so one chunk is 16 outputs x 4
 * consecutive inputs: one broadcast of 4 activation bytes feeds 16 outputs in one vpdpbusd, with no
 * horizontal sum. AVX2 reads the same layout in halves (bytes 0..31 of a chunk are outputs 0..7).
 */
#include "block_quantize.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GROUP 16                                  /* outputs per group */
#define CHUNKS 8                                  /* 64-byte chunks of values per (group, block) */
#define SCALES_AT (CHUNKS * 64)                   /* byte offset of d[16] */
#define GROUP_BLOCK_BYTES (SCALES_AT + GROUP * 2) /* 544 */
#define ROWS 4                                    /* rows that share each loaded weight */

static inline float epilogue(float acc, float d, int32_t dot, float da) {
    return fmaf(d * da, (float)dot, acc);
}

static void scalar_rows(const uint8_t *w, int nb, const int8_t *qa, const float *da, int num_rows,
                        int N, float *out) {
    int K = nb * BLOCK;
    for (int t = 0; t < num_rows; t++) {
        for (int n = 0; n < N; n++) {
            int g = n / GROUP, o = n % GROUP;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = w + ((int64_t)g * nb + b) * GROUP_BLOCK_BYTES;
                const int8_t *a = qa + (int64_t)t * K + b * BLOCK;
                int32_t dot = 0;
                for (int c = 0; c < CHUNKS; c++)
                    for (int j = 0; j < 4; j++) dot += (int8_t)blk[c * 64 + o * 4 + j] * a[4 * c + j];
                acc = epilogue(acc, load_half(blk + SCALES_AT + 2 * o), dot, da[(int64_t)t * nb + b]);
            }
            out[(int64_t)t * N + n] = acc;
        }
    }
}

#if defined(__x86_64__)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* R rows by NG groups of 16 outputs (n0..): R and NG are constants where it is inlined. `ahead`, where
 * not NULL, is the next groups' weight, fetched into the cache block by block meanwhile. */
VNNI INLINE void vnni_tile(const uint8_t *w, int64_t group_bytes, int nb, const int8_t *qa,
                           const float *da, const int32_t *sa, int R, int NG, float *out, int N, int n0,
                           const uint8_t *ahead) {
    int K = nb * BLOCK;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROWS][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < NG; h++) acc[r][h] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (ahead)
            for (int h = 0; h < NG; h++)
                for (int line = 0; line < GROUP_BLOCK_BYTES; line += 64)
                    _mm_prefetch((const char *)(ahead + h * group_bytes + b * GROUP_BLOCK_BYTES + line),
                                 _MM_HINT_T0);
        __m512i dot[ROWS][2];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < NG; h++) dot[r][h] = _mm512_setzero_si512();
        for (int c = 0; c < CHUNKS; c++) {
            __m512i u[2]; /* q + 128, as u8 */
            for (int h = 0; h < NG; h++)
                u[h] = _mm512_xor_si512(
                    _mm512_loadu_si512(w + h * group_bytes + b * GROUP_BLOCK_BYTES + c * 64), flip);
            for (int r = 0; r < R; r++) {
                __m512i a = _mm512_set1_epi32(load4(qa + (int64_t)r * K + b * BLOCK + 4 * c));
                for (int h = 0; h < NG; h++) dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], u[h], a);
            }
        }
        for (int h = 0; h < NG; h++) {
            const uint8_t *scales = w + h * group_bytes + b * GROUP_BLOCK_BYTES + SCALES_AT;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            for (int r = 0; r < R; r++) {
                __m512i exact = _mm512_sub_epi32(dot[r][h], _mm512_set1_epi32(128 * sa[(int64_t)r * nb + b]));
                __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(da[(int64_t)r * nb + b]));
                acc[r][h] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(exact), acc[r][h]);
            }
        }
    }
    for (int h = 0; h < NG; h++) {
        int n = n0 + h * GROUP, left = N - n;
        __mmask16 keep = left >= GROUP ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (int64_t)r * N + n, keep, acc[r][h]);
    }
}

VNNI static void vnni_rows(const uint8_t *w, int num_groups, int nb, const int8_t *qa, const float *da,
                           const int32_t *sa, int num_rows, int N, float *out) {
    int64_t group_bytes = (int64_t)nb * GROUP_BLOCK_BYTES;
    int K = nb * BLOCK;
    for (int g = 0; g < num_groups; g += 2) {
        const uint8_t *wg = w + g * group_bytes;
        int n0 = g * GROUP, pair = num_groups - g >= 2;
        for (int t = 0; t < num_rows; t += ROWS) {
            const int8_t *a = qa + (int64_t)t * K;
            const float *d = da + (int64_t)t * nb;
            const int32_t *s = sa + (int64_t)t * nb;
            float *o = out + (int64_t)t * N;
            const uint8_t *ahead = t == 0 && g + 2 < num_groups ? wg + 2 * group_bytes : NULL;
            int R = num_rows - t < ROWS ? num_rows - t : ROWS, shape = 2 * R - 1 + pair;
            switch (shape) { /* R and NG as constants, so the tile's arrays stay in registers */
            case 1: vnni_tile(wg, group_bytes, nb, a, d, s, 1, 1, o, N, n0, ahead); break;
            case 2: vnni_tile(wg, group_bytes, nb, a, d, s, 1, 2, o, N, n0, ahead); break;
            case 3: vnni_tile(wg, group_bytes, nb, a, d, s, 2, 1, o, N, n0, ahead); break;
            case 4: vnni_tile(wg, group_bytes, nb, a, d, s, 2, 2, o, N, n0, ahead); break;
            case 5: vnni_tile(wg, group_bytes, nb, a, d, s, 3, 1, o, N, n0, ahead); break;
            case 6: vnni_tile(wg, group_bytes, nb, a, d, s, 3, 2, o, N, n0, ahead); break;
            case 7: vnni_tile(wg, group_bytes, nb, a, d, s, 4, 1, o, N, n0, ahead); break;
            default: vnni_tile(wg, group_bytes, nb, a, d, s, 4, 2, o, N, n0, ahead); break;
            }
        }
    }
}

/* R rows by the 8 outputs n0.. of half `half` of a group (the sign trick: see the top of this file). */
AVX2 INLINE void avx2_tile(const uint8_t *wg, int half, int nb, const int8_t *qa, const float *da, int R,
                           float *out, int N, int n0, const uint8_t *ahead) {
    int K = nb * BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * GROUP_BLOCK_BYTES;
        if (ahead)
            for (int line = 0; line < GROUP_BLOCK_BYTES; line += 64)
                _mm_prefetch((const char *)(ahead + b * GROUP_BLOCK_BYTES + line), _MM_HINT_T0);
        __m256i dot[ROWS];
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        for (int c = 0; c < CHUNKS; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + half * 32));
            __m256i magnitude = _mm256_abs_epi8(v); /* -128 gives 0x80: 128 as u8 */
            for (int r = 0; r < R; r++) {
                __m256i a = _mm256_set1_epi32(load4(qa + (int64_t)r * K + b * BLOCK + 4 * c));
                __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, v));
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + SCALES_AT + half * 16)));
        for (int r = 0; r < R; r++) {
            __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(da[(int64_t)r * nb + b]));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot[r]), acc[r]);
        }
    }
    int left = N - n0;
    for (int r = 0; r < R; r++) {
        if (left >= 8) {
            _mm256_storeu_ps(out + (int64_t)r * N + n0, acc[r]);
        } else if (left > 0) {
            float part[8];
            _mm256_storeu_ps(part, acc[r]);
            memcpy(out + (int64_t)r * N + n0, part, (size_t)left * sizeof(float));
        }
    }
}

AVX2 static void avx2_rows(const uint8_t *w, int num_groups, int nb, const int8_t *qa, const float *da,
                           int num_rows, int N, float *out) {
    int64_t group_bytes = (int64_t)nb * GROUP_BLOCK_BYTES;
    int K = nb * BLOCK;
    for (int g = 0; g < num_groups; g++)
        for (int half = 0; half < 2; half++) {
            int n0 = g * GROUP + half * 8;
            for (int t = 0; t < num_rows; t += ROWS) {
                const int8_t *a = qa + (int64_t)t * K;
                const float *d = da + (int64_t)t * nb;
                float *o = out + (int64_t)t * N;
                const uint8_t *wg = w + g * group_bytes;
                const uint8_t *ahead = half == 0 && t == 0 && g + 1 < num_groups ? wg + group_bytes : NULL;
                switch (num_rows - t < ROWS ? num_rows - t : ROWS) {
                case 1: avx2_tile(wg, half, nb, a, d, 1, o, N, n0, ahead); break;
                case 2: avx2_tile(wg, half, nb, a, d, 2, o, N, n0, ahead); break;
                case 3: avx2_tile(wg, half, nb, a, d, 3, o, N, n0, ahead); break;
                default: avx2_tile(wg, half, nb, a, d, 4, o, N, n0, ahead); break;
                }
            }
        }
}
#endif

/* Bit i set: path i runs on this CPU (PATH_SCALAR always). */
int tp_q8_paths(void) { return cpu_paths(); }

/* out [T, N] = x [T, K] (row stride x_stride) times the packed weight w (ceil(N / 16) groups).
 * scratch: T * K bytes for qa, then T * K / 32 floats for da and as many int32 for the sums of qa.
 * path: PATH_AUTO picks the fastest here. Returns 0, or -1 where the path does not run on this CPU. */
int tp_q8_linear(const float *x, int64_t x_stride, int num_rows, int K, const uint8_t *w, int N,
                 uint8_t *scratch, float *out, int path) {
    path = pick_path(path);
    if (path < 0) return -1;
    int nb = K / BLOCK, num_groups = (N + GROUP - 1) / GROUP;
    int8_t *qa = (int8_t *)scratch;
    float *da = (float *)(scratch + (int64_t)num_rows * K);
    int32_t *sa = (int32_t *)(da + (int64_t)num_rows * nb);
    quantize_rows(x, x_stride, num_rows, K, qa, da, NULL, sa);
#if defined(__x86_64__)
    if (path == PATH_AVX512_VNNI) {
        vnni_rows(w, num_groups, nb, qa, da, sa, num_rows, N, out);
        return 0;
    }
    if (path == PATH_AVX2) {
        avx2_rows(w, num_groups, nb, qa, da, num_rows, N, out);
        return 0;
    }
#endif
    scalar_rows(w, nb, qa, da, num_rows, N, out);
    return 0;
}

/* out [num_ids, K] = the dequantized rows d * q of outputs ids[0..num_ids) (each in 0..N, checked by
 * the caller): one float32 product a value, so the same bits as any other d * q of these values. */
void tp_q8_rows(const uint8_t *restrict w, int nb, const int64_t *restrict ids, int num_ids,
                float *restrict out) {
    int K = nb * BLOCK;
    for (int i = 0; i < num_ids; i++) {
        int64_t g = ids[i] / GROUP;
        int o = (int)(ids[i] % GROUP);
        float *row = out + (int64_t)i * K;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + (g * nb + b) * GROUP_BLOCK_BYTES;
            int8_t q[BLOCK]; /* the row's 32 values: 4 bytes from each of the block's 8 chunks */
            for (int c = 0; c < CHUNKS; c++) memcpy(q + 4 * c, blk + c * 64 + o * 4, 4);
            float d = load_half(blk + SCALES_AT + 2 * o);
            for (int k = 0; k < BLOCK; k++) row[b * BLOCK + k] = d * (float)q[k];
        }
    }
}
