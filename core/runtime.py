"""What every backend's runner shares: the call path around the backend's own `_run`.

validate → state guard → bucket lookup → (overflow policy) → backend `_run` → sliced outputs.
A backend subclasses Runner and implements `_run(bucket, raw, extents)` returning the padded
outputs at that bucket; it never re-implements validation, bucketing, slicing or stats.
Runners are for inference: bodies run under `torch.no_grad()`, outputs never require grad, and
nothing of a call's inputs is kept by the runner once the call's work has run.
A call that raises changes nothing: not the runner's device, stats, state or the caller's tensors.
"""
from __future__ import annotations

import threading
import warnings
from typing import Callable, Mapping

import torch

from .eager import device_axis_dims, mask_outputs, run_padded
from .canary import Canary, parse_mode
from .errors import ContractRuntimeError, ContractTypeError, ContractValueError, OverflowWarning, mismatch, where
from .lifetimes import Lease, LentInput, unlend
from .options import Options
from .outputs import _PROGRAM, LentOutputs, Outputs, Stats
from .shadow import Sampler, Shadow, shadowed
from .plan import Plan
from .program import Program, padded_dims
from .state import BoundState

_get_ident = threading.get_ident
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled


class Runner:
    """A compiled program. Call it with raw-sized tensors; get outputs sliced to raw extents."""

    backend = "abstract"
    Options = Options            # a backend with its own options names its subclass here
    allow_host_inputs = False
    cache_output_views = False   # True where a bucket's outputs are the same tensors on every call

    @classmethod
    def default_device(cls) -> torch.device:
        """The device this backend's runners (and the conformance suite) use when none is given."""
        return torch.device("cpu")

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run on this machine, or None when it can."""
        return None

    def __init__(self, program: Program, body: Callable, *, state: Mapping | None = None, **options):
        """`options`: this backend's `Options` (`pg.compile`'s keywords), checked by name."""
        opts = self.Options.parse(program.name, self.backend, options)
        if not callable(body):
            raise ContractTypeError(mismatch(program.name, None, "body", "a callable", type(body).__name__))
        self.options = opts
        self.program = program
        self.plan = Plan(program)
        self.body = body
        self._eager_body = body     # overflow runs it as given, compiled or not (3.2)
        # read on every call (and public): attributes of the runner, not lookups through options
        self.prepare, self.overflow, self.copy_outputs = opts.prepare, opts.overflow, opts.copy_outputs
        self.state = BoundState(program, state)
        self.device = _device(program, opts.device) if opts.device is not None else self.state.device()
        self.stats = Stats()
        self._compiled = opts.torch_compile is not None
        if self._compiled:
            from .compiled import CompiledBody   # local: plain runners never import dynamo
            self.body = CompiledBody(program, body, opts.torch_compile, self.stats, self.state)
        shadow = opts.shadow
        if shadow is not None and not isinstance(shadow, Shadow):
            raise ContractTypeError(mismatch(program.name, None, "shadow", "a pg.Shadow(...) or None", repr(shadow)))
        self._shadow = Sampler(shadow) if shadow is not None else None
        self._canary = self._arm_canary(opts.canary)
        self._lease = Lease(program.name, 0)     # the last call's claim on its outputs
        self._lock = threading.Lock()
        self._owner = None         # the thread inside call(), to tell re-entry from another thread
        self._warned_overflow = False
        self._deferred = None      # compile counts of calls that raised, for the next that returns
        # output -> ((dim, axis name, affine), ...): slicing without re-deriving shapes per call
        self._out_slices = {n: tuple((d, a.axis.name, a) for d, a in padded_dims(s.shape))
                            for n, s in program.outputs.items()}
        self._views: dict[tuple, Outputs] = {}  # (bucket, *extents) -> sliced views (never handed out)
        self._device_dims = device_axis_dims(program.outputs)     # buffers along device-extent axes
        self._in_device_dims = device_axis_dims(program.inputs)

    def _arm_canary(self, option):
        """The canary of the bound state's canary rows (padgraph/canary.py), or None; the body
        (and its eager form) runs the check after every run, captured graphs included."""
        mode = parse_mode(self.program.name, option)
        if mode is None or not any(s.canary_rows for s in self.program.state.values()):
            return None
        canary = Canary(self.program, self.state, mode, self.state.device(), self._canary_checker())
        if not len(canary):
            return None
        self.body, self._eager_body = canary.wrap(self.body), canary.wrap(self._eager_body)
        return canary

    def _canary_checker(self):
        """A backend's one-launch canary check (`checker(regions, flag) -> check()`), or None for torch ops."""
        return None

    def canary_check(self) -> None:
        """Wait for the device's queued work, then report a canary row written by any call so far."""
        if self._canary is not None:
            dev = self.state.device()
            if dev is not None and dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self._canary.poll(self._lease.call + 1)

    def __call__(self, /, **raw: torch.Tensor) -> Outputs:
        return self.call(raw)

    def call(self, raw: Mapping[str, torch.Tensor], extents: Mapping[str, torch.Tensor] | None = None) -> Outputs:
        """A call with raw inputs; `extents`: device-resident raw extents of axes declared
        `device_extent=True` (0-d int32 device tensors, e.g. a previous program's valid length).

        With a device extent the host shapes give the axis's bound (the bucket follows it); lanes
        past the device extent (clamped into [0, bound]) hold pads, `x.extent` returns it, and
        output lanes past it hold the output's pad. The cuda backend reads it on the device only.
        """
        me = _get_ident()
        if self._owner == me:
            raise ContractRuntimeError(
                f"{where(self.program.name)}: a runner must not be called from inside its own call (its prepare "
                f"hook or body), got a re-entrant call: the inner call would overwrite the outer call's staged "
                f"inputs. Use a second runner, or call after the outer call returns")
        grad = _grad_enabled()          # rule 10.5: inference only, outputs never require grad
        lock = self._lock               # rule 4.4: calls from several threads run one at a time
        lock.acquire()                  # (acquire/release: half the cost of `with lock`)
        try:
            self._owner = me
            if grad:
                _set_grad(False)        # torch.no_grad() without its context-manager cost
            pinned = self.device
            before = self.stats.compile_counts() if self._compiled else None
            try:
                out = self._call(raw, extents)
            except BaseException:
                self.device = pinned     # rule 10.6: a call that raises pins no device, and its
                if before is not None:   # compiles count with the next call that returns
                    self._deferred = self.stats.defer_compiles(before, self._deferred)
                raise
            if self._deferred is not None:
                self.stats.add_compiles(self._deferred)
                self._deferred = None
            return out
        finally:
            self._owner = None
            if grad:
                _set_grad(True)
            lock.release()

    def _call(self, raw, extents) -> Outputs:
        if type(raw) is not dict and not isinstance(raw, Mapping):    # dict: the common case, no ABC check
            raise ContractTypeError(mismatch(self.program.name, None, "the raw inputs",
                                             "a mapping input name -> tensor", type(raw).__name__))
        if self._canary is not None:
            self._canary.poll(self._lease.call + 1)    # a write flagged by an earlier call: no sync
        device = self.device
        if device is None or (device.index is None and device.type != "cpu"):
            device = self._resolve_device(raw, device)
        plan = self.plan
        try:
            ext = plan.extents(raw, device, self.allow_host_inputs)
        except LentInput:               # another call's output as an input: a plain alias of it
            raw = {n: unlend(t) for n, t in raw.items()}      # (raises when it is stale)
            ext = plan.extents(raw, device, self.allow_host_inputs)
        dev = (self._device_extents(extents, device) or None) if extents is not None else None   # {}: none
        if self.state.values:           # no bound state: nothing to guard, nothing to alias
            self.state.check()          # first: a moved state's old range means nothing to aliasing
            self._check_aliasing(raw)
        self.device = device        # only once the call is valid: a rejected call pins nothing
        bucket = plan.bucket_for(ext)
        if bucket is None:
            outs = self._overflow(raw, ext, dev)
            self._next_lease()      # it ran: the previous call's outputs are now stale (rule 6.2)
            return self._finish(outs, ext)
        if self._shadow is not None and self._shadow.sampled(bucket):
            outs = self._shadowed(bucket, raw, ext, dev)
        elif dev:
            outs = self._run_device(bucket, raw, ext, dev)
        else:
            outs = self._run(bucket, raw, ext)
        lease = self._lease         # _next_lease(), inline: end the last call's lease, open this call's
        lease.alive = False
        self._lease = lease = Lease(lease.program, lease.call + 1)
        self.stats.record(bucket, ext[plan.bucket_axis])
        if self.cache_output_views and not self.copy_outputs:      # the bucket's sliced views, lent
            views = self._views.get((bucket, *ext.values())) or self._finish_cached(outs, ext, bucket)
            return LentOutputs(views, lease)
        return self._finish(outs, ext)

    def _shadowed(self, bucket: int, raw, ext, dev):
        """A sampled call: run it, then verify it against the eager runs (see padgraph/shadow.py)."""
        return shadowed(self, self._shadow.spec, bucket, raw, ext, dev)

    def _resolve_device(self, raw, device):
        """No device yet: the first input's. A bare "cuda": the index of the first such input."""
        for t in raw.values():
            if isinstance(t, torch.Tensor) and (device is None or t.device.type == device.type):
                return t.device
        return device

    # ---- backend hook ------------------------------------------------------------------
    def _run(self, bucket: int, raw: Mapping[str, torch.Tensor], ext: Mapping[str, int]) -> Mapping[str, torch.Tensor]:
        """The padded outputs at `bucket`. Before writing memory an earlier call's outputs may
        alias, call `self._end_lease()` (the lease of outputs already lent ends there)."""
        raise NotImplementedError(f"backend {self.backend!r} must implement _run")

    def _run_eager(self, size: int, raw, ext) -> Mapping[str, torch.Tensor]:
        """Run the body eagerly at a size off the ladder (overflow). Reference semantics: the
        body as given, never its torch.compile'd form (sizes past the ladder are unbounded, and
        each would compile a graph of its own until dynamo's recompile limit)."""
        return run_padded(self, size, raw, ext, self.device, body=self._eager_body)

    def _run_device(self, bucket: int, raw, ext, dev) -> Mapping[str, torch.Tensor]:
        """A call with device extents, by reading them on the host (one sync): the oracle's way,
        and any backend's without a device path. Same as a host call with inputs cut to them."""
        cut_ext, cut = self._cut(raw, ext, dev)
        outs = self._run(bucket, cut, cut_ext)
        return mask_outputs(self.program, outs, self._device_dims, cut_ext.__getitem__)

    def _cut(self, raw, ext, dev):
        """Extents with the device ones read and clamped, and the inputs cut to them."""
        cut_ext = dict(ext)
        for axis, t in dev.items():
            cut_ext[axis] = min(max(int(t), 0), ext[axis])
        cut = {}
        for name, t in raw.items():
            for d, axis, scale, offset in self._in_device_dims.get(name, ()):
                t = t.narrow(d, 0, max(0, scale * cut_ext[axis] + offset))
            cut[name] = t
        return cut_ext, cut

    def _device_extents(self, extents: Mapping, device) -> dict:
        """Validated device extents: axes declared device_extent=True, 0-d int32 tensors on the device."""
        if not isinstance(extents, Mapping):
            raise ContractTypeError(mismatch(self.program.name, None, "extents", "a mapping axis -> 0-d int32 tensor",
                                             type(extents).__name__))
        allowed = {a.name for a in self.plan.axes if a.device_extent}
        out = {}
        for axis, t in extents.items():
            if axis not in allowed:
                raise ContractValueError(mismatch(self.program.name, None, f"device extent axis {axis!r}",
                                                  f"one declared Axis(..., device_extent=True): {sorted(allowed)}", repr(axis)))
            if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != torch.int32 \
                    or (device is not None and t.device != device):
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ContractValueError(mismatch(self.program.name, None, f"device extent of axis {axis!r}",
                                                  f"a 0-d torch.int32 tensor on {device}", got))
            out[axis] = t
        return out

    # ---- shared steps ------------------------------------------------------------------
    def _check_aliasing(self, raw: Mapping[str, torch.Tensor]) -> None:
        if not self.state.values:
            return
        for name, t in raw.items():
            hit = self.state.overlaps(t)
            if hit is not None:
                raise ContractValueError(
                    f"{where(self.program.name, name)}: an input must not share memory with bound state, "
                    f"got a tensor overlapping state {hit!r}; the body may write that state while the "
                    f"input is meant to be a snapshot. Pass a clone.")

    def _overflow(self, raw, ext, dev=None) -> Mapping[str, torch.Tensor]:
        """Raw extents past the ladder: eagerly at the smallest size that holds them (with device
        extents: that holds their bounds, so outputs reach the bounds as on the ladder)."""
        if self.overflow == "error":
            raise self.plan.overflow_error(ext)
        size = self.plan.fit(ext)
        run_ext, run_raw = self._cut(raw, ext, dev) if dev else (ext, raw)
        outs = self._run_eager(size, run_raw, run_ext)
        # counted (and warned about) once it ran: a call that raises changes no stats (10.6)
        if not self._warned_overflow:
            self._warned_overflow = True
            warnings.warn(f"program {self.program.name!r}: raw extents {dict(ext)} are past the largest bucket "
                          f"{self.plan.buckets[-1]}; running eagerly (counted in stats.eager_fallbacks; warned "
                          f"once per runner; overflow='error' raises instead)", OverflowWarning, stacklevel=5)
        self.stats.eager_fallbacks += 1
        # fresh tensors: a body may return (a view of) bound state, which an output must not alias
        outs = {name: t.clone() for name, t in outs.items()}
        return mask_outputs(self.program, outs, self._device_dims, run_ext.__getitem__) if dev else outs

    def _finish(self, outs: Mapping[str, torch.Tensor], ext: Mapping[str, int], lend_: bool = True) -> Outputs:
        res = Outputs()
        res.__dict__[_PROGRAM] = self.program.name
        for name, dims in self._out_slices.items():
            t = outs[name]
            for d, axis, af in dims:     # a dim k*a + c with c < 0 is empty at a raw extent of 0
                t = t.narrow(d, 0, max(0, af.scale * ext[axis] + af.offset))
            res[name] = t.clone() if self.copy_outputs else t
        return self._lend(res) if lend_ and not self.copy_outputs else res

    def _end_lease(self) -> None:
        """End the last call's lease on its outputs (rule 6.2). A backend calls it right before it
        writes the output memory (after everything that may reject the call), so a read on another
        thread that overlaps the write finds the lease ended when it checks again after its read."""
        self._lease.alive = False

    def _next_lease(self) -> None:
        """End the last call's lease (if the backend has not yet) and open this call's."""
        self._lease.alive = False
        self._lease = Lease(self.program.name, self._lease.call + 1)

    def _lend(self, res: Outputs) -> Outputs:
        """The outputs lent under this call's lease (a read after the next call raises)."""
        return LentOutputs(res, self._lease)

    def _finish_cached(self, outs, ext, bucket: int) -> Outputs:
        """The sliced views of a bucket's fixed outputs, made once per (bucket, extents). They never
        leave the runner: each call lends aliases of them (`_lend`), so a caller's in-place change
        of an output's metadata (t_(), unsqueeze_(), set_(), `.data =`) cannot reach them."""
        key = (bucket, *ext.values())
        hit = self._views.get(key)
        if hit is None:
            hit = self._finish(outs, ext, lend_=False)
            if len(self._views) > 4096:
                self._views.clear()
            self._views[key] = hit
        return hit

    def check_outputs(self, outs, bucket: int, device: torch.device | None = None) -> None:
        """The body returned every declared output at the bucket's padded shape and dtype, dense
        (strided layout), on the runner's device: all checked before any output is copied."""
        if not isinstance(outs, Mapping) or set(outs) != set(self.program.outputs):
            got = sorted(outs, key=repr) if isinstance(outs, Mapping) else type(outs).__name__
            raise ContractValueError(mismatch(self.program.name, None, "the body's return value",
                                              f"a dict with keys {sorted(self.program.outputs)}", got))
        for name, spec in self.program.outputs.items():
            t = outs[name]
            shape = self.plan.shape(name, bucket)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != spec.dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ContractValueError(mismatch(self.program.name, name, f"shape and dtype at bucket {bucket}",
                                                  f"{shape} {spec.dtype}", got, kind="output"))
            if t.layout != torch.strided:
                raise ContractValueError(mismatch(self.program.name, name, "layout", "torch.strided (dense)",
                                                  t.layout, kind="output"))
            if device is not None and t.device != device:   # device: with its index (as _call resolves it)
                raise ContractValueError(mismatch(self.program.name, name, "device",
                                                  f"the runner's device {device}", t.device, kind="output"))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.program.name!r} backend={self.backend} buckets={list(self.plan.buckets)}>"


def _device(program: Program, device) -> torch.device:
    """The runner's device from the `device=` option; a CUDA device needs CUDA on this machine."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ContractValueError(mismatch(program.name, None, "device", "a torch.device or a device string",
                                          repr(device))) from e
    if dev.type == "cpu" and dev.index is not None:
        dev = torch.device("cpu")   # "cpu:0": torch puts every CPU tensor on plain "cpu"
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ContractRuntimeError(mismatch(program.name, None, "device", "a device this machine has",
                                            f"{dev} (torch.cuda.is_available() is False)"))
    return dev
