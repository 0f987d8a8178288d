"""What a graph pass may assume about the nodes of the FX graph dynamo traced: which of them
provably write no tensor, and which run with grad off and outside autocast.

Dynamo's graph is not functionalised: `F.relu(x, True)`, `x.relu_()`, `v += 1` on a view of x,
`torch._foreach_add_`, a custom op with a `Tensor(a!)` argument all appear as ordinary nodes and
change their arguments' memory. A pass that moves a computation across such a node changes the
result. So the question is asked the safe way round: a node is `pure` only when it is known not to
write (an allow-list, never a deny-list), and everything else (module calls, higher-order ops,
unknown Python functions, anything with `out=` / `inplace=` / `max_norm=`, names ending in `_`)
counts as a write to every tensor. A known torch function or Tensor method is judged by the
schemas of the aten op of its name (all its overloads that have no `out` argument must be free of
`(a!)` annotations), except the ops whose schema hides a write (batch norm's running statistics).
An OpOverload (aten or custom) is judged by its own schema, as inductor judges it.
"""
from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.nn.functional as F

# Python operators dynamo emits that compute a new value (their in-place forms, iadd and the
# like, and setitem are left out: they write).
_PURE_OPERATORS = frozenset({
    operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.matmul, operator.neg, operator.pos, operator.abs,
    operator.invert, operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.not_,
    operator.truth,
})
# Tensor methods without an aten op of their name that only read (casts, copies, metadata).
_PURE_METHODS = frozenset({
    "float", "half", "bfloat16", "double", "int", "long", "short", "bool", "byte", "char", "cpu",
    "cuda", "type", "dim", "ndimension", "nelement", "element_size", "is_contiguous",
})
# Names whose aten schema marks no write but whose call writes: batch norm's running statistics
# when training, Tensor.backward's .grad, and Python-level torch functions named like an aten op
# that do more than it.
_UNMARKED_WRITES = frozenset({
    "batch_norm", "instance_norm", "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
    "_batch_norm_impl_index", "set", "backward", "save", "resize", "resize_as",
})
_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast
_SET_GRAD = torch._C._set_grad_enabled
_MODE_WORDS = ("autocast", "grad_enabled", "grad_mode")      # in the name of a mode change not known above


def pure(node: torch.fx.Node) -> bool:
    """Whether the node provably writes no tensor (False: assume it writes any of them)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return True
    if node.op == "call_function":
        return _pure_function(node)
    if node.op == "call_method":
        return _pure_method(node)
    return False                                    # call_module: arbitrary code


def _pure_function(node) -> bool:
    t = node.target
    if t in _PURE_OPERATORS:
        return True
    if isinstance(t, torch._ops.OpOverload):
        return not t._schema.is_mutable and _op_name(t._schema) not in _UNMARKED_WRITES
    if isinstance(t, torch._ops.OpOverloadPacket):
        return "out" not in node.kwargs and _pure_packet(t)
    if id(t) not in _torch_callables():             # a user function, a higher-order op, ...
        return False
    return not _writes_by_argument(t, node) and _pure_aten_name(getattr(t, "__name__", ""))


def _pure_method(node) -> bool:
    this = node.args[0] if node.args else None
    receiver = this.meta.get("example_value") if isinstance(this, torch.fx.Node) else None
    if not isinstance(receiver, torch.Tensor) or _writes_by_argument(None, node):
        return False                                # a list's append, a method of an unknown object
    name = node.target
    return name in _PURE_METHODS or _pure_aten_name(name)


def _writes_by_argument(target, node) -> bool:
    """An `out=` tensor, a truthy `inplace` (keyword or positional, `F.relu(x, True)`), or
    `max_norm` (F.embedding renormalises its weight in place)."""
    sig = _signature(target)
    if sig is None:                                 # a builtin or a method: keywords only
        bound = dict(node.kwargs)
    else:
        try:
            bound = sig.bind(*node.args, **node.kwargs).arguments
        except TypeError:
            return True
    return (bound.get("out") is not None or bound.get("inplace", False) is not False
            or bound.get("max_norm") is not None)


@functools.lru_cache(maxsize=None)
def _signature(target):
    try:
        return inspect.signature(target) if target is not None else None
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def _pure_aten_name(name: str) -> bool:
    """A torch function or Tensor method named `name` computes a new value: the aten op of that
    name exists and none of its overloads (out= variants aside) writes an argument."""
    if not name or name.endswith("_") or name.startswith("__") or name in _UNMARKED_WRITES:
        return False
    packet = getattr(torch.ops.aten, name, None)
    return isinstance(packet, torch._ops.OpOverloadPacket) and _pure_packet(packet)


def _pure_packet(packet) -> bool:
    schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    if any(_op_name(s) in _UNMARKED_WRITES for s in schemas):
        return False
    return all(not s.is_mutable for s in schemas if not any(a.is_out for a in s.arguments))


def _op_name(schema) -> str:
    return schema.name.split("::")[-1]


@functools.lru_cache(maxsize=1)
def _torch_callables() -> dict:
    """id -> object of torch's own functions and Tensor methods (identity, not name: a user
    function called `relu` is not torch's)."""
    spaces = (torch, F, torch._C._nn, torch.special, torch.linalg, torch.fft, torch.Tensor)
    found = {}
    for space in spaces:
        for attr in dir(space):
            obj = getattr(space, attr, None)
            if callable(obj) and not isinstance(obj, type):
                found[id(obj)] = obj                # the object is kept: its id stays unique
    return found


def grad_off_no_autocast(nodes) -> set:
    """The nodes that run with grad off and outside every autocast region, starting from the
    modes the graph is compiled under (dynamo guards on both). A mode change the walk does not
    understand makes every later node count as inside one."""
    grad = torch.is_grad_enabled()
    depth = 1 if torch._C._is_any_autocast_enabled() else 0
    lost, clean = False, set()
    for node in nodes:
        t = node.target if node.op == "call_function" else None
        if t is _ENTER_AUTOCAST:
            depth += 1
        elif t is _EXIT_AUTOCAST:
            depth -= 1
            lost = lost or depth < 0
        elif t is _SET_GRAD:
            grad = not (len(node.args) == 1 and node.args[0] is False)
        elif t is not None and any(w in getattr(t, "__name__", "") for w in _MODE_WORDS):
            lost = True
        if not (grad or depth or lost):
            clean.add(node)
    return clean
