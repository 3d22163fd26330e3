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
 * The weight is stored in groups of 16 outputs, block by block, one stream per (group, block): 4
 * chunks of 64 bytes of nibbles, then d[16] and m[16], as float16 (320 bytes: GGUF's Q4_0 and Q4_1
 * keep them so; q4_linear.c) or as float32 (384 bytes: GGUF's Q4_K, whose d = d * sc and
 * m = -dmin * mn are exact in float32 only; q4f_linear.c), turned into float32 exactly where
 * used. Byte 4o+j of chunk c holds output o's input 8c+j in its low nibble and input 8c+4+j in
 * its high nibble, so one unpacked chunk (and 0x0f, or shift 4 then and) is 16 outputs x 4 consecutive inputs: one
 * broadcast of 4 activation bytes feeds 16 outputs in one vpdpbusd, with no horizontal sum. AVX2
 * reads the same layout in halves (bytes 0..31 of a chunk are outputs 0..7).
 *
 * With FIFTH_BITS defined, q lies in 0..31 (GGUF's Q5_0, Q5_1 and Q5_K: 5-bit values, the same
 * d * q + m): its low 4 bits are the nibbles above, and a 64-byte vector after them holds the fifth
 * bits, byte 4o+j's bit i that of output o's input 4i+j (the nibble of chunk i / 2, low for i even),
 * moved beside its nibble by one shift and mask. 384 bytes per (group, block) with float16 scales,
 * 448 with float32 (q5_linear.c, q5f_linear.c); the arithmetic is the same (|dot| <= 126976).
 *
 * The tiles, their order, the dispatch by path and the entry point are block_tiles.h's, shared with
 * the other block kernel; this header holds the layout and the arithmetic of one block (its hooks).
 * The kernel that includes it defines SCALE_BYTES (2 or 4), maybe FIFTH_BITS, and its entry points'
 * names Q4_PATHS and Q4_LINEAR first: the float32 scales change the loads, never the arithmetic, so
 * a float16 scale gives the same bits in either layout.
 */
#ifndef TP_Q4_BLOCKS_H
#define TP_Q4_BLOCKS_H

#define CHUNKS 4 /* 64-byte nibble chunks per (group, block) */
#ifdef FIFTH_BITS
#define TOP_AT (CHUNKS * 64)     /* byte offset of the fifth bits */
#define SCALES_AT (TOP_AT + 64) /* byte offset of d[16]; m[16] follows */
#else
#define SCALES_AT (CHUNKS * 64) /* byte offset of d[16]; m[16] follows */
#endif
/* 320 bytes (float16 scales) or 384 (float32) per (group, block); with fifth bits 384 or 448 */
#define GROUP_BLOCK_BYTES (SCALES_AT + 2 * GROUP * SCALE_BYTES)
#define ROW_TERM ROW_TERM_MS /* the m term needs ms = da * sum qa */
#include "block_tiles.h"

/* A block scale as float32, one of them (scalar), 16 (VNNI) or 8 (AVX2) from p on: float16 ones
 * converted exactly, float32 ones as they are. */
#if SCALE_BYTES == 2
static inline float load_scale(const uint8_t *p) { return load_half(p); }
#elif SCALE_BYTES == 4
static inline float load_scale(const uint8_t *p) {
    float v;
    memcpy(&v, p, sizeof v);
    return v;
}
#else
#error "SCALE_BYTES must be 2 (float16 scales) or 4 (float32)"
#endif

static inline float scalar_block(float acc, const uint8_t *blk, int o, const int8_t *a, qrows q,
                                 int64_t at) {
    uint8_t v[BLOCK];
    scalar_nibbles(blk, o, v);
    int32_t dot = 0;
    for (int k = 0; k < BLOCK; k++) {
        int value = v[k];
#ifdef FIFTH_BITS
        value |= (blk[TOP_AT + o * 4 + k % 4] >> (k / 4) & 1) << 4; /* input 4i+j's: bit i of byte (o, j) */
#endif
        dot += value * a[k];
    }
    float d = load_scale(blk + SCALES_AT + SCALE_BYTES * o);
    float m = load_scale(blk + SCALES_AT + SCALE_BYTES * (GROUP + o));
    acc = fmaf(d * q.da[at], (float)dot, acc);
    return fmaf(m, q.ms[at], acc);
}

