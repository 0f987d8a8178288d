"""Triton's once-per-process setup, started in the background when the kernels are imported.

A process's first Triton kernel launch pays for setup that no kernel choice changes. Measured
with `bench.triton_compile_times` (cProfile, Triton 3.6, on an H200 host): hashing Triton's own
install for the compile-cache key (`triton_key`, libtriton.so included: 0.5-0.7 s, every
process, cached kernels or not), building and loading its CUDA utility module (a C compiler run
with an empty cache: 0.47 s) and importing its Gluon front end (0.12-0.16 s). Compiling a kernel
(MLIR passes, ptxas) took ~0.3 s a kernel, and building each kernel's launcher another ~0.4 s.

None of that setup touches the GPU: hashing and the C compiler release the GIL, so a thread does
it while the process goes on (importing the model, loading weights) instead of in front of the
first capture. The thread only fills Triton's own caches (`triton_key` is an lru_cache, the
driver a lazily built singleton, the utility module a file in Triton's cache): if the main
thread needs one first it computes it itself, as it would without the thread. It never runs
under TRITON_INTERPRET=1, without CUDA, or with PADGRAPH_TRITON_PREWARM=0.
"""
from __future__ import annotations

import os
import threading

_thread: threading.Thread | None = None
_lock = threading.Lock()


def _setup() -> None:
    try:
        from triton.runtime.cache import triton_key
        from triton.runtime.driver import driver
        triton_key()
        driver.active.utils  # noqa: B018 - builds / loads the CUDA utility module
        import triton.experimental.gluon  # noqa: F401
    except Exception:  # noqa: BLE001 - best effort: the first launch does it otherwise
        pass


def wanted() -> bool:
    if os.environ.get("PADGRAPH_TRITON_PREWARM", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def start() -> threading.Thread | None:
    """Start the setup thread once per process (None where it is not wanted)."""
    global _thread
    with _lock:
        if _thread is None and wanted():
            _thread = threading.Thread(target=_setup, name="padgraph-triton-prewarm", daemon=True)
            _thread.start()
        return _thread
