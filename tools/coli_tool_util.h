/* Helpers shared by the C tools (kernel_bench.c, matvec_bench.c, kernel_selftest.c): a
 * deterministic random stream and a monotonic clock. A tool may seed g_rng before use. */
#ifndef COLI_TOOL_UTIL_H
#define COLI_TOOL_UTIL_H

#include <stdint.h>
#include <time.h>

static uint64_t g_rng = 0x243F6A8885A308D3ULL;

static inline uint32_t rnd(void) /* xorshift64* */
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545F4914F6CDD1DULL) >> 32);
}

static inline double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

#endif