#if defined(__x86_64__)
#if SCALE_BYTES == 2
VNNI INLINE __m512 vnni_scales(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
AVX2 INLINE __m256 avx2_scales(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#else
VNNI INLINE __m512 vnni_scales(const uint8_t *p) { return _mm512_loadu_ps((const float *)p); }
AVX2 INLINE __m256 avx2_scales(const uint8_t *p) { return _mm256_loadu_ps((const float *)p); }
#endif

#ifdef FIFTH_BITS
/* Bit i of each byte of top moved to bit 4, the rest cleared (16-bit shifts: what they carry across
 * a byte lands away from bit 4). i is a constant where this is inlined. */
VNNI INLINE __m512i vnni_fifth(__m512i top, int i) {
    __m512i moved = i <= 4 ? _mm512_sll_epi16(top, _mm_cvtsi32_si128(4 - i))
                           : _mm512_srl_epi16(top, _mm_cvtsi32_si128(i - 4));
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}
AVX2 INLINE __m256i avx2_fifth(__m256i top, int i) {
    __m256i moved = i <= 4 ? _mm256_sll_epi16(top, _mm_cvtsi32_si128(4 - i))
                           : _mm256_srl_epi16(top, _mm_cvtsi32_si128(i - 4));
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}
#endif

/* Each chunk unpacked once, low nibbles and high (and their fifth bits), for all R rows. */
VNNI INLINE void vnni_dots(__m512i dot[ROWS][2], const uint8_t *w, int64_t group_bytes, const int8_t *a,
                           int K, int R, int NG) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < CHUNKS; c++) {
        __m512i lo[2], hi[2];
        for (int h = 0; h < NG; h++) {
            __m512i v = _mm512_loadu_si512(w + h * group_bytes + c * 64);
            lo[h] = _mm512_and_si512(v, low);
            hi[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#ifdef FIFTH_BITS
            __m512i top = _mm512_loadu_si512(w + h * group_bytes + TOP_AT);
            lo[h] = _mm512_or_si512(lo[h], vnni_fifth(top, 2 * c));
            hi[h] = _mm512_or_si512(hi[h], vnni_fifth(top, 2 * c + 1));
#endif
        }
        vnni_chunk_dots(dot, lo, hi, a, K, R, NG, c);
    }
}

VNNI INLINE void vnni_epilogue(__m512 acc[ROWS][2], __m512i dot[ROWS][2], const uint8_t *w,
                               int64_t group_bytes, qrows q, int nb, int b, int R, int NG) {
    for (int h = 0; h < NG; h++) {
        const uint8_t *scales = w + h * group_bytes + SCALES_AT;
        __m512 d = vnni_scales(scales), m = vnni_scales(scales + SCALE_BYTES * GROUP);
        for (int r = 0; r < R; r++) {
            __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(q.da[(int64_t)r * nb + b]));
            acc[r][h] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot[r][h]), acc[r][h]);
            acc[r][h] = _mm512_fmadd_ps(m, _mm512_set1_ps(q.ms[(int64_t)r * nb + b]), acc[r][h]);
        }
    }
}

/* u8 x s8 pairs (vpmaddubsw) cannot saturate (2 * 31 * 127). With 4-bit values a block's 16 products
 * per int16 lane stay below 16 * 15 * 127 = 30480: sums[r] holds int16 pairs until the epilogue
 * widens them. With 5-bit values only 2 chunks' do (8 * 31 * 127 = 31496): each 2 chunks' int16 sums
 * are widened to int32 (vpmaddwd) here, so sums[r] holds the exact int32 dots. */
AVX2 INLINE void avx2_dots(__m256i sums[ROWS], const uint8_t *blk, int half, const int8_t *a, int K, int R) {
    const __m256i low = _mm256_set1_epi8(0x0f);
#ifdef FIFTH_BITS
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i top = _mm256_loadu_si256((const __m256i *)(blk + TOP_AT + half * 32)), pairs[ROWS];
#else
    __m256i *pairs = sums;
#endif
    for (int c = 0; c < CHUNKS; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + half * 32));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#ifdef FIFTH_BITS
        lo = _mm256_or_si256(lo, avx2_fifth(top, 2 * c));
        hi = _mm256_or_si256(hi, avx2_fifth(top, 2 * c + 1));
        if (c % 2 == 0)
            for (int r = 0; r < R; r++) pairs[r] = _mm256_setzero_si256();
#endif
        avx2_chunk_pairs(pairs, lo, hi, a, K, R, c);
#ifdef FIFTH_BITS
        if (c % 2 == 1)
            for (int r = 0; r < R; r++) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], ones));
#endif
    }
}

#ifdef FIFTH_BITS
#define AVX2_DOT(sums) (sums)
#else
#define AVX2_DOT(sums) _mm256_madd_epi16(sums, ones) /* the int16 pairs widened */
#endif

AVX2 INLINE void avx2_epilogue(__m256 acc[ROWS], __m256i sums[ROWS], const uint8_t *blk, int half, qrows q,
                               int nb, int b, int R) {
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *scales = blk + SCALES_AT + half * 8 * SCALE_BYTES;
    __m256 d = avx2_scales(scales), m = avx2_scales(scales + SCALE_BYTES * GROUP);
    for (int r = 0; r < R; r++) {
        __m256i dot = AVX2_DOT(sums[r]);
        __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(q.da[(int64_t)r * nb + b]));
        acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(q.ms[(int64_t)r * nb + b]), acc[r]);
    }
}
#endif

BLOCK_ENTRY_POINTS(Q4_PATHS, Q4_LINEAR)

#endif
