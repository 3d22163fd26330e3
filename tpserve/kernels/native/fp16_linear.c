/* float16 weights times float32 rows, float32 sums, each output's arithmetic fixed by the code: the
 * int8 format's down_proj (tpserve/kernels/int8_linear.py's Fp16Weight).
 *
 * For every row t and output n, in this order and no other,
 *     acc = 0;  for k = 0, 1, ..., K-1:  acc = fmaf(x[t,k], (float)w[n,k], acc)
 * and out[t,n] = acc. A float16 converts to float32 exactly, and each step is one fused multiply-add
 * of one output's own chain: the vector paths put outputs side by side in their lanes (16 outputs a
 * group, one group's 16 values of input k contiguous), never inputs, so they add nothing across a
 * lane and give the scalar loop's bits on AVX-512, AVX2 and no vector unit alike. A row's chain reads
 * only that row, so its bits never depend on the rows beside it or on how many there are: batch
 * invariance by construction, on any CPU, where FBGEMM's float16 product picks its kernel (and so its
 * rounding) by the number of rows on an AVX2 CPU.
 *
 * Layout: ceil(N / 16) groups of [K][16] float16 (outputs past N are zeros and never stored). A tile is
 * R rows by NG groups, their accumulators in registers, the weight read once per tile; enough chains
 * are in flight at once (R * NG * 16 outputs) to hide the multiply-add's latency at one row.
 */
#include "block_quantize.h" /* load_half: a float16 as float32, exact */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GROUP 16 /* outputs per group */

enum { FP16_AUTO = 0, FP16_SCALAR = 1, FP16_AVX2 = 2, FP16_AVX512 = 3 };

static void scalar_rows(const float *x, int64_t x_stride, int num_rows, int K, const uint8_t *w, int N,
                        float *out) {
    for (int t = 0; t < num_rows; t++)
        for (int n = 0; n < N; n++) {
            const uint8_t *col = w + ((int64_t)(n / GROUP) * K * GROUP + n % GROUP) * 2;
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc = fmaf(x[t * x_stride + k], load_half(col + (int64_t)k * GROUP * 2), acc);
            out[(int64_t)t * N + n] = acc;
        }
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
/* Registers a tile shape may name: R * NG (AVX-512) or R * NG * 2 (AVX2); the shapes run use 8. */
#define MAX_ACC 16

/* R rows from x by NG groups from g0's weight wg (group stride K * 16 values); R and NG constants. */
AVX512 INLINE void avx512_tile(const float *x, int64_t x_stride, int K, const uint16_t *wg, int R, int NG,
                               float *out, int N, int n0) {
    __m512 acc[MAX_ACC];
    for (int i = 0; i < R * NG; i++) acc[i] = _mm512_setzero_ps();
    int64_t gs = (int64_t)K * GROUP;
    for (int k = 0; k < K; k++) {
        __m512 v[MAX_ACC];
        for (int h = 0; h < NG; h++)
            v[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wg + h * gs + (int64_t)k * GROUP)));
        for (int r = 0; r < R; r++) {
            __m512 a = _mm512_set1_ps(x[r * x_stride + k]);
            for (int h = 0; h < NG; h++) acc[r * NG + h] = _mm512_fmadd_ps(a, v[h], acc[r * NG + h]);
        }
    }
    for (int h = 0; h < NG; h++) {
        int n = n0 + h * GROUP, left = N - n;
        __mmask16 keep = left >= GROUP ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (int64_t)r * N + n, keep, acc[r * NG + h]);
    }
}

/* The same tile in 8-lane halves: group h's outputs 8j..8j+7 in acc[(r * NG + h) * 2 + j]. */
AVX2 INLINE void avx2_tile(const float *x, int64_t x_stride, int K, const uint16_t *wg, int R, int NG,
                           float *out, int N, int n0) {
    __m256 acc[MAX_ACC];
    for (int i = 0; i < R * NG * 2; i++) acc[i] = _mm256_setzero_ps();
    int64_t gs = (int64_t)K * GROUP;
    for (int k = 0; k < K; k++) {
        __m256 v[MAX_ACC];
        for (int h = 0; h < NG; h++)
            for (int j = 0; j < 2; j++)
                v[h * 2 + j] = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(wg + h * gs + (int64_t)k * GROUP + 8 * j)));
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_set1_ps(x[r * x_stride + k]);
            for (int i = 0; i < NG * 2; i++)
                acc[r * NG * 2 + i] = _mm256_fmadd_ps(a, v[i], acc[r * NG * 2 + i]);
        }
    }
    for (int h = 0; h < NG; h++)
        for (int j = 0; j < 2; j++) {
            int n = n0 + h * GROUP + 8 * j, left = N - n;
            for (int r = 0; r < R; r++) {
                float *o = out + (int64_t)r * N + n;
                if (left >= 8) {
                    _mm256_storeu_ps(o, acc[(r * NG + h) * 2 + j]);
                } else if (left > 0) {
                    float part[8];
                    _mm256_storeu_ps(part, acc[(r * NG + h) * 2 + j]);
                    memcpy(o, part, (size_t)left * sizeof(float));
                }
            }
        }
}

