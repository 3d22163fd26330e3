/* 5-bit weights with float32 block scales (GGUF's Q5_K, d * sc and -dmin * mn per block of 32) times
 * 8-bit activations: the arithmetic is q4_blocks.h's, a fifth bit beside each nibble, 448 bytes
 * per (group, block). */
#define SCALE_BYTES 4
#define FIFTH_BITS
#define Q4_PATHS tp_q5f_paths
#define Q4_LINEAR tp_q5f_linear
#include "q4_blocks.h"
