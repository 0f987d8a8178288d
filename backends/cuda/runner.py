"""The CUDA-graph backend: one `torch.cuda.CUDAGraph` per bucket, replayed on every call.

Call path (the shared Runner does validation, bucketing, overflow and slicing):
    encode descriptors (+ host inputs) into pinned memory → one async H2D copy →
    [pack launch + prepare hook, when there is a hook] → graph.replay() → static outputs.
Without a prepare hook the pack kernel is captured INTO each graph, so a call launches nothing
but the copy and the replay. With a hook the pack runs first so the hook sees the padded view.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from padgraph.errors import ContractRuntimeError, where
from padgraph.runtime import Runner
from padgraph.view import PaddedView

from ..triton import pack as tpack
from .capture import capture_ladder
from .staging import Packer, StaticInputs

log = logging.getLogger("padgraph.cuda")


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    view: PaddedView
    outputs: Mapping[str, torch.Tensor]


class CudaGraphRunner(Runner):
    """pg.compile(..., backend="cuda"). Options: device, pool (a graph pool handle, or another
    CudaGraphRunner to share its pool — opt-in: the runners' graphs must then never replay
    concurrently, and outputs of one may be overwritten by the other's replays), warmup (eager
    runs per bucket before capture, default 2), progress (None = a bar when stderr is a tty)."""

    backend = "cuda"
    allow_host_inputs = True

    def __init__(self, program, body, *, state=None, prepare=None, overflow="eager", copy_outputs=False,
                 device=None, pool=None, warmup: int = 2, progress: bool | None = None):
        if not torch.cuda.is_available():
            raise ContractRuntimeError(
                f"{where(program.name)}: backend 'cuda' needs an NVIDIA GPU and a CUDA build of torch "
                f"(torch.cuda.is_available() is False); use backend='reference' on this machine")
        super().__init__(program, body, state=state, prepare=prepare, overflow=overflow,
                         copy_outputs=copy_outputs, device=device)
        if self.device is None or self.device.type != "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.static = StaticInputs(self.plan, self.device)
        self.packer = Packer(self.static)
        self.use_triton = tpack.triton_available()
        self.pack_in_graph = self.use_triton and prepare is None
        if isinstance(pool, CudaGraphRunner):
            pool = pool.pool
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device):
            self._graphs: dict[int, _Bucket] = capture_ladder(self, warmup, progress)

    # ---- what capture_ladder needs ------------------------------------------------------------
    def view(self, bucket: int) -> PaddedView:
        buffers = dict(self.static.views(bucket))
        buffers.update(self.state.values)
        return PaddedView(self.program.name, bucket, buffers, self.static.extents)

    def pack_all_pad(self, bucket: int) -> None:
        """Before warm-up/capture: every lane holds its pad value (legal indices, lengths)."""
        zero_ext = {a: 0 for a in self.static.axes}
        empty = {}
        for name, t in self.static.storage.items():
            for d in self.static.pad_dims(name):
                t = t.narrow(d, 0, 0)
            empty[name] = t
        self._pack(bucket, empty, zero_ext, launch=True)

    def own_outputs(self, outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outputs that alias a static input or bound state get their own copy in the graph
        (rule 6.3): otherwise the next pack, or the body's next state write, would change them."""
        shared = {t.untyped_storage().data_ptr() for t in self.static.storage.values()}
        shared |= {t.untyped_storage().data_ptr() for _, t in self.state.named()}
        return {n: t.clone() if t.untyped_storage().data_ptr() in shared else t for n, t in outs.items()}

    def packs_in_graph(self, bucket: int) -> None:
        if self.pack_in_graph:
            self.packer.launch(bucket)

    # ---- call path ----------------------------------------------------------------------------
    def _pack(self, bucket: int, raw, ext, launch: bool) -> None:
        pk = self.packer
        slot, used, keep = pk.encode(bucket, raw, ext)
        pk.send(slot, used)
        if self.static.other:
            pk.pad_others(bucket, raw)
        if not launch:
            return
        if self.use_triton:
            pk.launch(bucket)
        else:
            pk.reference_pack(bucket, raw, ext)

    def _run(self, bucket, raw, ext):
        g = self._graphs[bucket]
        self._pack(bucket, raw, ext, launch=not self.pack_in_graph)
        if self.prepare is not None:
            self.prepare(g.view)
        g.graph.replay()
        return g.outputs

    def capture_report(self) -> str:
        """Per bucket: capture seconds and pool bytes, as a table (data in stats.capture)."""
        rows = ["bucket  capture s  pool MiB (cumulative)"]
        for b in sorted(self.stats.capture):
            c = self.stats.capture[b]
            rows.append(f"{b:>6}  {c['seconds']:>9.3f}  {c['pool_bytes'] / 2**20:>10.1f}")
        total = sum(c["seconds"] for c in self.stats.capture.values())
        rows.append(f"total {total:.2f} s, pool {self.pool_bytes() / 2**20:.1f} MiB")
        return "\n".join(rows)

    def pool_bytes(self) -> int:
        return max((c["pool_bytes"] for c in self.stats.capture.values()), default=0)