/* Tiles of up to 4 rows by 2 groups (AVX-512) or by 1 group (AVX2); one row or two take more groups
 * at once, so that 8 chains are in flight. The shapes are constants where the tile is inlined. */
#define TILES(TARGET, PREFIX, TILE, NG1, NG2, NG4)                                                          \
    TARGET static void PREFIX##_rows(const float *x, int64_t x_stride, int num_rows, int K,                 \
                                     const uint16_t *w, int N, float *out) {                                \
        int num_groups = (N + GROUP - 1) / GROUP;                                                           \
        int64_t gs = (int64_t)K * GROUP;                                                                    \
        for (int t = 0; t < num_rows; t += 4) {                                                             \
            int R = num_rows - t < 4 ? num_rows - t : 4;                                                    \
            const float *xr = x + t * x_stride;                                                             \
            float *o = out + (int64_t)t * N;                                                                \
            int step = R == 1 ? NG1 : R == 2 ? NG2 : NG4;                                                   \
            for (int g = 0; g < num_groups; g += step) {                                                    \
                int ng = num_groups - g < step ? num_groups - g : step;                                     \
                const uint16_t *wg = w + g * gs;                                                            \
                int n0 = g * GROUP;                                                                         \
                switch (R * 8 + ng) {                                                                       \
                case 8 + 1: TILE(xr, x_stride, K, wg, 1, 1, o, N, n0); break;                               \
                case 8 + 2: TILE(xr, x_stride, K, wg, 1, 2, o, N, n0); break;                               \
                case 8 + 3: TILE(xr, x_stride, K, wg, 1, 3, o, N, n0); break;                               \
                case 8 + 4: TILE(xr, x_stride, K, wg, 1, 4, o, N, n0); break;                               \
                case 16 + 1: TILE(xr, x_stride, K, wg, 2, 1, o, N, n0); break;                              \
                case 16 + 2: TILE(xr, x_stride, K, wg, 2, 2, o, N, n0); break;                              \
                case 24 + 1: TILE(xr, x_stride, K, wg, 3, 1, o, N, n0); break;                              \
                case 24 + 2: TILE(xr, x_stride, K, wg, 3, 2, o, N, n0); break;                              \
                case 32 + 1: TILE(xr, x_stride, K, wg, 4, 1, o, N, n0); break;                              \
                default: TILE(xr, x_stride, K, wg, 4, 2, o, N, n0); break;                                  \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

/* AVX-512: a group is one register; 1 row x 4 groups, then 2 to 4 rows x 2. */
TILES(AVX512, avx512, avx512_tile, 4, 2, 2)
/* AVX2: a group is two registers; 1 row x 4 groups, 2 x 2, then 3 or 4 rows x 1. */
TILES(AVX2, avx2, avx2_tile, 4, 2, 1)
#endif

/* Bit i set: path i runs on this CPU (FP16_SCALAR always). */
int tp_fp16_paths(void) {
    int paths = 1 << FP16_SCALAR;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        paths |= 1 << FP16_AVX2;
    if (__builtin_cpu_supports("avx512f")) paths |= 1 << FP16_AVX512;
#endif
    return paths;
}

/* out [T, N] = x [T, K] (row stride x_stride) times the packed weight w; path FP16_AUTO picks the
 * fastest here. Returns 0, or -1 where the path does not run on this CPU. */
int tp_fp16_linear(const float *x, int64_t x_stride, int num_rows, int K, const uint16_t *w, int N,
                   float *out, int path) {
    int paths = tp_fp16_paths();
    if (path == FP16_AUTO)
        path = paths & (1 << FP16_AVX512) ? FP16_AVX512 : paths & (1 << FP16_AVX2) ? FP16_AVX2 : FP16_SCALAR;
    if (path < FP16_SCALAR || path > FP16_AVX512 || !(paths & (1 << path))) return -1;
#if defined(__x86_64__)
    if (path == FP16_AVX512) {
        avx512_rows(x, x_stride, num_rows, K, w, N, out);
        return 0;
    }
    if (path == FP16_AVX2) {
        avx2_rows(x, x_stride, num_rows, K, w, N, out);
        return 0;
    }
#endif
    scalar_rows(x, x_stride, num_rows, K, (const uint8_t *)w, N, out);
    return 0;
}
