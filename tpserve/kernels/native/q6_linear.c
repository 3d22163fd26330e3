/* 6-bit block weights with a scale per 16 inputs (GGUF's Q6_K) times 8-bit activations, each output's
 * arithmetic fixed by the code.
 *
 * Inputs go in blocks of 32, each of two halves of 16. A weight is w[n, 32b+16h+i] = d[n,b] *
 * sc[n,b,h] * (q[n,b,h,i] - 32) with q in 0..63, sc int8 and d float16 (Q6_K's super-block d, the
 * same for its 8 blocks). An input row t is quantized per block on its own exactly as for the other
 * block kernels (block_quantize.h): da[t,b] = absmax / 127, qa in -127..127, and sh[t,2b+h] = sum_i
 * qa[t,b,h,i]. Then, for b = 0, 1, 2, ... in that order,
 *     dot = sum_h sc[n,b,h] * (sum_i q[n,b,h,i] * qa[t,b,h,i] - 32 sh[t,2b+h])
 *                                                             an exact int32 (|dot| <= 16646144 < 2^24)
 *     acc = fmaf(d[n,b] * da[t,b], (float)dot, acc)           acc starts at 0
 * and out[t,n] = acc. |dot| < 2^24 converts exactly; every float step is elementwise with explicit
 * fmaf (the build turns off contraction), so the AVX-512 VNNI, AVX2 and scalar paths give the same
 * bits, and a row's bits never depend on the rows beside it.
 *
 * q is kept unsigned (0..63) because both vector paths multiply u8 by s8 (vpdpbusd, vpmaddubsw: a
 * pair is at most 2 * 63 * 127, no saturation); the - 32 comes back per half through sh.
 *
 * The weight is stored in groups of 16 outputs, block by block, one stream of 448 bytes per (group,
 * block), 0.875 bytes a weight: q's low 4 bits as q4_blocks.h lays nibbles out (4 chunks of 64
 * bytes, byte 4o+j of chunk c holding output o's input 8c+j in its low nibble and 8c+4+j in its
 * high one: chunks 0, 1 are half 0, chunks 2, 3 half 1), then q's top 2 bits in 2 vectors of 64
 * bytes (vector h's byte 4o+j holds those of output o's inputs 16h+4i+j in its bits 2i, 2i+1, i <
 * 4: one shift and one mask put them beside the matching nibbles), then sc[16][2] (output o's two
 * halves side by side: one vpmovsxbw makes them int16 pairs, and one vpmaddwd takes sc . sh per
 * output), then d[16] as float16. AVX2 reads the same layout in halves of a group (outputs 0..7,
 * 8..15: bytes 0..31 of each 64).
 *
 * The tiles, their order, the dispatch by path and the entry point are block_tiles.h's, shared with
 * the other block kernels; this file holds the layout and the arithmetic of one block (its hooks).
 */
#define HIGH_AT 256                       /* byte offset of the top 2 bits' 2 vectors */
#define SC_AT (HIGH_AT + 128)             /* byte offset of sc[16][2] */
#define D_AT (SC_AT + 2 * GROUP)          /* byte offset of d[16] */
#define GROUP_BLOCK_BYTES (D_AT + 2 * GROUP) /* 448 */
#define ROW_TERM ROW_TERM_SH              /* q - 32 needs sh = sum qa per half */
#define BLOCK_ROWS tp_q6_rows             /* a tied embedding's lookup */
#include "block_tiles.h"

/* Output o's value at input k (< 32) of blk, its group's block. */
static inline int value_at(const uint8_t *blk, int o, int k) {
    int half = k / 16, i = k % 16 / 4, j = k % 4;
    uint8_t nibbles = blk[(2 * half + i / 2) * 64 + 4 * o + j];
    int low = i % 2 ? nibbles >> 4 : nibbles & 15;
    return low | ((blk[HIGH_AT + half * 64 + 4 * o + j] >> (2 * i)) & 3) << 4;
}

