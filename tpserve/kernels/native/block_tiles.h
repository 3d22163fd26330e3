/* The loops the block kernels (q4_linear.c, q8_linear.c, q6_linear.c, mxfp4_linear.c) share: which rows and outputs each tile
 * takes, the order it walks the blocks in, the prefetch, the stores, the dispatch by path and the
 * entry point; each kernel keeps its own arithmetic per block.
 *
 * One copy of these loops is what keeps the two kernels' promises alike: a row's bits never depend on
 * the rows beside it because a tile's rows never meet, and blocks are summed b = 0, 1, 2, ... on every
 * path. The kernel that includes this file first defines its layout,
 *     GROUP_BLOCK_BYTES   bytes per (group of 16 outputs, block of 32 inputs)
 *     ROW_TERM            ROW_TERM_MS, ROW_TERM_SA or ROW_TERM_SH: what quantize_rows writes beside da
 * then defines the hooks declared below and its own arithmetic, and names its entry points with
 * BLOCK_ENTRY_POINTS. Every hook is inlined, so a tile's R and NG stay constants and its arrays
 * registers. A kernel whose weight serves an embedding's lookup (its rows dequantized) also defines
 * BLOCK_ROWS, the name of that entry point, and the hook dequantize_block.
 */
#ifndef TP_BLOCK_TILES_H
#define TP_BLOCK_TILES_H

#include "block_quantize.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if !defined(GROUP_BLOCK_BYTES) || !defined(ROW_TERM)
#error "define GROUP_BLOCK_BYTES and ROW_TERM before including block_tiles.h"
#endif

#define GROUP 16 /* outputs per group */
#define ROWS 4   /* rows that share each loaded weight */

enum { ROW_TERM_MS = 1, ROW_TERM_SA = 2, ROW_TERM_SH = 3 };

/* An input's rows as quantize_rows left them, from some row on. The kernel reads the one of ms, sa
 * and sh its ROW_TERM names; the others are NULL. */
typedef struct {
    const int8_t *qa;  /* [T, K] */
    const float *da;   /* [T, nb] */
    const float *ms;   /* [T, nb] da * sum qa: the 4-bit m term */
    const int32_t *sa; /* [T, nb] sum qa: the 8-bit VNNI path's q + 128 correction */
    const int32_t *sh; /* [T, 2 nb] sum qa per 16 inputs: the 6-bit kernel's q - 32 per sub-scale */
} qrows;

/* q from row t on; ROW_TERM, a constant, says which of ms, sa and sh to move (the others stay NULL). */
static inline qrows qrows_from(qrows q, int t, int K, int nb) {
    int64_t at = (int64_t)t * nb;
    return (qrows){q.qa + (int64_t)t * K, q.da + at, ROW_TERM == ROW_TERM_MS ? q.ms + at : NULL,
                   ROW_TERM == ROW_TERM_SA ? q.sa + at : NULL, ROW_TERM == ROW_TERM_SH ? q.sh + 2 * at : NULL};
}

/* Output o's 32 nibbles in input order, in the nibble layouts (q4_blocks.h, mxfp4_linear.c): byte
 * 4o+j of 64-byte chunk c of blk holds input 8c+j in its low nibble and input 8c+4+j in its high. */
static inline void scalar_nibbles(const uint8_t *blk, int o, uint8_t v[BLOCK]) {
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 4; j++) {
            uint8_t byte = blk[c * 64 + o * 4 + j];
            v[8 * c + j] = byte & 15;
            v[8 * c + 4 + j] = byte >> 4;
        }
}

/* acc after block b of output o: blk is o's group's block b, a row t's block b of qa, at = t * nb + b. */
static inline float scalar_block(float acc, const uint8_t *blk, int o, const int8_t *a, qrows q, int64_t at);

