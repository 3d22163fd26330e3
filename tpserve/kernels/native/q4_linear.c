/* 4-bit weights with float16 block scales (GGUF's Q4_0 and Q4_1) times 8-bit activations: the layout
 * and arithmetic are q4_blocks.h's, with 320 bytes per (group, block). */
#define SCALE_BYTES 2
#define Q4_PATHS tp_q4_paths
#define Q4_LINEAR tp_q4_linear
#include "q4_blocks.h"
