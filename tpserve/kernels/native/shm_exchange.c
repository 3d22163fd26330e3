/* One step of the shared-memory collectives (tpserve/kernels/shared_memory.py) in one call: publish
 * this rank's float32 part, wait for every peer's, and sum the parts in rank order into the caller's
 * tensor. In Python the same step costs some 30-60 us of interpreter and dispatch time (a copy, a
 * store, a spin of numpy reads, an add of two views), 61 times a decode step; here a few us.
 *
 * The segment's layout is the Python module's (its docstring): a header whose 64-byte line r + 1
 * holds the last step rank r published, then two buffers of one slot per rank; step s uses buffer
 * s % 2. A part is copied into this rank's slot before its step number is stored (a release store);
 * a peer's slot is read only after its step number is seen (an acquire load).
 *
 * The wait is bounded: spin (with a pause hint) for spin_s, then yield the core until yield_s into
 * the wait. A peer still missing then is returned to the caller, which sleeps, checks the peer's
 * process lives and keeps the timeout (what C cannot see), then calls tp_shm_sum_f32.
 *
 * The sum is part 0 + part 1, then + part 2 and so on, one IEEE float addition per term and
 * element: the bits torch.add gives and the Python path computes, on every rank. */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define STEPS_OFFSET 64 /* the first rank's line: the header's first 64 bytes hold the token */
#define LINE_BYTES 64

static inline void pause_hint(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int64_t *step_of(char *segment, int64_t rank) {
    return (int64_t *)(segment + STEPS_OFFSET + rank * LINE_BYTES);
}

static inline float *slot_of(char *segment, int64_t header_bytes, int64_t slot_bytes, int64_t world,
                             int64_t step, int64_t rank) {
    return (float *)(segment + header_bytes + ((step % 2) * world + rank) * slot_bytes);
}

/* The first peer that has not published `step` after the bounded wait, or -1 when all have. */
static int64_t wait_for_peers(char *segment, int64_t rank, int64_t world, int64_t step, double spin_s,
                              double yield_s) {
    double began = 0.0;
    for (int64_t peer = 0; peer < world; peer++) {
        if (peer == rank) continue;
        int64_t *published = step_of(segment, peer);
        uint32_t reads = 0;
        while (__atomic_load_n(published, __ATOMIC_ACQUIRE) < step) {
            if ((++reads & 63) != 0) {
                pause_hint();
                continue;
            }
            double now = now_s();
            if (began == 0.0) began = now;
            if (now - began >= yield_s) return peer;
            if (now - began >= spin_s) sched_yield();
        }
    }
    return -1;
}

/* The sum of step `step`'s parts into x, once the caller saw every peer publish it. */
void tp_shm_sum_f32(char *segment, int64_t header_bytes, int64_t slot_bytes, int64_t world, int64_t step,
                    float *x, int64_t count) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    const float *first = slot_of(segment, header_bytes, slot_bytes, world, step, 0);
    const float *second = slot_of(segment, header_bytes, slot_bytes, world, step, 1);
    for (int64_t i = 0; i < count; i++) x[i] = first[i] + second[i];
    for (int64_t r = 2; r < world; r++) {
        const float *part = slot_of(segment, header_bytes, slot_bytes, world, step, r);
        for (int64_t i = 0; i < count; i++) x[i] += part[i];
    }
}

/* x[0:count] (float32, at most slot_bytes / 4 elements) becomes the sum over ranks of step `step`
 * when every peer published within the wait: returns -1. Otherwise returns the peer still missing;
 * x is then unchanged until tp_shm_sum_f32. */
int64_t tp_shm_all_reduce_f32(char *segment, int64_t header_bytes, int64_t slot_bytes, int64_t rank,
                              int64_t world, int64_t step, float *x, int64_t count, double spin_s,
                              double yield_s) {
    memcpy(slot_of(segment, header_bytes, slot_bytes, world, step, rank), x, (size_t)count * sizeof(float));
    __atomic_store_n(step_of(segment, rank), step, __ATOMIC_RELEASE);
    int64_t missing = wait_for_peers(segment, rank, world, step, spin_s, yield_s);
    if (missing >= 0) return missing;
    tp_shm_sum_f32(segment, header_bytes, slot_bytes, world, step, x, count);
    return -1;
}
