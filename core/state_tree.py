"""The containers a bound state value may be made of (lists, tuples, dicts, dataclasses, pytree
nodes, a user's flatten/unflatten pair), walked once at bind time into labelled leaves and the
mutable containers `BoundState.check()` watches."""
from __future__ import annotations

import dataclasses
from operator import is_

import torch
import torch.utils._pytree as pytree

from .errors import ContractTypeError, ContractValueError, mismatch

_is_pytree_leaf = getattr(pytree, "tree_is_leaf", None) or pytree._is_leaf   # public from torch 2.5
_MISSING = object()   # a dataclass field that is gone


# ---- containers a state value may be made of --------------------------------------------------
class _Node:
    """A container inside a bound value: its path, and the (suffix, child) entries it was bound with."""

    watch = True   # mutable: check() compares it on every call

    def __init__(self, name: str, path: str, obj):
        self.name, self.path, self.obj = name, path, obj
        self.bound = self.entries()
        self.kids = tuple(c for _, c in self.bound)

    def entries(self) -> list[tuple[str, object]]:
        raise NotImplementedError

    def same(self) -> bool:
        """Still holds exactly the bound children (fast: identity, no re-flattening)."""
        now = self.entries()
        return len(now) == len(self.bound) and all(a == b and c is d for (a, c), (b, d) in zip(now, self.bound))


class _List(_Node):
    def entries(self):
        return [(f"[{i}]", c) for i, c in enumerate(self.obj)]

    def same(self):
        obj = self.obj
        return len(obj) == len(self.kids) and all(map(is_, obj, self.kids))


class _Tuple(_List):
    watch = False  # immutable: its children cannot change (child containers are watched themselves)


class _Dict(_Node):
    def __init__(self, name, path, obj):
        super().__init__(name, path, obj)
        self.keys = list(obj)

    def entries(self):
        return [(f"[{k!r}]", c) for k, c in self.obj.items()]

    def same(self):
        obj = self.obj
        return len(obj) == len(self.kids) and all(map(is_, obj.values(), self.kids)) and list(obj) == self.keys


class _Fields(_Node):
    """A dataclass instance not registered with torch's pytree: its fields are its children."""

    def __init__(self, name, path, obj):
        self.fields = [f.name for f in dataclasses.fields(obj)]
        super().__init__(name, path, obj)

    def entries(self):
        return [(f".{f}", getattr(self.obj, f, _MISSING)) for f in self.fields]

    def same(self):
        obj = self.obj
        return all(getattr(obj, f, _MISSING) is k for f, k in zip(self.fields, self.kids))


class _Tree(_Node):
    """A node registered with torch.utils._pytree (namedtuple, deque, a user's class): one level."""

    def __init__(self, name, path, obj):
        self.watch = not isinstance(obj, tuple)   # namedtuple, structseq: immutable
        super().__init__(name, path, obj)

    def entries(self):
        obj = self.obj
        is_leaf = lambda c: c is not obj        # noqa: E731 - one level: every child is a leaf
        try:
            flat, _ = pytree.tree_flatten_with_path(obj, is_leaf=is_leaf)
        except ValueError:      # registered without flatten_with_keys_fn: label children by position
            kids, _ = pytree.tree_flatten(obj, is_leaf=is_leaf)
            return [(f"[{i}]", c) for i, c in enumerate(kids)]
        return [(pytree.keystr(kp), c) for kp, c in flat]


class _Custom(_Node):
    """An object with a user's flatten/unflatten pair (pg.State(flatten=, unflatten=))."""

    def __init__(self, name, path, obj, flatten):
        self.flatten = flatten
        super().__init__(name, path, obj)

    def entries(self):
        leaves, _ = self.flatten(self.obj)
        return [(f"[{i}]", c) for i, c in enumerate(leaves)]


