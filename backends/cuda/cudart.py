"""The per-call async copy and its event, through the CUDA runtime torch itself loaded.

`Tensor.copy_(non_blocking=True)` plus `Event.record()` cost ~7 µs of host time per call in
torch's dispatch; the same cudaMemcpyAsync + cudaEventRecord through ctypes cost ~1-2 µs. The
runtime is found in this process's mappings (the libcudart torch links), so the context, the
streams and the events are torch's own. Where it cannot be found, `TorchCopier` does the same
through torch. Both are chosen once, when a runner is built.
"""
from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("padgraph.cuda")

_H2D = 1                    # cudaMemcpyHostToDevice
_D2D = 3                    # cudaMemcpyDeviceToDevice
_NOT_READY = 600            # cudaErrorNotReady
_DISABLE_TIMING = 2         # cudaEventDisableTiming


def _loaded_cudart():
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
            lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            return lib
        except (OSError, AttributeError):
            continue
    return None


class RuntimeCopier:
    """cudaMemcpyAsync / cudaEventRecord / cudaEventQuery by ctypes (events are raw handles)."""

    name = "cudart"

    def __init__(self, lib, device: torch.device):
        self.lib, self.index = lib, device.index

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: {self.lib.cudaGetErrorString(err).decode()} ({err})")

    def new_event(self):
        ev = ctypes.c_void_p()
        self._check(self.lib.cudaEventCreateWithFlags(ctypes.byref(ev), _DISABLE_TIMING), "cudaEventCreateWithFlags")
        return ev.value

    def done(self, event) -> bool:
        err = self.lib.cudaEventQuery(event)
        if err == _NOT_READY:
            return False
        self._check(err, "cudaEventQuery")
        return True

    def copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, event) -> None:
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        self._check(self.lib.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, _H2D, stream), "cudaMemcpyAsync")
        self._check(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        n = src.element_size() * src.numel()
        self._check(self.lib.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, _D2D, stream), "cudaMemcpyAsync")


class TorchCopier:
    """The same through torch: Tensor.copy_(non_blocking=True) and torch.cuda.Event."""

    name = "torch"

    def __init__(self, device: torch.device):
        self.index = device.index
        self._streams: dict = {}
        self._views: dict = {}

    def new_event(self):
        return torch.cuda.Event()

    def done(self, event) -> bool:
        return event.query()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, event) -> None:
        key = (dst.data_ptr(), src.data_ptr(), nbytes)
        pair = self._views.get(key)
        if pair is None:
            pair = self._views[key] = (dst[:nbytes], src[:nbytes])
        pair[0].copy_(pair[1], non_blocking=True)
        handle = torch._C._cuda_getCurrentRawStream(self.index)
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = torch.cuda.current_stream()
        torch._C._CudaEventBase.record(event, stream)

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


def copier(device: torch.device, prefer: str = "cudart"):
    """The fastest copier this process supports (torch's when the runtime cannot be found)."""
    if prefer == "cudart":
        lib = _loaded_cudart()
        if lib is not None:
            return RuntimeCopier(lib, device)
        log.info("padgraph: libcudart not found among this process's mappings; per-call copies go through torch")
    return TorchCopier(device)
