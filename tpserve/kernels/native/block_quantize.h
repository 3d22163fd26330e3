/* What the block kernels (q4_linear.c, q8_linear.c, q6_linear.c) share: how an input row is quantized per block of
 * 32, how a float16 block scale is read, and which code paths this CPU runs.
 *
 * An input row t is quantized per block on its own: da[t,b] = absmax / 127, qa = rint(x * (1 / da))
 * in -127..127 (llama.cpp's Q8_1), sa[t,b] = sum_i qa[t,b,i], and sh[t,2b+h] the same sum over half h
 * (inputs 16h..16h+15) alone, for a weight with a scale per 16 inputs (GGUF's Q6_K). A kernel built from this header
 * thus sees the very integers every other one sees for the same row. tpserve/kernels/native.py hashes this
 * header with each source, so a change here rebuilds both.
 */
#ifndef TP_BLOCK_QUANTIZE_H
#define TP_BLOCK_QUANTIZE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32 /* inputs per block */

enum { PATH_AUTO = 0, PATH_SCALAR = 1, PATH_AVX2 = 2, PATH_AVX512_VNNI = 3 };

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The float16 at p as a float32: exact for every value (a subnormal is mant * 2^-24, exact too). */
static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else {
        float sub = (float)mant * 0x1p-24f;
        memcpy(&bits, &sub, sizeof bits);
        bits |= sign;
    }
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* x: [T, K] (row stride x_stride floats) -> qa [T, K], da [T, nb], and where not NULL ms [T, nb] =
 * da * (float)sa, sa [T, nb] and sh [T, 2 nb] (sa per half block). Written so the compiler vectorizes it: the absmax as the largest |x|
 * bit pattern (a NaN counts as infinity), then qa = rint(x * (1 / da)) as llama.cpp's Q8_1 (one
 * division a block), clamped so that no conversion is undefined. */
static void quantize_rows(const float *x, int64_t x_stride, int num_rows, int K, int8_t *qa, float *da,
                          float *ms, int32_t *sa, int32_t *sh) {
    int nb = K / BLOCK;
    for (int t = 0; t < num_rows; t++) {
        for (int b = 0; b < nb; b++) {
            const float *v = x + t * x_stride + b * BLOCK;
            int8_t *q = qa + (int64_t)t * K + b * BLOCK;
            uint32_t bits[BLOCK], top = 0;
            memcpy(bits, v, sizeof bits);
            for (int i = 0; i < BLOCK; i++) {
                uint32_t a = bits[i] & 0x7fffffffu;
                a = a < 0x7f800000u ? a : 0x7f800000u;
                top = a > top ? a : top;
            }
            float absmax;
            memcpy(&absmax, &top, sizeof absmax);
            float scale = absmax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int halves[2] = {0, 0};
            for (int h = 0; h < 2; h++)
                for (int i = h * BLOCK / 2; i < (h + 1) * BLOCK / 2; i++) {
                    float r = v[i] * inv;
                    r = r >= -127.0f ? r : -127.0f; /* a NaN becomes -127 */
                    r = r <= 127.0f ? r : 127.0f;
                    q[i] = (int8_t)(int)rintf(r);
                    halves[h] += q[i];
                }
            int sum = halves[0] + halves[1];
            da[(int64_t)t * nb + b] = scale;
            if (ms) ms[(int64_t)t * nb + b] = scale * (float)sum;
            if (sa) sa[(int64_t)t * nb + b] = sum;
            if (sh) memcpy(sh + 2 * ((int64_t)t * nb + b), halves, sizeof halves);
        }
    }
}

/* Bit i set: path i runs on this CPU (PATH_SCALAR always). AVX2 reads the float16 scales with F16C. */
static int cpu_paths(void) {
    int paths = 1 << PATH_SCALAR;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        paths |= 1 << PATH_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        paths |= 1 << PATH_AVX512_VNNI;
#endif
    return paths;
}

/* The path to run for `path` (PATH_AUTO: the fastest here), or -1 where it does not run here. */
static int pick_path(int path) {
    int paths = cpu_paths();
    if (path == PATH_AUTO)
        path = paths & (1 << PATH_AVX512_VNNI) ? PATH_AVX512_VNNI
               : paths & (1 << PATH_AVX2)      ? PATH_AVX2
                                               : PATH_SCALAR;
    if (path < PATH_SCALAR || path > PATH_AVX512_VNNI || !(paths & (1 << path))) return -1;
    return path;
}

#endif