static void scalar_rows(const uint8_t *w, int nb, qrows q, int num_rows, int N, float *out) {
    int K = nb * BLOCK;
    for (int t = 0; t < num_rows; t++) {
        for (int n = 0; n < N; n++) {
            int g = n / GROUP, o = n % GROUP;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = w + ((int64_t)g * nb + b) * GROUP_BLOCK_BYTES;
                acc = scalar_block(acc, blk, o, q.qa + (int64_t)t * K + b * BLOCK, q, (int64_t)t * nb + b);
            }
            out[(int64_t)t * N + n] = acc;
        }
    }
}

#if defined(__x86_64__)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* One chunk of the nibble layouts (q4_blocks.h, mxfp4_linear.c): lo[h] and hi[h] hold group h's 16
 * outputs' u8 values of inputs 8c..8c+3 and 8c+4..8c+7 (4 bytes an output); dot[r][h] += their
 * exact products with row r's (a is row 0's block, row r r * K on). */
VNNI INLINE void vnni_chunk_dots(__m512i dot[ROWS][2], const __m512i lo[2], const __m512i hi[2],
                                 const int8_t *a, int K, int R, int NG, int c) {
    for (int r = 0; r < R; r++) {
        const int8_t *ar = a + (int64_t)r * K + 8 * c;
        __m512i a_lo = _mm512_set1_epi32(load4(ar)), a_hi = _mm512_set1_epi32(load4(ar + 4));
        for (int h = 0; h < NG; h++) {
            dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], lo[h], a_lo);
            dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], hi[h], a_hi);
        }
    }
}

/* AVX2's half of the same: lo and hi hold 8 outputs' values; pairs[r] += their int16 pair sums
 * (vpmaddubsw) with row r's inputs. The caller widens them before they can overflow. */
AVX2 INLINE void avx2_chunk_pairs(__m256i pairs[ROWS], __m256i lo, __m256i hi, const int8_t *a, int K, int R,
                                  int c) {
    for (int r = 0; r < R; r++) {
        const int8_t *ar = a + (int64_t)r * K + 8 * c;
        __m256i a_lo = _mm256_set1_epi32(load4(ar)), a_hi = _mm256_set1_epi32(load4(ar + 4));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, a_lo));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, a_hi));
    }
}

/* dot[r][h] += block b's exact products for R rows and NG groups: w is group 0's block b (group h
 * h * group_bytes on), a row 0's block b of qa (row r r * K on). */
VNNI INLINE void vnni_dots(__m512i dot[ROWS][2], const uint8_t *w, int64_t group_bytes, const int8_t *a,
                           int K, int R, int NG);
/* acc[r][h] += block b's epilogue of dot[r][h]; w as for vnni_dots, q from the tile's row 0. */
VNNI INLINE void vnni_epilogue(__m512 acc[ROWS][2], __m512i dot[ROWS][2], const uint8_t *w,
                               int64_t group_bytes, qrows q, int nb, int b, int R, int NG);

/* R rows by NG groups of 16 outputs (n0..): R and NG are constants where it is inlined. `ahead`, where
 * not NULL, is the next groups' weight, fetched into the cache block by block meanwhile. */
VNNI INLINE void vnni_tile(const uint8_t *w, int64_t group_bytes, int nb, qrows q, int R, int NG,
                           float *out, int N, int n0, const uint8_t *ahead) {
    int K = nb * BLOCK;
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
        vnni_dots(dot, w + b * GROUP_BLOCK_BYTES, group_bytes, q.qa + b * BLOCK, K, R, NG);
        vnni_epilogue(acc, dot, w + b * GROUP_BLOCK_BYTES, group_bytes, q, nb, b, R, NG);
    }
    for (int h = 0; h < NG; h++) {
        int n = n0 + h * GROUP, left = N - n;
        __mmask16 keep = left >= GROUP ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (int64_t)r * N + n, keep, acc[r][h]);
    }
}

