/* RMS norm of float32 rows, each row's reduction order fixed by the code: the squares summed in 16
 * partial sums by column mod 16, then a fixed tree; y = (x * (1 / sqrt(mean + eps))) * weight.
 * A row's bits depend on that row only. x: [num_rows, num_cols] rows of stride x_stride; y:
 * [num_rows, num_cols] contiguous. */
#include <math.h>
#include <stdint.h>

#define W 16

void tp_rms_norm(const float *x, int64_t num_rows, int64_t num_cols, int64_t x_stride, const float *weight,
                 float eps, float *y) {
    for (int64_t r = 0; r < num_rows; r++) {
        const float *in = x + r * x_stride;
        float part[W] = {0};
        int64_t c = 0;
        for (; c + W <= num_cols; c += W)
            for (int i = 0; i < W; i++) part[i] += in[c + i] * in[c + i];
        for (; c < num_cols; c++) part[c % W] += in[c] * in[c];
        for (int s = W / 2; s > 0; s /= 2)
            for (int i = 0; i < s; i++) part[i] += part[i + s];
        float scale = 1.0f / sqrtf(part[0] / (float)num_cols + eps);
        float *out = y + r * num_cols;
        for (c = 0; c < num_cols; c++) out[c] = (in[c] * scale) * weight[c];
    }
}
