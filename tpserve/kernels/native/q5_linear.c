/* 5-bit weights with float16 block scales (GGUF's Q5_0 and Q5_1) times 8-bit activations: the
 * arithmetic is q4_blocks.h's, a fifth bit beside each nibble, 384 bytes per (group, block). */
#define SCALE_BYTES 2
#define FIFTH_BITS
#define Q4_PATHS tp_q5_paths
#define Q4_LINEAR tp_q5_linear
#include "q4_blocks.h"
