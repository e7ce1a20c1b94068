"""Giving back a thread's OpenMP workers, so the thread that steps the model keeps its barriers fast.

torch's CPU ops and our kernels share one OpenMP runtime (libgomp: torch ships it, and our
extensions link it by the same name, so the process loads it once). libgomp keeps a pool of
worker threads for every thread that has ever started a parallel region, for as long as that
thread lives. Once it manages more threads than the CPUs it may run on, it cuts every barrier's
spin-wait from 300,000 iterations to 100 before sleeping on a futex (its "throttled" spin count,
with OMP_WAIT_POLICY and GOMP_SPINCOUNT unset), so each of the many barriers in a decode step
waits for a wake-up instead of a spin.

That is what happens when a model is built on one thread and stepped on another, as the server
does (main thread, then its scheduler thread): two pools, four threads on two cores. Plain
decoding of the default target took 41.5 ms a generated token on a second thread against 35.9 ms
there once the first thread's pool was given back, and 35.8 ms on the thread that built it
(`python scripts/thread_pools.py`: medians of 5 rounds of the three cases in turn, 96 tokens
each; AMD EPYC Zen 4, 2 cores, 2026-11-28); docs/SERVING.md has what it did to the server.

``omp_pause_resource_all`` (OpenMP 5.0) frees, in libgomp, the calling thread's pool only; its
next parallel region, if any, starts a new one. So a thread calls ``release_pool`` when it is
done with parallel work that another thread will carry on.
"""

from __future__ import annotations

import ctypes
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state
_pause_all = None  # libgomp's omp_pause_resource_all, once found


def _find_pause_all():  # noqa: ANN202 - a ctypes function, or None
    """The loaded libgomp's ``omp_pause_resource_all``. RTLD_NOLOAD: only a libgomp already in the
    process (torch's) is asked, never a second copy loaded for the purpose; none loaded yet means
    no thread has started a pool. None also where torch runs another OpenMP runtime, or a libgomp
    older than OpenMP 5.0 (GCC 9)."""
    global _pause_all
    if _pause_all is None:
        try:
            fn = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_pause_resource_all
        except (OSError, AttributeError):
            return None
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        _pause_all = fn
    return _pause_all


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp frees that thread's pool only; its
    next parallel region starts a new one). True if libgomp did; False where no libgomp is loaded,
    or the call is made inside a parallel region."""
    fn = _find_pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0