def _container(name: str, path: str, value) -> _Node | None:
    if isinstance(value, list):
        return _List(name, path, value)
    if type(value) is tuple:
        return _Tuple(name, path, value)
    if isinstance(value, dict):
        return _Dict(name, path, value)
    if not _is_pytree_leaf(value):
        return _Tree(name, path, value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _Fields(name, path, value)
    return None


def _walk(program: str, name: str, path: str, value, leaves: list, nodes: list, ancestors: set,
          flatten=None) -> None:
    """Leaves (name, label, tensor) and watched containers of one state value, depth first."""
    if flatten is not None:
        node = _Custom(name, path, value, flatten)
        nodes.append(node)
        for suffix, child in node.bound:
            if not isinstance(child, torch.Tensor):
                raise ContractTypeError(mismatch(program, name, f"every leaf flatten() gives (here {path}{suffix})",
                                                 "a torch.Tensor", type(child).__name__, kind="state"))
            leaves.append((name, path + suffix, child))
        return
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise ContractTypeError(mismatch(program, name, f"tensor {path}", "strided (dense)", str(value.layout), kind="state"))
        leaves.append((name, path, value))
        return
    node = _container(name, path, value)
    if node is None:
        got = f"{type(value).__name__} {value!r}"[:80]
        raise ContractTypeError(mismatch(program, name, f"every leaf (here {path})",
                                         "a torch.Tensor: state is a tensor or a pytree of tensors", got, kind="state"))
    if id(value) in ancestors:
        raise ContractTypeError(mismatch(program, name, f"{path}", "a tree (no container inside itself)",
                                         f"a {type(value).__name__} that contains itself", kind="state"))
    if node.watch:
        nodes.append(node)
    ancestors.add(id(value))
    for suffix, child in node.bound:
        _walk(program, name, path + suffix, child, leaves, nodes, ancestors)
    ancestors.discard(id(value))


def _element(name: str, label: str) -> str:
    return "" if label == name else f", element {label}"


def _structure_change(node: _Node) -> str:
    """What changed in a container since bind: removed, added and replaced children, by path."""
    try:
        now = dict(node.entries())
    except Exception as e:  # a container the caller broke (a field deleted, ...)
        return f"{node.path} can no longer be read ({type(e).__name__}: {e})"
    bound = dict(node.bound)
    parts = [f"{node.path}{s} was removed" for s in bound if s not in now]
    parts += [f"{node.path}{s} was added" for s in now if s not in bound]
    parts += [f"{node.path}{s} was replaced by another object" for s in bound if s in now and now[s] is not bound[s]]
    return "; ".join(parts) or f"{node.path} changed"


# ---- a user's flatten / unflatten pair ----------------------------------------------------------
def check_round_trip(program: str, name: str, value, spec, rows: int | None) -> None:
    """pg.State(flatten=, unflatten=) must be inverse: flatten(unflatten(ts, context)) gives back
    ts, the very tensors unflatten was given, in the same order. A pair that is not sends the
    body's writes to another leaf (swapped, duplicated) or to none (dropped). `rows`: for
    batch-ordered state, unflatten is given row prefixes of that many rows, as the body sees them."""
    leaves, ctx = spec.flatten(value)
    with torch.no_grad():
        given = [t.narrow(0, 0, rows) if rows is not None else t for t in leaves]
    try:
        again, _ = spec.flatten(spec.unflatten(list(given), ctx))
    except Exception as e:  # noqa: BLE001 - the user's pair: reported as a declaration error
        raise ContractValueError(mismatch(program, name, "flatten(unflatten(leaves, context))",
                                          "runnable on the bound leaves", f"{type(e).__name__}: {e}", kind="state")) from e
    got = _round_trip_error(name, list(given), list(again))
    if got is not None:
        raise ContractValueError(mismatch(
            program, name, "flatten / unflatten (flatten(unflatten(leaves, context)) giving back the very "
            "tensors unflatten was given, in order)", "inverse", got, kind="state"))


def _round_trip_error(name: str, given: list, again: list) -> str | None:
    """What the round trip did to the leaves, by label; None when it gave them back."""
    for i, u in enumerate(again):
        if i >= len(given):
            return f"{len(again)} leaves where flatten gave {len(given)}: {name}[{i}] is added"
        if _same_view(u, given[i]):
            continue
        if not isinstance(u, torch.Tensor):
            return f"at {name}[{i}] {type(u).__name__} where unflatten was given a tensor"
        j = next((j for j, t in enumerate(given) if _same_view(u, t)), None)
        if j is None:
            return (f"at {name}[{i}] a tensor unflatten was not given: unflatten must build the object over "
                    f"the tensors it is given, or the body's writes to {name}[{i}] miss the bound tensor")
        return (f"at {name}[{i}] the tensor given as {name}[{j}]: the body's writes to {name}[{i}] would land "
                f"in {name}[{j}]")
    if len(again) < len(given):
        return f"{len(again)} leaves where flatten gave {len(given)}: {name}[{len(again)}] is dropped"
    return None


def _same_view(a, b: torch.Tensor) -> bool:
    """a is b, or a tensor over the same memory seen the same way (so writes through it reach b).
    Meta tensors have no memory to compare: only identity."""
    if a is b:
        return True
    if not isinstance(a, torch.Tensor) or a.device.type == "meta":
        return False
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())
