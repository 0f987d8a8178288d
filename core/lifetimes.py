"""Output lifetimes, enforced (rule 6.2): with `copy_outputs=False` an output is lent to the
caller until the runner's next call, and a read after that raises `StaleOutputError`.

Each call's outputs are `Lent` tensors: detached aliases of the runner's output memory that carry
the call's `Lease`. The next call ends that lease before it writes that memory; any torch
operation that receives a tensor of an ended lease, at any depth of its arguments or keyword
arguments (arithmetic, indexing, `.item()`, `.cpu()`, `.tolist()`, `len()`, iteration, printing,
`torch.cat([y])`, `torch.add(x, other=y)`, passing it to another runner, deepcopy, pickle)
raises instead of reading what the later call wrote there. Operations on a live lease return
plain tensors, except results that alias the output's memory (views, `detach()`, `.data`, also
inside a returned tuple or list: `unbind`, `split`, `chunk`, `for row in y`), which stay lent
under the same lease. `numpy()`, `__array__` (`np.asarray(y)`) and `__dlpack__`
(`torch.from_dlpack(y)`) export a copy: another library's object over the memory could not be
checked. Threads: the lease is checked again after the read, so a read that overlapped the next
call's writes raises rather than return a mix of two calls.

`torch.compile` of a caller's function: dynamo reads a lent argument's metadata (allowed on any
lease: no values), then traces `__torch_function__`, so the compiled code guards on the lease and
a stale argument raises (under `fullgraph`, as dynamo's `Unsupported` caused by this error).

Unguarded (torch reads these without calling back into Python), so copy before the next call:
- tensor constructors reading a lent output as data: `torch.tensor(y)`, `torch.Tensor(y)`,
  `torch.as_tensor(y, dtype=...)` with a conversion, `torch.asarray(y)`, `x.new_tensor(y)` where
  `x` is not lent;
- raw memory handed out before the next call: `data_ptr()`, `untyped_storage()`,
  `__cuda_array_interface__`, `torch.utils.dlpack.to_dlpack(y)`, `x.set_(y)` with `x` not lent,
  `y.as_subclass(C)` for a class C other than `torch.Tensor`, and whatever a C++ or Triton
  kernel keeps of them;
- results of a `torch.compile`'d function: plain tensors, views of an output included;
- TorchScript: a `torch.jit.script`ed or traced function or module called on a lent output;
- an output passed to another runner while a third thread calls the runner that lent it: the
  lease is checked when the consuming call starts, not after it has read its inputs.
The cost is on the caller's reads of outputs (a Python check per torch call on them), not on the
call path beyond one alias per output read.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree

from .errors import StaleOutputError


class LentInput(Exception):
    """Plan.extents met a Lent tensor among a call's inputs: the runner unlends them and retries."""


class Lease:
    """One call's claim on its outputs: alive until the runner's next call ends it."""

    __slots__ = ("alive", "program", "call", "name")

    def __init__(self, program: str, call: int):
        self.alive, self.program, self.call, self.name = True, program, call, None

    def error(self, name: str | None) -> StaleOutputError:
        out = f"output {name!r}" if name else "an output"
        return StaleOutputError(
            f"program {self.program!r}: {out} of call {self.call} must be read before the runner's next "
            f"call, got a read after it: that call has overwritten its memory. Pass copy_outputs=True to "
            f"pg.compile, or .clone() what you keep before calling the runner again")


_SCALARS = frozenset({int, float, bool, str, slice, type(None), type(Ellipsis), torch.dtype, torch.device})


def _lent_leaves(tree, found: list) -> list:
    """The Lent tensors among `tree`'s leaves, at any depth (tuples, lists, dicts, and any other
    pytree node: a namedtuple, a registered dataclass)."""
    for a in tree:
        t = type(a)
        if t is Lent:
            found.append(a)
        elif t is torch.Tensor or t in _SCALARS:
            continue
        elif isinstance(a, (tuple, list)):
            _lent_leaves(a, found)
        elif isinstance(a, dict):
            _lent_leaves(a.values(), found)
        elif t in _pytree.SUPPORTED_NODES:
            _lent_leaves(_pytree.tree_leaves(a), found)
    return found


