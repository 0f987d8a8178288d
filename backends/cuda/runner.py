"""The CUDA-graph backend: one `torch.cuda.CUDAGraph` per bucket, replayed on every call.

Call path (the shared Runner validates, buckets, handles overflow and slices):
    pack.per_call (one async copy of srcs + extents + host inputs [+ eager pack]) →
    prepare hook → graph.replay() → the bucket's static outputs.
The pack strategy (in-graph, eager, torch) is chosen once here; see staging.Pack.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from padgraph.eager import mask_outputs
from padgraph.errors import ContractRuntimeError, ContractValueError, where
from padgraph.options import Options
from padgraph.runtime import Runner
from padgraph.view import PaddedView

from ..triton import pack as tpack
from .capture import Steps, capture_ladder
from .staging import Pack, StaticInputs

log = logging.getLogger("padgraph.cuda")


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    view: PaddedView
    outputs: Mapping[str, torch.Tensor]
    replay: Callable[[], None] = field(init=False)      # graph.replay, bound once

    def __post_init__(self):
        self.replay = _replay_of(self.graph)


def _replay_of(graph) -> Callable[[], None]:
    """graph.replay, bound once. Where torch's Python `replay` does nothing but check an
    input-liveness tracker that is off (it runs only after `capture_begin(check_input_liveness=True)`,
    which padgraph never passes) before the C++ replay, that C++ replay: one frame less a call."""
    base = getattr(torch._C, "_CUDAGraph", None)
    wrapper = getattr(type(graph).replay, "__code__", None)
    if (base is not None and isinstance(graph, base) and getattr(graph, "_tracker", None) is None
            and wrapper is not None and set(wrapper.co_names) <= _TRACKER_ONLY):
        return base.replay.__get__(graph)
    return graph.replay


# every name torch's CUDAGraph.replay reads when it only checks the tracker, then replays
_TRACKER_ONLY = frozenset({"_tracker", "check_alive", "pool", "super", "replay"})


def _no_hook(x) -> None:
    return None


_STRATEGIES = ("in-graph", "eager", "torch")


def _strategy(program: str, pack: str, prepare) -> str:
    """The pack strategy: `pack=` by name, or "auto" (in-graph unless a prepare hook must see the
    packed view first; torch ops where Triton is absent)."""
    if pack not in ("auto", *_STRATEGIES):
        raise ContractValueError(f"{where(program)}: pack must be 'auto' or one of {list(_STRATEGIES)}, got {pack!r}")
    if pack == "auto":
        pack = "eager" if prepare is not None else "in-graph"
    if pack == "in-graph" and prepare is not None:
        raise ContractValueError(f"{where(program)}: pack must be 'eager' or 'torch' with a prepare hook (the hook "
                                 f"reads the packed view before the replay), got 'in-graph'")
    if pack != "torch" and not tpack.triton_available():
        return "torch"
    return pack


@dataclass(frozen=True)
class CudaOptions(Options):
    """The cuda backend's options, beyond every backend's (`Options`).

    pool: a graph pool handle, or another CudaGraphRunner to share its pool (opt-in: the
        runners' graphs must then never replay concurrently, and outputs of one may be
        overwritten by the other's replays).
    warmup: eager runs per bucket before capture (default 2).
    progress: a capture progress bar (None: when stderr is a tty).
    restore_state: True (default): bound state is copied before warm-up and capture and restored
        after, so compile leaves it as it found it; False for state too large to copy twice.
    copy: "cudart" (the per-call copy through the CUDA runtime by ctypes, ~1 µs; falls back to
        "torch" where the runtime cannot be found) or "torch" (through Tensor.copy_).
    pack: "auto" ("in-graph" without a prepare hook, "eager" with one, "torch" without Triton)
        or one of those three by name: every strategy keeps the same contract (staging.Pack).
    """

    CHOICES = {**Options.CHOICES, "copy": ("cudart", "torch"), "pack": ("auto", *_STRATEGIES)}

    pool: Any = None
    warmup: int = 2
    progress: bool | None = None
    restore_state: bool = True
    copy: str = "cudart"
    pack: str = "auto"


class CudaGraphRunner(Runner):
    """pg.compile(..., backend="cuda"): one CUDA graph per bucket, replayed on every call.
    Its options are `CudaOptions`."""

    backend = "cuda"
    Options = CudaOptions
    allow_host_inputs = True
    cache_output_views = True

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")

    @classmethod
    def unavailable(cls) -> str | None:
        if not torch.cuda.is_available():
            return ("backend 'cuda' needs an NVIDIA GPU and a CUDA build of torch "
                    f"(torch {torch.__version__}: torch.cuda.is_available() is False); use backend='reference' here")
        return None

    def __init__(self, program, body, *, state=None, **options):
        reason = self.unavailable()
        if reason is not None:
            raise ContractRuntimeError(f"{where(program.name)}: {reason}")
        super().__init__(program, body, state=state, **options)
        opts = self.options
        self.device = self._cuda_device(self.device)
        self._check_state_device()
        self.static = StaticInputs(self.plan, self.device)
        strategy = _strategy(program.name, opts.pack, opts.prepare)
        with torch.cuda.device(self.device):
            self.pack = Pack(self.plan, self.static, self.device, strategy, opts.copy)
            self._hook = opts.prepare if opts.prepare is not None else _no_hook
            pool = opts.pool.pool if isinstance(opts.pool, CudaGraphRunner) else opts.pool
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            self.options = dataclasses.replace(opts, pool=self.pool)   # the handle, not another runner
            self._graphs = self._capture(opts.warmup, opts.progress, opts.restore_state)
        if not self.pack.native_device_extents:   # nd inputs along a device axis, or no Triton
            self._run_device = functools.partial(Runner._run_device, self)

    def _canary_checker(self):
        from ..triton import canary
        if not canary.available(self.state.device() or "cuda"):
            log.warning("program %r: the canary needs Triton on CUDA; its rows are checked with torch ops",
                        self.program.name)
            return None
        return canary.checker

    def _cuda_device(self, device) -> torch.device:
        if device is None or device.type != "cuda":
            if device is not None and self.state.device() is None:
                raise ContractValueError(f"{where(self.program.name)}: backend 'cuda' runs on a CUDA device, got device={device}")
            return self.default_device()
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def _check_state_device(self) -> None:
        for label, t in self.state.named():
            if t.device != self.device:
                raise ContractValueError(
                    f"{where(self.program.name, label, 'state')}: bound state must live on the runner's device "
                    f"{self.device} (graphs read it there), got a tensor on {t.device}; move it with .to({str(self.device)!r})")

    # ---- compile -------------------------------------------------------------------------------
    def view(self, bucket: int) -> PaddedView:
        buffers = dict(self.static.views(bucket))
        buffers.update(self.state.at(bucket))
        return PaddedView(self.program.name, bucket, buffers, self.pack.extents)

    def _steps(self) -> Steps:
        def warm(bucket):
            x = self.view(bucket)
            self._hook(x)
            return self.check_outputs(self.body(x), bucket, self.device)

        def record(bucket):
            self.pack.in_graph(bucket)
            outs = self.body(self.view(bucket))
            self.check_outputs(outs, bucket, self.device)
            # lanes past a device extent hold the output's pad (x.extent: the extent used)
            outs = mask_outputs(self.program, outs, self._device_dims, self.pack.extents.__getitem__)
            return self._own_outputs(outs)

        return Steps(reset=self.pack.all_pad, warm=warm,
                     before_capture=lambda b: self._hook(self.view(b)), record=record)

    def _capture(self, warmup: int, progress, restore_state: bool) -> dict[int, _Bucket]:
        snap = self.state.snapshot() if restore_state else None
        try:
            captured = capture_ladder(self._steps(), self.plan.buckets, name=self.program.name, pool=self.pool,
                                      device=self.device, warmup=warmup, progress=progress,
                                      stats=self.stats.capture)
        finally:
            if snap is not None:
                self.state.restore(snap)
                del snap
        return {b: _Bucket(c.graph, self.view(b), c.outputs) for b, c in captured.items()}

    def _own_outputs(self, outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outputs that alias a static input or bound state get their own copy in the graph
        (rule 6.3): otherwise the next pack, or the body's next state write, would change them."""
        shared = {t.untyped_storage().data_ptr() for t in self.static.storage.values()}
        shared |= {t.untyped_storage().data_ptr() for _, t in self.state.named()}
        shared.add(self.pack.block.device_buf.untyped_storage().data_ptr())
        # detached: a body that enables grad inside returns outputs with a grad_fn (rule 10.5)
        return {n: (t.clone() if t.untyped_storage().data_ptr() in shared else t).detach() for n, t in outs.items()}

    # ---- call path -----------------------------------------------------------------------------
    def _run(self, bucket, raw, ext, dev=None):
        g = self._graphs[bucket]
        self.pack.per_call(bucket, raw, ext, dev)
        self._hook(g.view)
        self._lease.alive = False   # _end_lease(): the replay rewrites the outputs lent so far
        g.replay()
        return g.outputs

    def _run_device(self, bucket, raw, ext, dev):
        """Device extents read on the device: copied next to the host bounds, clamped by the pack."""
        return self._run(bucket, raw, ext, dev)

    def capture_report(self) -> str:
        """Per bucket: capture seconds and pool bytes, as a table (data in stats.capture)."""
        rows = [f"pack: {self.pack.strategy}", "bucket  capture s  pool MiB (cumulative)"]
        for b in sorted(self.stats.capture):
            c = self.stats.capture[b]
            rows.append(f"{b:>6}  {c['seconds']:>9.3f}  {c['pool_bytes'] / 2**20:>10.1f}")
        total = sum(c["seconds"] for c in self.stats.capture.values())
        rows.append(f"total {total:.2f} s, pool {self.pool_bytes() / 2**20:.1f} MiB")
        if self.stats.compiles:
            rows.append(f"torch.compile: {self.stats.compiles} graphs compiled, {self.stats.recompiles} recompiles, "
                        f"{self.stats.compile_seconds:.2f} s of the capture time in the calls that compiled")
        return "\n".join(rows)

    def pool_bytes(self) -> int:
        return max((c["pool_bytes"] for c in self.stats.capture.values()), default=0)
