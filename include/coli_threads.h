/* Thread-count helpers that compile with or without OpenMP. */
#ifndef COLI_THREADS_H
#define COLI_THREADS_H
#ifdef _OPENMP
#include <omp.h>
static inline int coli_max_threads(void) { return omp_get_max_threads(); }
static inline void coli_set_threads(int n) { if (n > 0) omp_set_num_threads(n); }
static inline int coli_has_openmp(void) { return 1; }
#else
static inline int coli_max_threads(void) { return 1; }
static inline void coli_set_threads(int n) { (void)n; }
static inline int coli_has_openmp(void) { return 0; }
#endif
#endif
