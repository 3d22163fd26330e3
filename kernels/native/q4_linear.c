/* 4-bit weights times 8-bit activations (GGUF's Q4_1 x Q8_1), each output's arithmetic fixed by the code.
 *
 * Inputs go in blocks of 32. A weight is w[n, 32b+i] = d[n,b] * q[n,b,i] + m[n,b] with q in 0..15;
 * an input row t is quantized per block on its own (block_quantize.h): da[t,b] = absmax / 127,
 * qa = rint(x * (1 / da)) in -127..127, ms[t,b] = da[t,b] * sum_i qa[t,b,i]. Then, for b = 0, 1, 2, ... in that order,
 *     dot = sum_i q[n,b,i] * qa[t,b,i]                        an exact int32 (|dot| <= 60960)
 *     acc = fmaf(d[n,b] * da[t,b], (float)dot, acc)           acc starts at 0
 *     acc = fmaf(m[n,b], ms[t,b], acc)
 * and out[t,n] = acc. Integer sums are exact in any order, and every float step is elementwise with
 * explicit fmaf (the build turns off contraction), so the AVX-512 VNNI path, the AVX2 path and the
 * scalar path give the same bits, and a row's bits never depend on the rows beside it.
 *
 * The weight is stored in groups of 16 outputs, block by block, one stream of 320 bytes per
 * (group, block): 4 chunks of 64 bytes of nibbles, then d[16] and m[16] as float16 (GGUF's Q4_1
 * keeps them so), turned into float32 exactly where they are used. Byte 4o+j of
 * chunk c holds output o's input 8c+j in its low nibble and input 8c+4+j in its high nibble, so one
 * unpacked chunk (and 0x0f, or shift 4 then and) is 16 outputs x 4 consecutive inputs: one
 * broadcast of 4 activation bytes feeds 16 outputs in one vpdpbusd, with no horizontal sum. AVX2
 * reads the same layout in halves (bytes 0..31 of a chunk are outputs 0..7).
 */
#include "block_quantize.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GROUP 16                                      /* outputs per group */
#define CHUNKS 4                                      /* 64-byte nibble chunks per (group, block) */
#define SCALES_AT (CHUNKS * 64)                       /* byte offset of d[16]; m[16] follows */
#define GROUP_BLOCK_BYTES (SCALES_AT + 2 * GROUP * 2) /* 320 */
#define ROWS 4                                        /* rows that share each unpacked weight */

static inline float epilogue(float acc, float d, float m, int32_t dot, float da, float ms) {
    acc = fmaf(d * da, (float)dot, acc);
    return fmaf(m, ms, acc);
}

