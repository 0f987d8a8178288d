"""The containers a bound state value may be made of (lists, tuples, dicts, dataclasses, pytree
nodes, a user's flatten/unflatten pair), walked once at bind time into labelled leaves and the
mutable containers `BoundState.check()` watches."""
from __future__ import annotations

import dataclasses
from operator import is_

import torch
import torch.utils._pytree as pytree

from .errors import ContractTypeError, mismatch

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
