/* Software prefetch of a weight row a few rows ahead of the one being multiplied: the matmul loop
 * walks rows in order, and streaming int8/int4 rows from RAM otherwise stalls on each one.
 * Always inlined: GCC may drop a call to an out-of-line function whose only effect is prefetching.
 * Locality 2 (prefetcht1, into L2): decoding the bench fixture with its experts in the file's
 * plain layout ran 1.10x faster than with prefetchnta (locality 0) and 1.18x faster than with
 * prefetcht0 (in-process A/B, 30 rounds, AMD EPYC). One prefetch per 128-byte pair of lines (the
 * adjacent-line prefetcher brings the other line): int8 1.09x, int4 1.02x over one per 64-byte line.
 * The pairs are counted from the one that holds p: stepping 128 bytes from a p in the second line of
 * a pair would fetch only lines already read and their successors never (decode 0.87x with 64-byte
 * aligned rows, before the rounding). */
#ifndef COLI_PREFETCH_H
#define COLI_PREFETCH_H
#include <stddef.h>
#include <stdint.h>

static inline __attribute__((always_inline)) void coli_prefetch_row(const void *p, ptrdiff_t nbytes)
{
#if defined(__GNUC__)
    /* from the 128-byte pair that holds p: one prefetch per pair, whatever p's alignment */
    const char *c = (const char *)((uintptr_t)p & ~(uintptr_t)127), *end = (const char *)p + nbytes;
    for (; c < end; c += 128)
        __builtin_prefetch(c, 0, 2);
#else
    (void)p; (void)nbytes;
#endif
}
#endif