static void scalar_rows(const uint8_t *w, int nb, const int8_t *qa, const float *da,
                        const float *ms, int num_rows, int N, float *out) {
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
                    for (int j = 0; j < 4; j++) {
                        uint8_t byte = blk[c * 64 + o * 4 + j];
                        dot += (byte & 15) * a[8 * c + j] + (byte >> 4) * a[8 * c + 4 + j];
                    }
                float d = load_half(blk + SCALES_AT + 2 * o);
                float m = load_half(blk + SCALES_AT + 2 * (GROUP + o));
                acc = epilogue(acc, d, m, dot, da[(int64_t)t * nb + b], ms[(int64_t)t * nb + b]);
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
                           const float *da, const float *ms, int R, int NG, float *out, int N, int n0,
                           const uint8_t *ahead) {
    int K = nb * BLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f);
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
            __m512i lo[2], hi[2];
            for (int h = 0; h < NG; h++) {
                __m512i v = _mm512_loadu_si512(w + h * group_bytes + b * GROUP_BLOCK_BYTES + c * 64);
                lo[h] = _mm512_and_si512(v, low);
                hi[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *a = qa + (int64_t)r * K + b * BLOCK + 8 * c;
                __m512i a_lo = _mm512_set1_epi32(load4(a)), a_hi = _mm512_set1_epi32(load4(a + 4));
                for (int h = 0; h < NG; h++) {
                    dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], lo[h], a_lo);
                    dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], hi[h], a_hi);
                }
            }
        }
        for (int h = 0; h < NG; h++) {
            const uint8_t *scales = w + h * group_bytes + b * GROUP_BLOCK_BYTES + SCALES_AT;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 2 * GROUP)));
            for (int r = 0; r < R; r++) {
                __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(da[(int64_t)r * nb + b]));
                acc[r][h] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot[r][h]), acc[r][h]);
                acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(ms[(int64_t)r * nb + b]), acc[r][h]);
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
                           const float *ms, int num_rows, int N, float *out) {
    int64_t group_bytes = (int64_t)nb * GROUP_BLOCK_BYTES;
    int K = nb * BLOCK;
    for (int g = 0; g < num_groups; g += 2) {
        const uint8_t *wg = w + g * group_bytes;
        int n0 = g * GROUP, pair = num_groups - g >= 2;
        for (int t = 0; t < num_rows; t += ROWS) {
            const int8_t *a = qa + (int64_t)t * K;
            const float *d = da + (int64_t)t * nb, *s = ms + (int64_t)t * nb;
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

/* R rows by the 8 outputs n0.. of half `half` of a group. u8 x s8 pairs (vpmaddubsw) cannot saturate
 * (2 * 15 * 127), and a block's 16 products per int16 lane stay below 16 * 15 * 127 = 30480. */
AVX2 INLINE void avx2_tile(const uint8_t *wg, int half, int nb, const int8_t *qa, const float *da,
                           const float *ms, int R, float *out, int N, int n0, const uint8_t *ahead) {
    int K = nb * BLOCK;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * GROUP_BLOCK_BYTES;
        if (ahead)
            for (int line = 0; line < GROUP_BLOCK_BYTES; line += 64)
                _mm_prefetch((const char *)(ahead + b * GROUP_BLOCK_BYTES + line), _MM_HINT_T0);
        __m256i pairs[ROWS];
        for (int r = 0; r < R; r++) pairs[r] = _mm256_setzero_si256();
        for (int c = 0; c < CHUNKS; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + half * 32));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < R; r++) {
                const int8_t *a = qa + (int64_t)r * K + b * BLOCK + 8 * c;
                __m256i a_lo = _mm256_set1_epi32(load4(a)), a_hi = _mm256_set1_epi32(load4(a + 4));
                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, a_lo));
                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, a_hi));
            }
        }
        const uint8_t *scales = blk + SCALES_AT + half * 16;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * GROUP)));
        for (int r = 0; r < R; r++) {
            __m256i dot = _mm256_madd_epi16(pairs[r], ones);
            __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(da[(int64_t)r * nb + b]));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(ms[(int64_t)r * nb + b]), acc[r]);
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
                           const float *ms, int num_rows, int N, float *out) {
    int64_t group_bytes = (int64_t)nb * GROUP_BLOCK_BYTES;
    int K = nb * BLOCK;
    for (int g = 0; g < num_groups; g++)
        for (int half = 0; half < 2; half++) {
            int n0 = g * GROUP + half * 8;
            for (int t = 0; t < num_rows; t += ROWS) {
                const int8_t *a = qa + (int64_t)t * K;
                const float *d = da + (int64_t)t * nb, *s = ms + (int64_t)t * nb;
                float *o = out + (int64_t)t * N;
                const uint8_t *wg = w + g * group_bytes;
                const uint8_t *ahead = half == 0 && t == 0 && g + 1 < num_groups ? wg + group_bytes : NULL;
                switch (num_rows - t < ROWS ? num_rows - t : ROWS) {
                case 1: avx2_tile(wg, half, nb, a, d, s, 1, o, N, n0, ahead); break;
                case 2: avx2_tile(wg, half, nb, a, d, s, 2, o, N, n0, ahead); break;
                case 3: avx2_tile(wg, half, nb, a, d, s, 3, o, N, n0, ahead); break;
                default: avx2_tile(wg, half, nb, a, d, s, 4, o, N, n0, ahead); break;
                }
            }
        }
}
#endif

/* Bit i set: path i runs on this CPU (PATH_SCALAR always). */
int tp_q4_paths(void) { return cpu_paths(); }

/* out [T, N] = x [T, K] (row stride x_stride) times the packed weight w (ceil(N / 16) groups).
 * scratch: T * K bytes for qa, then 2 * T * K / 32 floats for da and ms. path: PATH_AUTO picks the
 * fastest here. Returns 0, or -1 where the path asked for does not run on this CPU. */
int tp_q4_linear(const float *x, int64_t x_stride, int num_rows, int K, const uint8_t *w, int N,
                 uint8_t *scratch, float *out, int path) {
    path = pick_path(path);
    if (path < 0) return -1;
    int nb = K / BLOCK, num_groups = (N + GROUP - 1) / GROUP;
    int8_t *qa = (int8_t *)scratch;
    float *da = (float *)(scratch + (int64_t)num_rows * K), *ms = da + (int64_t)num_rows * nb;
    quantize_rows(x, x_stride, num_rows, K, qa, da, ms, NULL);
#if defined(__x86_64__)
    if (path == PATH_AVX512_VNNI) {
        vnni_rows(w, num_groups, nb, qa, da, ms, num_rows, N, out);
        return 0;
    }
    if (path == PATH_AVX2) {
        avx2_rows(w, num_groups, nb, qa, da, ms, num_rows, N, out);
        return 0;
    }
#endif
    scalar_rows(w, nb, qa, da, ms, num_rows, N, out);
    return 0;
}
