/* The input of an int8 product (tpserve/kernels/int8_linear.py) in one pass: every row divided by its own
 * absmax, then the sentinel row (+1, -1, zeros) that pins the batch's quantization range to [-1, 1].
 * The same IEEE operations as the torch ops it replaces (abs, amax, clamp_min 1e-30, div, cat), so
 * its bits are theirs: x: [num_rows, num_cols] rows of stride x_stride; rows: [num_rows + 1,
 * num_cols] contiguous; absmax: [num_rows]. */
#include <math.h>
#include <stdint.h>

void tp_int8_rows(const float *x, int64_t num_rows, int64_t num_cols, int64_t x_stride, float *rows,
                  float *absmax) {
    for (int64_t r = 0; r < num_rows; r++) {
        const float *in = x + r * x_stride;
        float *out = rows + r * num_cols;
        float m = 0.0f;
        for (int64_t c = 0; c < num_cols; c++) {
            float a = fabsf(in[c]);
            m = a > m ? a : m;
        }
        m = m < 1e-30f ? 1e-30f : m;
        for (int64_t c = 0; c < num_cols; c++) out[c] = in[c] / m;
        absmax[r] = m;
    }
    float *sentinel = rows + num_rows * num_cols;
    for (int64_t c = 0; c < num_cols; c++) sentinel[c] = 0.0f;
    sentinel[0] = 1.0f;
    if (num_cols > 1) sentinel[1] = -1.0f;
}
