"""Rule 7.6: structured state. A state value is a tensor or a pytree of tensors (list, tuple, dict,
dataclass, a node registered with torch.utils._pytree); the body sees the same structure; its
structure and every leaf's storage stay as bound, and errors name the element path ("cache[2]",
"cache.key_cache[1]").
"""
import dataclasses

import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
SLOTS = 16


@dataclasses.dataclass
class Cache:
    """An HF-style cache: per-layer key and value tensors, in lists."""

    key_cache: list
    value_cache: list


def program(sink=0):
    """Each layer i stores val + i at rows loc; padded lanes' loc is the pad, sink row 0."""
    return pg.Program(
        "layers",
        inputs={"loc": pg.Input((bs,), torch.int64, pad=0), "val": pg.Input((bs,), torch.float32, pad=0)},
        outputs={"y": pg.Output((bs,), torch.float32)},
        state={"cache": pg.State(sink=sink)},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def _layers(cache) -> list:
    """The layer tensors of any structure the cases bind, in a fixed order."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    if isinstance(cache, Cache):
        return cache.key_cache + cache.value_cache
    items = cache.values() if isinstance(cache, dict) else cache
    return [t for item in items for t in _layers(item)]


def body(x):
    y = torch.zeros_like(x.val)
    for i, t in enumerate(_layers(x.cache)):
        t.index_copy_(0, x.loc, x.val + i)
        y = y + t.index_select(0, x.loc)
    return {"y": y}


def _rows(device):
    return torch.full((SLOTS,), -1.0, device=device)


STRUCTURES = {
    "list": lambda d: [_rows(d) for _ in range(3)],
    "tuple": lambda d: tuple(_rows(d) for _ in range(3)),
    "dict": lambda d: {"k": _rows(d), "v": _rows(d)},
    "dataclass": lambda d: Cache([_rows(d), _rows(d)], [_rows(d), _rows(d)]),
    "nested": lambda d: {"layers": [[_rows(d), _rows(d)], (_rows(d),)]},
}


def _raw(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randperm(SLOTS - 1, generator=g)[:n] + 1             # distinct rows, never the sink
    return {"loc": loc.to(device), "val": torch.randn(n, generator=g).to(device)}


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_r7_6_the_body_sees_the_structure_and_writes_persist(compile, device, kind):
    cache = STRUCTURES[kind](device)
    runner = compile(program(), body, state={"cache": cache})
    layers = _layers(cache)
    for call, n in enumerate([3, 5]):
        raw = _raw(n, device, seed=call)
        before = [t.clone() for t in layers]
        out = runner(**raw)
        case = f"{kind}, call {call}"
        S.assert_close("y", out.y, sum(raw["val"] + i for i in range(len(layers))), case)
        for i, (t, was) in enumerate(zip(layers, before)):
            S.assert_close(f"layer {i} at the raw rows", t[raw["loc"]].cpu(), (raw["val"] + i).cpu(), case)
            changed = set((t != was).nonzero().flatten().tolist())
            allowed = set(raw["loc"].tolist()) | {0}
            assert changed <= allowed, S.msg(f"rows of layer {i} written", sorted(changed), f"within {sorted(allowed)}", case)


def _set_element(i):
    return lambda c, d: c[i].set_(torch.zeros(SLOTS, device=d))


# (id, structure, change, path the message names)
CHANGES = [
    ("list-replace", "list", lambda c, d: c.__setitem__(1, _rows(d)), "cache[1]"),
    ("list-append", "list", lambda c, d: c.append(_rows(d)), "cache[3]"),
    ("list-remove", "list", lambda c, d: c.pop(), "cache[2]"),
    ("list-element-set_", "list", _set_element(2), "cache[2]"),
    ("dict-replace", "dict", lambda c, d: c.__setitem__("v", _rows(d)), "cache['v']"),
    ("dict-add", "dict", lambda c, d: c.__setitem__("extra", _rows(d)), "cache['extra']"),
    ("dict-remove", "dict", lambda c, d: c.pop("k"), "cache['k']"),
    ("dataclass-element", "dataclass", lambda c, d: c.key_cache.__setitem__(1, _rows(d)), "cache.key_cache[1]"),
    ("dataclass-element-resize_", "dataclass", lambda c, d: c.value_cache[0].resize_(SLOTS // 2), "cache.value_cache[0]"),
    ("nested-append", "nested", lambda c, d: c["layers"][0].append(_rows(d)), "cache['layers'][0][2]"),
]


@pytest.mark.parametrize("case,kind,change,path", CHANGES, ids=[c[0] for c in CHANGES])
def test_r7_6_structure_or_element_changed_raises_naming_the_element(compile, device, case, kind, change, path):
    cache = STRUCTURES[kind](device)
    runner = compile(program(), body, state={"cache": cache})
    runner(**_raw(3, device, seed=0))
    change(cache, device)
    layers = _layers(cache)
    before = [t.clone() for t in layers]
    with pytest.raises(pg.StateStorageError) as e:
        runner(**_raw(3, device, seed=1))
    for part in ("'layers'", "'cache'", path):
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", case)
    for i, (t, was) in enumerate(zip(layers, before)):
        S.assert_equal(f"layer {i} after the refused call", t, was, case)
    if "set_" in case or "resize_" in case:
        return
    runner = compile(program(), body, state={"cache": cache})    # re-compiling with the new structure works
    raw = _raw(4, device, seed=2)
    S.assert_close("y after re-compiling", runner(**raw).y, sum(raw["val"] + i for i in range(len(layers))), case)


@pytest.mark.parametrize("value,path", [
    (lambda d: [_rows(d), 3], "cache[1]"),
    (lambda d: {"k": _rows(d), "v": None}, "cache['v']"),
    (lambda d: Cache([_rows(d)], [_rows(d), 1.5]), "cache.value_cache[1]"),
], ids=["int-in-list", "none-in-dict", "float-in-dataclass"])
def test_r7_6_a_non_tensor_leaf_is_refused_at_compile(compile, device, value, path):
    with pytest.raises(pg.ContractTypeError) as e:
        compile(program(), body, state={"cache": value(device)})
    for part in ("'layers'", "'cache'", path):
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", path)


def test_r7_6_sinks_must_exist_in_every_element(compile, device):
    cache = [_rows(device), torch.zeros(4, device=device)]
    with pytest.raises(pg.ContractValueError) as e:
        compile(program(sink=(0, 8)), body, state={"cache": cache})
    for part in ("'layers'", "'cache'", "cache[1]", "sink", "4", "[0, 8]"):
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", "sink past dim 0")
