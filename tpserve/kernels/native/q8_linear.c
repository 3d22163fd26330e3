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
 *
 * The tiles, their order, the dispatch by path and the entry point are block_tiles.h's, shared with
 * the other block kernel; this file holds the layout and the arithmetic of one block (its hooks).
 */
#define CHUNKS 8                                  /* 64-byte chunks of values per (group, block) */
#define SCALES_AT (CHUNKS * 64)                   /* byte offset of d[16] */
#define GROUP_BLOCK_BYTES (SCALES_AT + GROUP * 2) /* 544 */
#define ROW_TERM ROW_TERM_SA                      /* VNNI's q + 128 needs sa = sum qa */
#define BLOCK_ROWS tp_q8_rows                     /* a tied embedding's lookup */
#include "block_tiles.h"

static inline float scalar_block(float acc, const uint8_t *blk, int o, const int8_t *a, qrows q,
                                 int64_t at) {
    int32_t dot = 0;
    for (int c = 0; c < CHUNKS; c++)
        for (int j = 0; j < 4; j++) dot += (int8_t)blk[c * 64 + o * 4 + j] * a[4 * c + j];
    return fmaf(load_half(blk + SCALES_AT + 2 * o) * q.da[at], (float)dot, acc);
}

#if defined(__x86_64__)
/* dot[r][h] gets sum (q + 128) * qa; the epilogue takes 128 * sa off. */
VNNI INLINE void vnni_dots(__m512i dot[ROWS][2], const uint8_t *w, int64_t group_bytes, const int8_t *a,
                           int K, int R, int NG) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int c = 0; c < CHUNKS; c++) {
        __m512i u[2]; /* q + 128, as u8 */
        for (int h = 0; h < NG; h++)
            u[h] = _mm512_xor_si512(_mm512_loadu_si512(w + h * group_bytes + c * 64), flip);
        for (int r = 0; r < R; r++) {
            __m512i ar = _mm512_set1_epi32(load4(a + (int64_t)r * K + 4 * c));
            for (int h = 0; h < NG; h++) dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], u[h], ar);
        }
    }
}

VNNI INLINE void vnni_epilogue(__m512 acc[ROWS][2], __m512i dot[ROWS][2], const uint8_t *w,
                               int64_t group_bytes, qrows q, int nb, int b, int R, int NG) {
    for (int h = 0; h < NG; h++) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + h * group_bytes + SCALES_AT)));
        for (int r = 0; r < R; r++) {
            __m512i exact = _mm512_sub_epi32(dot[r][h], _mm512_set1_epi32(128 * q.sa[(int64_t)r * nb + b]));
            __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(q.da[(int64_t)r * nb + b]));
            acc[r][h] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(exact), acc[r][h]);
        }
    }
}

/* The sign trick (see the top of this file): sums[r] holds exact int32 dots. */
AVX2 INLINE void avx2_dots(__m256i sums[ROWS], const uint8_t *blk, int half, const int8_t *a, int K, int R) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < CHUNKS; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + half * 32));
        __m256i magnitude = _mm256_abs_epi8(v); /* -128 gives 0x80: 128 as u8 */
        for (int r = 0; r < R; r++) {
            __m256i ar = _mm256_set1_epi32(load4(a + (int64_t)r * K + 4 * c));
            __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(ar, v));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));
        }
    }
}

AVX2 INLINE void avx2_epilogue(__m256 acc[ROWS], __m256i sums[ROWS], const uint8_t *blk, int half, qrows q,
                               int nb, int b, int R) {
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + SCALES_AT + half * 16)));
    for (int r = 0; r < R; r++) {
        __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(q.da[(int64_t)r * nb + b]));
        acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
}
#endif

BLOCK_ENTRY_POINTS(tp_q8_paths, tp_q8_linear)

/* d * q: one float32 product a value, so the same bits as any other d * q of these values. */
static inline void dequantize_block(const uint8_t *blk, int o, float *row) {
    int8_t q[BLOCK]; /* the row's 32 values: 4 bytes from each of the block's 8 chunks */
    for (int c = 0; c < CHUNKS; c++) memcpy(q + 4 * c, blk + c * 64 + o * 4, 4);
    float d = load_half(blk + SCALES_AT + 2 * o);
    for (int k = 0; k < BLOCK; k++) row[k] = d * (float)q[k];
}