static inline float scalar_block(float acc, const uint8_t *blk, int o, const int8_t *a, qrows q,
                                 int64_t at) {
    int32_t dot = 0;
    for (int h = 0; h < 2; h++) {
        int32_t part = 0;
        for (int k = 16 * h; k < 16 * h + 16; k++) part += value_at(blk, o, k) * a[k];
        dot += (int8_t)blk[SC_AT + 2 * o + h] * (part - 32 * q.sh[2 * at + h]);
    }
    return fmaf(load_half(blk + D_AT + 2 * o) * q.da[at], (float)dot, acc);
}

#if defined(__x86_64__)
/* sc[16][2] as 16 int32 lanes of int16 pairs (sc of half 0, of half 1); `half`'s alone as int32. */
VNNI INLINE __m512i vnni_sub_scales(const uint8_t *blk) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + SC_AT)));
}
VNNI INLINE __m512i vnni_sub_scale(__m512i pairs, int half) {
    return half ? _mm512_srai_epi32(pairs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
}

/* A row's sh[0] and sh[1] (|sh| <= 16 * 127) as one int16 pair. */
static inline int32_t sh_pair(const int32_t *sh) { return (int32_t)(((uint32_t)sh[1] << 16) | (uint16_t)sh[0]); }

/* The 4 value vectors of half `half` (inputs 16 half + 4i + j at byte 4o+j of vector i), from its 2
 * nibble chunks and its top bits: each byte's bits 2i, 2i+1 moved to bits 4, 5 (16-bit shifts, the
 * bits they carry across a byte masked off). */
VNNI INLINE void vnni_values(__m512i v[4], const uint8_t *blk, int half) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    __m512i n0 = _mm512_loadu_si512(blk + 2 * half * 64), n1 = _mm512_loadu_si512(blk + (2 * half + 1) * 64);
    __m512i hb = _mm512_loadu_si512(blk + HIGH_AT + half * 64);
    v[0] = _mm512_or_si512(_mm512_and_si512(n0, low), _mm512_and_si512(_mm512_slli_epi16(hb, 4), top));
    v[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n0, 4), low),
                           _mm512_and_si512(_mm512_slli_epi16(hb, 2), top));
    v[2] = _mm512_or_si512(_mm512_and_si512(n1, low), _mm512_and_si512(hb, top));
    v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n1, 4), low),
                           _mm512_and_si512(_mm512_srli_epi16(hb, 2), top));
}

/* dot[r][h] gets sum_half sc * sum q * qa; the epilogue takes 32 sum_half sc * sh off. */
VNNI INLINE void vnni_dots(__m512i dot[ROWS][2], const uint8_t *w, int64_t group_bytes, const int8_t *a,
                           int K, int R, int NG) {
    __m512i pairs[2];
    for (int h = 0; h < NG; h++) pairs[h] = vnni_sub_scales(w + h * group_bytes);
    for (int half = 0; half < 2; half++) {
        __m512i part[ROWS][2], v[2][4];
        for (int h = 0; h < NG; h++) vnni_values(v[h], w + h * group_bytes, half);
        for (int r = 0; r < R; r++) {
            const int8_t *ar = a + (int64_t)r * K + 16 * half;
            for (int h = 0; h < NG; h++) part[r][h] = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                __m512i ai = _mm512_set1_epi32(load4(ar + 4 * i));
                for (int h = 0; h < NG; h++) part[r][h] = _mm512_dpbusd_epi32(part[r][h], v[h][i], ai);
            }
        }
        for (int h = 0; h < NG; h++) {
            __m512i scale = vnni_sub_scale(pairs[h], half);
            for (int r = 0; r < R; r++)
                dot[r][h] = _mm512_add_epi32(dot[r][h], _mm512_mullo_epi32(scale, part[r][h]));
        }
    }
}

