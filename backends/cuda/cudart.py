"""The per-call async copy and its event, through the CUDA runtime torch itself loaded.

`Tensor.copy_(non_blocking=True)` plus `Event.record()` cost ~7 µs of host time per call in
torch's dispatch; the same cudaMemcpyAsync + cudaEventRecord through ctypes cost ~1-2 µs. The
runtime is found in this process's mappings (the libcudart torch links), so the context, the
streams and the events are torch's own. Where it cannot be found, `TorchCopier` does the same
through torch. Both are chosen once, when a runner is built.

A copier `bind`s one (device block, pinned slot) pair once: the call path then runs its
`send(nbytes)`, whose fixed arguments are already converted, and gets the stream it queued on.
Events fence those copies (`record(event, stream)`, `query(event)`; see staging._Ring).
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
    """The libcudart this process mapped, its functions typed."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return typed(ctypes.CDLL(path))
        except (OSError, AttributeError):
            continue
    return None


def typed(lib):
    """`lib` with the argument and result types of the runtime functions a copier calls."""
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
    lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


class RuntimeCopier:
    """cudaMemcpyAsync / cudaEventRecord / cudaEventQuery by ctypes (events are raw handles)."""

    name = "cudart"

    def __init__(self, lib, device: torch.device):
        self.lib, self.index = lib, device.index
        # the same functions, untyped: called with ctypes values made once (argtypes would
        # convert every argument on every call). Every argument must then be a ctypes value of
        # the C type's width: a bare Python int would pass as a 32-bit int.
        self._bare = ctypes.CDLL(lib._name)
        self._streams: dict[int, ctypes.c_void_p] = {}    # raw stream handle -> its ctypes value

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: {self.lib.cudaGetErrorString(err).decode()} ({err})")

    def new_event(self):
        ev = ctypes.c_void_p()
        self._check(self.lib.cudaEventCreateWithFlags(ctypes.byref(ev), _DISABLE_TIMING), "cudaEventCreateWithFlags")
        return ev.value

    def bind(self, dst: torch.Tensor, src: torch.Tensor):
        """send(nbytes): queue the copy of src's first `nbytes` bytes to dst on the current
        stream (async); returns that stream's handle."""
        memcpy = self._bare.cudaMemcpyAsync
        d, s, h2d = ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()), ctypes.c_int(_H2D)
        stream_of, index, streams = torch._C._cuda_getCurrentRawStream, self.index, self._streams
        sizes: dict[int, ctypes.c_size_t] = {}

        def send(nbytes: int) -> int:
            handle = stream_of(index)
            stream = streams.get(handle)
            if stream is None:
                stream = _cached(streams, handle, ctypes.c_void_p)
            n = sizes.get(nbytes)
            if n is None:                 # sizes differ only where host inputs are staged
                n = _cached(sizes, nbytes, ctypes.c_size_t)
            err = memcpy(d, s, n, h2d, stream)
            if err:
                self._check(err, "cudaMemcpyAsync")
            return handle

        return send

    def current_stream(self) -> int:
        """The raw handle of the stream a `send` now would queue on."""
        return torch._C._cuda_getCurrentRawStream(self.index)

    def record(self, event, stream: int) -> None:
        """Record `event` on `stream` (a raw handle `send` returned)."""
        self._check(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def query(self, event) -> bool:
        """Whether the work queued before `event`'s last record has run (never recorded: True)."""
        err = self.lib.cudaEventQuery(event)
        if err == _NOT_READY:
            return False
        self._check(err, "cudaEventQuery")
        return True

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        n = src.element_size() * src.numel()
        self._check(self.lib.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, _D2D, stream), "cudaMemcpyAsync")


def _cached(cache: dict, key: int, ctype):
    """ctype(key), kept in `cache` while it holds few (a program may use many streams or sizes)."""
    value = ctype(key)
    if len(cache) < 64:
        cache[key] = value
    return value


class TorchCopier:
    """The same through torch: Tensor.copy_(non_blocking=True) and torch.cuda.Event."""

    name = "torch"

    def __init__(self, device: torch.device):
        self.index = device.index
        self._streams: dict = {}      # raw handle -> the torch stream (events are recorded on it)

    def new_event(self):
        return torch.cuda.Event()

    def bind(self, dst: torch.Tensor, src: torch.Tensor):
        """send(nbytes) as RuntimeCopier's, through Tensor.copy_."""
        def send(nbytes: int) -> int:
            pair = views.get(nbytes)
            if pair is None:
                pair = views[nbytes] = (dst[:nbytes], src[:nbytes])
            pair[0].copy_(pair[1], non_blocking=True)
            handle = torch._C._cuda_getCurrentRawStream(self.index)
            if handle not in self._streams:
                self._streams[handle] = torch.cuda.current_stream(self.index)
            return handle

        views: dict[int, tuple] = {}
        return send

    def current_stream(self) -> int:
        return torch._C._cuda_getCurrentRawStream(self.index)

    def record(self, event, stream: int) -> None:
        torch._C._CudaEventBase.record(event, self._streams[stream])

    def query(self, event) -> bool:
        return event.query()

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
