/* MXFP4 weights (gpt-oss's experts: 4-bit e2m1 values, an e8m0 scale per 32) times 8-bit activations,
 * each output's arithmetic fixed by the code.
 *
 * Inputs go in blocks of 32. A weight is w[n, 32b+i] = 2^(s[n,b] - 127) * e2m1(c[n,b,i]) with c a
 * 4-bit code (sign bit 3, then two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
 * and s a scale byte in 0..254 (255, NaN, is refused at load). Twice an e2m1 value is a whole number
 * v = 2 e2m1(c) in -12..12, so w = d * v with d = 2^(s - 128), exact in float32 for every s (2^-127
 * and 2^-128 are subnormals). An input row t is quantized per block on its own exactly as for the
 * other block kernels (block_quantize.h): da[t,b] = absmax / 127, qa = rint(x * (1 / da)) in
 * -127..127, sa[t,b] = sum_i qa[t,b,i]. Then, for b = 0, 1, 2, ... in that order,
 *     dot = sum_i v[n,b,i] * qa[t,b,i]                        an exact int32 (|dot| <= 48768)
 *     acc = fmaf(d[n,b] * da[t,b], (float)dot, acc)           acc starts at 0
 * and out[t,n] = acc. Integer sums are exact in any order and |dot| < 2^24 converts exactly; every
 * float step is elementwise with explicit fmaf (the build turns off contraction), so the AVX-512 VNNI,
 * AVX2 and scalar paths give the same bits, and a row's bits never depend on the rows beside it.
 *
 * How each path gets v and the exact dot: a code goes through a 16-entry table, DOUBLED in C and one
 * vpshufb (its copy in every 128-bit lane) on the vector paths. vpdpbusd and vpmaddubsw multiply u8
 * by s8, so the vector paths look up v + 12 (0..24) and take 12 * sa off per row and block. AVX2's
 * int16 pairs hold 2 chunks' products (4 * 2 * 24 * 127 = 24384) before vpmaddwd widens them.
 *
 * The weight is stored in groups of 16 outputs, block by block, one stream of 272 bytes per (group,
 * block): the 4-bit kernel's 4 chunks of 64 bytes of nibbles (q4_blocks.h: byte 4o+j of chunk c holds
 * output o's input 8c+j in its low nibble and input 8c+4+j in its high nibble), then s[16], the scale
 * bytes as stored: 17 bytes per 32 weights, as the checkpoint keeps them.
 *
 * The tiles, their order, the dispatch by path and the entry point are block_tiles.h's, shared with
 * the other block kernels; this file holds the layout and the arithmetic of one block (its hooks).
 */
#define CHUNKS 4                              /* 64-byte nibble chunks per (group, block) */
#define SCALES_AT (CHUNKS * 64)               /* byte offset of s[16] */
#define GROUP_BLOCK_BYTES (SCALES_AT + GROUP) /* 272 */
#define ROW_TERM ROW_TERM_SA                  /* the vector paths' v + 12 needs sa = sum qa */
#include "block_tiles.h"

#define OFFSET 12 /* what the vector paths add to v to make it a u8 */

/* v = 2 e2m1(c) for each code c: the sign is bit 3 (so code 8 is -0) */
static const int8_t DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(s - 128) as float32, exactly: s >= 2 is a normal number's exponent field, 0 and 1 subnormals. */
static inline float half_scale(uint8_t s) {
    uint32_t bits = s >= 2 ? (uint32_t)(s - 1) << 23 : 0x00200000u << s;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float scalar_block(float acc, const uint8_t *blk, int o, const int8_t *a, qrows q,
                                 int64_t at) {
    uint8_t codes[BLOCK];
    scalar_nibbles(blk, o, codes);
    int32_t dot = 0;
    for (int k = 0; k < BLOCK; k++) dot += DOUBLED[codes[k]] * a[k];
    return fmaf(half_scale(blk[SCALES_AT + o]) * q.da[at], (float)dot, acc);
}

#if defined(__x86_64__)
/* DOUBLED + OFFSET in each 128-bit lane: vpshufb's table of v + 12 */
VNNI INLINE __m512i vnni_shifted(void) {
    __m128i doubled = _mm_loadu_si128((const __m128i *)DOUBLED);
    return _mm512_broadcast_i32x4(_mm_add_epi8(doubled, _mm_set1_epi8(OFFSET)));
}
AVX2 INLINE __m256i avx2_shifted(void) {
    __m128i doubled = _mm_loadu_si128((const __m128i *)DOUBLED);
    return _mm256_broadcastsi128_si256(_mm_add_epi8(doubled, _mm_set1_epi8(OFFSET)));
}

/* half_scale of 16 (VNNI) or 8 (AVX2) scale bytes from p on, by the same bits. */
VNNI INLINE __m512 vnni_half_scales(const uint8_t *p) {
    __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(s, _mm512_set1_epi32(1)), 23);
    __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), s);
    __mmask16 small = _mm512_cmplt_epi32_mask(s, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
}
AVX2 INLINE __m256 avx2_half_scales(const uint8_t *p) {
    __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(s, _mm256_set1_epi32(1)), 23);
    __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), s);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), s);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