VNNI INLINE void vnni_epilogue(__m512 acc[ROWS][2], __m512i dot[ROWS][2], const uint8_t *w,
                               int64_t group_bytes, qrows q, int nb, int b, int R, int NG) {
    for (int h = 0; h < NG; h++) {
        const uint8_t *blk = w + h * group_bytes;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + D_AT)));
        __m512i pairs = vnni_sub_scales(blk);
        for (int r = 0; r < R; r++) {
            __m512i shp = _mm512_set1_epi32(sh_pair(q.sh + 2 * ((int64_t)r * nb + b)));
            __m512i off = _mm512_slli_epi32(_mm512_madd_epi16(pairs, shp), 5); /* 32 (sc0 sh0 + sc1 sh1) */
            __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(q.da[(int64_t)r * nb + b]));
            __m512i exact = _mm512_sub_epi32(dot[r][h], off);
            acc[r][h] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(exact), acc[r][h]);
        }
    }
}

/* As VNNI's, for the 8 outputs of half `half` of a group. */
AVX2 INLINE __m256i avx2_sub_scales(const uint8_t *blk, int half) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + SC_AT + half * 16)));
}
AVX2 INLINE __m256i avx2_sub_scale(__m256i pairs, int input_half) {
    return input_half ? _mm256_srai_epi32(pairs, 16) : _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16);
}

AVX2 INLINE void avx2_values(__m256i v[4], const uint8_t *blk, int half, int input_half) {
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    const uint8_t *at = blk + half * 32;
    __m256i n0 = _mm256_loadu_si256((const __m256i *)(at + 2 * input_half * 64));
    __m256i n1 = _mm256_loadu_si256((const __m256i *)(at + (2 * input_half + 1) * 64));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(at + HIGH_AT + input_half * 64));
    v[0] = _mm256_or_si256(_mm256_and_si256(n0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
    v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), low),
                           _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
    v[2] = _mm256_or_si256(_mm256_and_si256(n1, low), _mm256_and_si256(hb, top));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), low),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
}

/* sums[r] gets sum_half sc * sum q * qa, as VNNI's dots. */
AVX2 INLINE void avx2_dots(__m256i sums[ROWS], const uint8_t *blk, int half, const int8_t *a, int K, int R) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i pairs = avx2_sub_scales(blk, half);
    for (int input_half = 0; input_half < 2; input_half++) {
        __m256i v[4];
        avx2_values(v, blk, half, input_half);
        __m256i scale = avx2_sub_scale(pairs, input_half);
        for (int r = 0; r < R; r++) {
            const int8_t *ar = a + (int64_t)r * K + 16 * input_half;
            __m256i part = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                __m256i ai = _mm256_set1_epi32(load4(ar + 4 * i));
                part = _mm256_add_epi32(part, _mm256_madd_epi16(_mm256_maddubs_epi16(v[i], ai), ones));
            }
            sums[r] = _mm256_add_epi32(sums[r], _mm256_mullo_epi32(scale, part));
        }
    }
}

AVX2 INLINE void avx2_epilogue(__m256 acc[ROWS], __m256i sums[ROWS], const uint8_t *blk, int half, qrows q,
                               int nb, int b, int R) {
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + D_AT + half * 16)));
    __m256i pairs = avx2_sub_scales(blk, half);
    for (int r = 0; r < R; r++) {
        __m256i shp = _mm256_set1_epi32(sh_pair(q.sh + 2 * ((int64_t)r * nb + b)));
        __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(pairs, shp), 5);
        __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(q.da[(int64_t)r * nb + b]));
        acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(_mm256_sub_epi32(sums[r], off)), acc[r]);
    }
}
#endif

BLOCK_ENTRY_POINTS(tp_q6_paths, tp_q6_linear)

/* (d * sc) * (q - 32), every product exact in float32: the same bits as dequantize_six_bit's. */
static inline void dequantize_block(const uint8_t *blk, int o, float *row) {
    float d = load_half(blk + D_AT + 2 * o);
    for (int k = 0; k < BLOCK; k++)
        row[k] = d * (float)(int8_t)blk[SC_AT + 2 * o + k / 16] * (float)(value_at(blk, o, k) - 32);
}