def _check(lent: list, func=None) -> None:
    for a in lent:
        if not a._lease.alive and not _dynamo_inspects(func):
            raise a._lease.error(a._name)


# what dynamo reads of a tensor argument while it compiles a frame: metadata, no values (the ops
# it traces after that check the lease, and the compiled code guards on it)
_METADATA = frozenset({"_is_view", "dim", "is_conj", "is_neg", "size", "storage_offset", "stride",
                       "untyped_storage", "is_contiguous", "numel", "device", "dtype", "grad", "is_leaf",
                       "is_mkldnn", "is_nested", "is_quantized", "is_sparse", "layout", "requires_grad",
                       "shape", "ndim", "is_cuda", "is_meta", "_base"})


def _dynamo_inspects(func) -> bool:
    if func is None or not torch.compiler.is_compiling():
        return False
    name = getattr(func, "__name__", None)
    if name == "__get__":                         # a property: its name
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name in _METADATA


def _lend_aliases(result, lent: list):
    """`result` with every tensor in it that aliases one of the `lent` arguments' memory lent
    under that argument's lease; everything else as returned. Runs with torch functions off."""
    if type(result) is torch.Tensor:
        if result.layout != torch.strided or result.numel() == 0:
            return result
        ptr = result.untyped_storage().data_ptr()
        src = next((a for a in lent if a.untyped_storage().data_ptr() == ptr), None)
        return result if src is None else lend(result, src._lease, src._name)
    if type(result) in (tuple, list):
        return type(result)(_lend_aliases(r, lent) for r in result)
    if isinstance(result, (tuple, list, dict)) or type(result) in _pytree.SUPPORTED_NODES:
        return _pytree.tree_map_only(torch.Tensor, lambda r: _lend_aliases(r, lent), result)
    return result


class Lent(torch.Tensor):
    """An output on loan until the runner's next call (see the module docstring)."""

    def __repr__(self, **kwargs) -> str:          # as a plain tensor prints (raises when stale)
        return _read(self, lambda t: t.__repr__(**kwargs))

    def __deepcopy__(self, memo):                 # a copy is the caller's own: a plain tensor
        return _read(self, torch.Tensor.clone)

    def __reduce_ex__(self, protocol):            # pickled as the plain tensor it is now
        return _read(self, torch.Tensor.clone).__reduce_ex__(protocol)

    def numpy(self, *, force: bool = False):      # a copy: numpy cannot check the lease
        return _read(self, torch.Tensor.clone).numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        return _read(self, torch.Tensor.clone).__array__(dtype)

    def __dlpack__(self, *args, **kwargs):        # a copy: the consumer cannot check the lease
        return _read(self, torch.Tensor.clone).__dlpack__(*args, **kwargs)

    def as_subclass(self, cls):                   # torch skips __torch_function__ for it
        """As a plain tensor (`torch.Tensor` or Lent): an alias lent under the same lease; as any
        other subclass, its alias as of now (checked now; another class cannot be lent)."""
        alias = _read(self, lambda t: t.as_subclass(torch.Tensor))
        if cls in (torch.Tensor, Lent):
            return lend(alias, self._lease, self._name)
        return alias.as_subclass(cls)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        lent = _lent_leaves(args, [])
        if kwargs:
            _lent_leaves(kwargs.values(), lent)
        _check(lent, func)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
            if torch.compiler.is_compiling():     # dynamo traces this: no storage to compare there
                return result
            _check(lent)                          # the next call began during the read: discard it
            return _lend_aliases(result, lent) if lent else result


def _read(t: Lent, read):
    """read(plain alias of t), checked against t's lease before and after the read."""
    value = read(unlend(t))
    if not t._lease.alive:
        raise t._lease.error(t._name)
    return value


def lend(t: torch.Tensor, lease: Lease, name: str | None) -> Lent:
    """`t` as a Lent tensor under `lease`: a detached alias (never a view, never requiring grad)."""
    u = torch.Tensor._make_subclass(Lent, t)
    u._lease, u._name = lease, name
    return u


def unlend(t):
    """A plain tensor for a Lent one whose lease is alive (raises when it ended); anything else as given."""
    if type(t) is not Lent:
        return t
    if not t._lease.alive:
        raise t._lease.error(t._name)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor._make_subclass(torch.Tensor, t)