/* dot[r][h] gets sum (v + 12) * qa; the epilogue takes 12 * sa off. Each chunk looked up once. */
VNNI INLINE void vnni_dots(__m512i dot[ROWS][2], const uint8_t *w, int64_t group_bytes, const int8_t *a,
                           int K, int R, int NG) {
    const __m512i low = _mm512_set1_epi8(0x0f), shifted = vnni_shifted();
    for (int c = 0; c < CHUNKS; c++) {
        __m512i lo[2], hi[2];
        for (int h = 0; h < NG; h++) {
            __m512i v = _mm512_loadu_si512(w + h * group_bytes + c * 64);
            lo[h] = _mm512_shuffle_epi8(shifted, _mm512_and_si512(v, low));
            hi[h] = _mm512_shuffle_epi8(shifted, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
        vnni_chunk_dots(dot, lo, hi, a, K, R, NG, c);
    }
}

VNNI INLINE void vnni_epilogue(__m512 acc[ROWS][2], __m512i dot[ROWS][2], const uint8_t *w,
                               int64_t group_bytes, qrows q, int nb, int b, int R, int NG) {
    for (int h = 0; h < NG; h++) {
        __m512 d = vnni_half_scales(w + h * group_bytes + SCALES_AT);
        for (int r = 0; r < R; r++) {
            int64_t at = (int64_t)r * nb + b;
            __m512i exact = _mm512_sub_epi32(dot[r][h], _mm512_set1_epi32(OFFSET * q.sa[at]));
            __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(q.da[at]));
            acc[r][h] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(exact), acc[r][h]);
        }
    }
}

/* sums[r] gets sum (v + 12) * qa as exact int32s: each 2 chunks' int16 pairs widened (see the top). */
AVX2 INLINE void avx2_dots(__m256i sums[ROWS], const uint8_t *blk, int half, const int8_t *a, int K, int R) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), shifted = avx2_shifted();
    __m256i pairs[ROWS];
    for (int c = 0; c < CHUNKS; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + half * 32));
        __m256i lo = _mm256_shuffle_epi8(shifted, _mm256_and_si256(v, low));
        __m256i hi = _mm256_shuffle_epi8(shifted, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        if (c % 2 == 0)
            for (int r = 0; r < R; r++) pairs[r] = _mm256_setzero_si256();
        avx2_chunk_pairs(pairs, lo, hi, a, K, R, c);
        if (c % 2 == 1)
            for (int r = 0; r < R; r++) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], ones));
    }
}

AVX2 INLINE void avx2_epilogue(__m256 acc[ROWS], __m256i sums[ROWS], const uint8_t *blk, int half, qrows q,
                               int nb, int b, int R) {
    __m256 d = avx2_half_scales(blk + SCALES_AT + half * 8);
    for (int r = 0; r < R; r++) {
        int64_t at = (int64_t)r * nb + b;
        __m256i exact = _mm256_sub_epi32(sums[r], _mm256_set1_epi32(OFFSET * q.sa[at]));
        __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(q.da[at]));
        acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(exact), acc[r]);
    }
}
#endif

BLOCK_ENTRY_POINTS(tp_mxfp4_paths, tp_mxfp4_linear)
