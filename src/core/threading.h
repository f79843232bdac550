// OpenMP without the #ifdefs: the thread count a parallel region gets and the calling thread's
// index inside one (both 1 / 0 in a build without OpenMP), for carving per-thread scratch.
#pragma once
#ifdef _OPENMP
#include <omp.h>
#endif

namespace dm {

// Threads an `omp parallel` region would use (omp_get_max_threads; 1 without OpenMP).
int num_threads();

// Index of the calling thread in the innermost parallel region (0 outside one, or without OpenMP).
inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace dm