VNNI static void vnni_rows(const uint8_t *w, int num_groups, int nb, qrows q, int num_rows, int N,
                           float *out) {
    int64_t group_bytes = (int64_t)nb * GROUP_BLOCK_BYTES;
    int K = nb * BLOCK;
    for (int g = 0; g < num_groups; g += 2) {
        const uint8_t *wg = w + g * group_bytes;
        int n0 = g * GROUP, pair = num_groups - g >= 2;
        for (int t = 0; t < num_rows; t += ROWS) {
            qrows s = qrows_from(q, t, K, nb);
            float *o = out + (int64_t)t * N;
            const uint8_t *ahead = t == 0 && g + 2 < num_groups ? wg + 2 * group_bytes : NULL;
            int R = num_rows - t < ROWS ? num_rows - t : ROWS, shape = 2 * R - 1 + pair;
            switch (shape) { /* R and NG as constants, so the tile's arrays stay in registers */
            case 1: vnni_tile(wg, group_bytes, nb, s, 1, 1, o, N, n0, ahead); break;
            case 2: vnni_tile(wg, group_bytes, nb, s, 1, 2, o, N, n0, ahead); break;
            case 3: vnni_tile(wg, group_bytes, nb, s, 2, 1, o, N, n0, ahead); break;
            case 4: vnni_tile(wg, group_bytes, nb, s, 2, 2, o, N, n0, ahead); break;
            case 5: vnni_tile(wg, group_bytes, nb, s, 3, 1, o, N, n0, ahead); break;
            case 6: vnni_tile(wg, group_bytes, nb, s, 3, 2, o, N, n0, ahead); break;
            case 7: vnni_tile(wg, group_bytes, nb, s, 4, 1, o, N, n0, ahead); break;
            default: vnni_tile(wg, group_bytes, nb, s, 4, 2, o, N, n0, ahead); break;
            }
        }
    }
}

/* sums[r] += block b's products for the 8 outputs of half `half` of a group: blk is the group's block
 * b, a row 0's block b of qa (row r r * K on). */
AVX2 INLINE void avx2_dots(__m256i sums[ROWS], const uint8_t *blk, int half, const int8_t *a, int K, int R);
/* acc[r] += block b's epilogue of sums[r]; blk as for avx2_dots, q from the tile's row 0. */
AVX2 INLINE void avx2_epilogue(__m256 acc[ROWS], __m256i sums[ROWS], const uint8_t *blk, int half, qrows q,
                               int nb, int b, int R);

