/* Helpers shared by the C tools (kernel_bench.c, matvec_bench.c, kernel_selftest.c): a
 * deterministic random stream, a monotonic clock and the --isa argument. A tool may seed g_rng
 * before use; include coli_kernels.h first. */
#ifndef COLI_TOOL_UTIL_H
#define COLI_TOOL_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
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

/* The ISA named name (coli_isa_name's spelling) if this CPU runs it, else -1 after saying why. */
static inline int tool_isa(const char *name)
{
    for (int k = COLI_ISA_SCALAR; k <= COLI_ISA_AVX512VNNI; k++)
        if (!strcmp(name, coli_isa_name(k)) && k <= coli_isa_best())
            return k;
    fprintf(stderr, "ISA %s unknown or not supported here\n", name);
    return -1;
}

#endif
