/* 4-bit weights with float32 block scales (GGUF's Q4_K, d * sc and -dmin * mn per block of 32) times
 * 8-bit activations: the layout and arithmetic are q4_blocks.h's, with 384 bytes per (group, block). */
#define SCALE_BYTES 4
#define Q4_PATHS tp_q4f_paths
#define Q4_LINEAR tp_q4f_linear
#include "q4_blocks.h"