/* R rows by the 8 outputs n0.. of half `half` of a group. */
AVX2 INLINE void avx2_tile(const uint8_t *wg, int half, int nb, qrows q, int R, float *out, int N, int n0,
                           const uint8_t *ahead) {
    int K = nb * BLOCK;
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * GROUP_BLOCK_BYTES;
        if (ahead)
            for (int line = 0; line < GROUP_BLOCK_BYTES; line += 64)
                _mm_prefetch((const char *)(ahead + b * GROUP_BLOCK_BYTES + line), _MM_HINT_T0);
        __m256i sums[ROWS];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        avx2_dots(sums, blk, half, q.qa + b * BLOCK, K, R);
        avx2_epilogue(acc, sums, blk, half, q, nb, b, R);
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

AVX2 static void avx2_rows(const uint8_t *w, int num_groups, int nb, qrows q, int num_rows, int N,
                           float *out) {
    int64_t group_bytes = (int64_t)nb * GROUP_BLOCK_BYTES;
    int K = nb * BLOCK;
    for (int g = 0; g < num_groups; g++)
        for (int half = 0; half < 2; half++) {
            int n0 = g * GROUP + half * 8;
            for (int t = 0; t < num_rows; t += ROWS) {
                qrows s = qrows_from(q, t, K, nb);
                float *o = out + (int64_t)t * N;
                const uint8_t *wg = w + g * group_bytes;
                const uint8_t *ahead = half == 0 && t == 0 && g + 1 < num_groups ? wg + group_bytes : NULL;
                switch (num_rows - t < ROWS ? num_rows - t : ROWS) {
                case 1: avx2_tile(wg, half, nb, s, 1, o, N, n0, ahead); break;
                case 2: avx2_tile(wg, half, nb, s, 2, o, N, n0, ahead); break;
                case 3: avx2_tile(wg, half, nb, s, 3, o, N, n0, ahead); break;
                default: avx2_tile(wg, half, nb, s, 4, o, N, n0, ahead); break;
                }
            }
        }
}
#endif

/* out [T, N] = x [T, K] (row stride x_stride) times the packed weight w (ceil(N / 16) groups).
 * scratch: T * K bytes for qa, then T * K / 32 floats for da and as many 4-byte ms or sa, or twice as
 * many sh (ROW_TERM): T * (K + 12 K / 32) bytes at most.
 * path: PATH_AUTO picks the fastest here. Returns 0, or -1 where the path does not run on this CPU. */
static int block_linear(const float *x, int64_t x_stride, int num_rows, int K, const uint8_t *w, int N,
                        uint8_t *scratch, float *out, int path) {
    path = pick_path(path);
    if (path < 0) return -1;
    int nb = K / BLOCK;
    int8_t *qa = (int8_t *)scratch;
    float *da = (float *)(scratch + (int64_t)num_rows * K);
    void *term = da + (int64_t)num_rows * nb;
    float *ms = ROW_TERM == ROW_TERM_MS ? (float *)term : NULL;
    int32_t *sa = ROW_TERM == ROW_TERM_SA ? (int32_t *)term : NULL;
    int32_t *sh = ROW_TERM == ROW_TERM_SH ? (int32_t *)term : NULL;
    quantize_rows(x, x_stride, num_rows, K, qa, da, ms, sa, sh);
    qrows q = {qa, da, ms, sa, sh};
#if defined(__x86_64__)
    int num_groups = (N + GROUP - 1) / GROUP;
    if (path == PATH_AVX512_VNNI) {
        vnni_rows(w, num_groups, nb, q, num_rows, N, out);
        return 0;
    }
    if (path == PATH_AVX2) {
        avx2_rows(w, num_groups, nb, q, num_rows, N, out);
        return 0;
    }
#endif
    scalar_rows(w, nb, q, num_rows, N, out);
    return 0;
}


/* The kernel's entry points: PATHS() has bit i set where path i runs on this CPU (PATH_SCALAR
 * always); LINEAR is block_linear (out [T, N] = x [T, K] times the packed weight w). */
#define BLOCK_ENTRY_POINTS(PATHS, LINEAR)                                                              \
    int PATHS(void) { return cpu_paths(); }                                                            \
    int LINEAR(const float *x, int64_t x_stride, int num_rows, int K, const uint8_t *w, int N,         \
               uint8_t *scratch, float *out, int path) {                                               \
        return block_linear(x, x_stride, num_rows, K, w, N, scratch, out, path);                       \
    }

#ifdef BLOCK_ROWS
/* row[0..32) = output o's dequantized weights in blk, its group's block: as the kernel's Python
 * dequantize() computes them, bit for bit. */
static inline void dequantize_block(const uint8_t *blk, int o, float *row);

/* out [num_ids, K] = the dequantized rows of outputs ids[0..num_ids) (each in 0..N, checked by the
 * caller): an embedding's lookup from the head's packed copy. */
void BLOCK_ROWS(const uint8_t *restrict w, int nb, const int64_t *restrict ids, int num_ids,
                float *restrict out) {
    int K = nb * BLOCK;
    for (int i = 0; i < num_ids; i++) {
        int64_t g = ids[i] / GROUP;
        int o = (int)(ids[i] % GROUP);
        for (int b = 0; b < nb; b++)
            dequantize_block(w + (g * nb + b) * GROUP_BLOCK_BYTES, o, out + (int64_t)i * K + b * BLOCK);
    }
}
#endif

#endif
