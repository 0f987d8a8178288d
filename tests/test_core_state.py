"""Unit tests of BoundState: structured (pytree) state, the storage/structure guard, stride-aware aliasing.

Hazards, sorted as in spec/test_hazards.py:
  silent mismatch — an element of a bound list replaced, appended or removed (the runner keeps the
    old tensors); a state moved by t_() or resize_() at the same address; an input overlapping
    state only through strides (the naive numel-based range misses it).
  raises wrongly — an expanded or strided input beside state (a naive range overlaps it).
"""
import collections
import dataclasses
import functools
import timeit

import pytest
import torch
import torch.utils._pytree as pytree

import padgraph as pg
from padgraph.state import BoundState, byte_span

bs = pg.Axis("bs")
compile_ref = functools.partial(pg.compile, backend="reference", device=torch.device("cpu"))


def _program(*names, sink=None):
    return pg.Program("st", inputs={"a": pg.Input((bs,), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)},
                      state={n: pg.State(sink=sink) for n in names}, buckets=[1, 2, 4])


def _bind(sink=None, **state):
    return BoundState(_program(*state, sink=sink), state)


@dataclasses.dataclass
class Cache:
    key_cache: list
    value_cache: list


@dataclasses.dataclass
class Pair:           # registered with torch's pytree below: flattened through the registry
    k: torch.Tensor
    v: torch.Tensor


pytree.register_pytree_node(Pair, lambda p: ([p.k, p.v], None), lambda kids, _: Pair(*kids),
                            flatten_with_keys_fn=lambda p: ([(pytree.GetAttrKey("k"), p.k), (pytree.GetAttrKey("v"), p.v)], None))
KV = collections.namedtuple("KV", "k v")


def _cache(n=3):
    return Cache([torch.zeros(4, 2) for _ in range(n)], [torch.ones(4, 2) for _ in range(n)])


# ---- structure and labels -------------------------------------------------------------------------
@pytest.mark.parametrize("value,labels", [
    (torch.zeros(2), ["s"]),
    ([torch.zeros(2), torch.zeros(2)], ["s[0]", "s[1]"]),
    ((torch.zeros(2),), ["s[0]"]),
    ({"k": torch.zeros(2), "v": [torch.zeros(2)]}, ["s['k']", "s['v'][0]"]),
    (_cache(2), ["s.key_cache[0]", "s.key_cache[1]", "s.value_cache[0]", "s.value_cache[1]"]),
    (Pair(torch.zeros(2), torch.zeros(2)), ["s.k", "s.v"]),
    (KV(torch.zeros(2), [torch.zeros(2)]), ["s.k", "s.v[0]"]),
    ([], []),
], ids=["tensor", "list", "tuple", "dict", "dataclass", "registered", "namedtuple", "empty"])
def test_named_labels_carry_the_element_path(value, labels):
    st = _bind(s=value)
    assert [label for label, _ in st.named()] == labels
    assert st.values["s"] is value                                # the object as given
    assert all(st.specs[label] is st.specs["s"] for label in labels)
    st.check()


def test_body_receives_the_structure_and_writes_persist():
    cache = _cache()

    def body(x):
        for k, v in zip(x.cache.key_cache, x.cache.value_cache):
            k[0].add_(x.a.sum())
            v[0].add_(1)
        return {"y": x.a + x.cache.key_cache[2][0, 0]}

    runner = compile_ref(_program("cache"), body, state={"cache": cache})
    out = runner(a=torch.ones(2))
    assert out.y.tolist() == [3.0, 3.0]
    assert cache.key_cache[1][0].tolist() == [2.0, 2.0] and cache.value_cache[0][0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("value,path", [
    ([torch.zeros(2), 3], "s[1]"),
    ({"k": None}, "s['k']"),
    (Cache([torch.zeros(2)], [torch.zeros(2), "x"]), "s.value_cache[1]"),
    (KV(torch.zeros(2), 1.5), "s.v"),
    (object(), "s"),
], ids=["int-in-list", "none-in-dict", "str-in-dataclass", "float-in-namedtuple", "object"])
def test_non_tensor_leaf_is_a_type_error_naming_the_path(value, path):
    with pytest.raises(pg.ContractTypeError) as e:
        _bind(s=value)
    for part in ("'st'", "'s'", path, "torch.Tensor"):
        assert part in str(e.value), f"message={str(e.value)!r}, but should contain {part!r}"


def test_a_container_inside_itself_is_refused():
    loop = [torch.zeros(1)]
    loop.append(loop)
    with pytest.raises(pg.ContractTypeError, match=r"s\[1\].*contains itself"):
        _bind(s=loop)


def test_sparse_state_is_refused():
    with pytest.raises(pg.ContractTypeError, match="strided"):
        _bind(s=torch.zeros(3, 3).to_sparse())


# ---- rule 7.2: storage and structure stay as bound -----------------------------------------------
def _kv():
    return [torch.zeros(8, 2) for _ in range(4)]


STRUCTURE = {
    "list-replace": (_kv, lambda v: v.__setitem__(2, torch.zeros(8, 2)), "s[2] was replaced"),
    "list-append": (_kv, lambda v: v.append(torch.zeros(8, 2)), "s[4] was added"),
    "list-remove": (_kv, lambda v: v.pop(), "s[3] was removed"),
    "list-remove-middle": (_kv, lambda v: v.pop(1), "s[3] was removed"),
    "dict-replace": (lambda: {"k": torch.zeros(2), "v": torch.zeros(2)},
                     lambda v: v.__setitem__("v", torch.zeros(2)), "s['v'] was replaced"),
    "dict-add": (lambda: {"k": torch.zeros(2)}, lambda v: v.__setitem__("v", torch.zeros(2)), "s['v'] was added"),
    "dict-del": (lambda: {"k": torch.zeros(2), "v": torch.zeros(2)}, lambda v: v.pop("k"), "s['k'] was removed"),
    "dataclass-element": (_cache, lambda c: c.key_cache.__setitem__(1, torch.zeros(4, 2)), "s.key_cache[1] was replaced"),
    "dataclass-field": (_cache, lambda c: setattr(c, "value_cache", list(c.value_cache)), "s.value_cache was replaced"),
    "nested-list": (lambda: {"layers": [[torch.zeros(2)], [torch.zeros(2)]]},
                    lambda v: v["layers"][1].append(torch.zeros(2)), "s['layers'][1][1] was added"),
    "registered-node": (lambda: [Pair(torch.zeros(2), torch.zeros(2))],
                        lambda v: setattr(v[0], "k", torch.zeros(2)), "s[0].k was replaced"),
}


@pytest.mark.parametrize("case", list(STRUCTURE))
def test_structure_change_raises_naming_the_element(case):
    make, change, part = STRUCTURE[case]
    value = make()
    st = _bind(s=value)
    change(value)
    with pytest.raises(pg.StateStorageError) as e:
        st.check()
    for p in ("'st'", "state 's'", part):
        assert p in str(e.value), f"message={str(e.value)!r}, but should contain {p!r}"


MOVES = {
    "set_": lambda t: t.set_(torch.zeros(8, 2)),
    "set_-same-storage": lambda t: t.set_(t.untyped_storage(), 0, (4, 2), (2, 1)),
    "resize_-smaller": lambda t: t.resize_(4, 2),
    "resize_-larger": lambda t: t.resize_(64, 2),
    "t_": lambda t: t.t_(),
    "as_strided_": lambda t: t.as_strided_((8,), (2,)),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "data=": lambda t: setattr(t, "data", torch.zeros(8, 2)),
    "storage-resize": lambda t: t.untyped_storage().resize_(0),
}


@pytest.mark.parametrize("how", list(MOVES))
def test_storage_change_of_an_element_names_it(how):
    kv = _kv()
    st = _bind(s=kv)
    kv[0].add_(1)                  # value writes are fine, and seen
    st.check()
    MOVES[how](kv[3])
    with pytest.raises(pg.StateStorageError) as e:
        st.check()
    for p in ("'st'", "state 's'", "element s[3]", "storage must stay as bound"):
        assert p in str(e.value), f"message={str(e.value)!r}, but should contain {p!r}"


def test_check_after_value_writes_keeps_passing_and_still_catches_later_moves():
    t = torch.zeros(8, 2)
    st = _bind(s=t)
    for _ in range(3):
        t.add_(1)                  # bumps the version counter: a full check, which passes
        st.check()
    st.check()
    t.t_()
    with pytest.raises(pg.StateStorageError, match="state 's'"):
        st.check()


def test_inference_tensors_are_checked_in_full():
    with torch.inference_mode():
        kv = [torch.zeros(8, 2), torch.zeros(8, 2)]
    st = _bind(s=kv)
    st.check()
    with torch.inference_mode():
        kv[1].t_()
    with pytest.raises(pg.StateStorageError, match=r"s\[1\]"):
        st.check()


def test_check_of_a_64_leaf_list_is_cheap():
    """A few µs per call on an idle core (two cached lists compared); loose bound: CI machines vary."""
    kv = [torch.zeros(8, 4) for _ in range(64)]
    st = _bind(s=kv)
    n = 2000
    per_call = min(timeit.repeat(st.check, number=n, repeat=3)) / n
    assert per_call < 200e-6, f"check() of 64 leaves took {per_call * 1e6:.1f} µs"


# ---- sinks at bind time ---------------------------------------------------------------------------
@pytest.mark.parametrize("sink,value,parts", [
    (8, torch.zeros(8, 2), ["< dim 0", "8", "shape (8, 2)", "[8]"]),
    ((0, 5), [torch.zeros(8), torch.zeros(4)], ["s[1]", "4", "[0, 5]"]),
    (0, torch.zeros(()), ["0-d"]),
])
def test_sink_rows_must_exist_in_every_bound_tensor(sink, value, parts):
    with pytest.raises(pg.ContractValueError) as e:
        _bind(sink=sink, s=value)
    for p in ["'st'", "state 's'", "sink"] + parts:
        assert p in str(e.value), f"message={str(e.value)!r}, but should contain {p!r}"


def test_pg_check_sees_sinks_of_list_elements():
    """Padded lanes write row 0 (the sink) of every layer: no state-write finding for kv[i]."""
    prog = pg.Program("layers", inputs={"loc": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)}, state={"kv": pg.State(sink=0)},
                      buckets=[1, 2, 4, 8])

    def body(x):
        for t in x.kv:
            t.index_fill_(0, x.loc, 1.0)
        return {"y": x.kv[1].index_select(0, x.loc)}

    def sample(gen):
        n = int(torch.randint(1, 8, (), generator=gen))
        return {"loc": torch.randperm(15, generator=gen)[:n] + 1}

    res = pg.check(prog, body, state={"kv": [torch.zeros(16) for _ in range(3)]}, sample=sample, trials=3)
    assert res.ok, str(res)


# ---- a user's flatten / unflatten pair (rule 7.6) -------------------------------------------------
class Own:
    """A cache class torch's pytree does not know: bound through pg.State(flatten=, unflatten=)."""

    def __init__(self, k, v, step=0):
        self.k, self.v, self.step = k, v, step


class OwnK:
    """What a careless unflatten builds: the value tensor is lost."""

    def __init__(self, k):
        self.k = k


def _own_flatten(c):
    return [c.k] + [getattr(c, f) for f in ("v", "extra") if hasattr(c, f)], c


def _with_extra(c: Own) -> Own:
    c.extra = c.k.clone()             # a leaf the bound object does not have
    return c


UNFLATTEN = {   # each a user's unflatten(tensors, context); context is the object bound
    "inverse": lambda ts, c: Own(ts[0], ts[1], c.step),
    "rewrapped": lambda ts, c: Own(ts[0].view(ts[0].shape), ts[1][:], c.step),   # new views, same memory
    "swapped": lambda ts, c: Own(ts[1], ts[0], c.step),
    "duplicated": lambda ts, c: Own(ts[0], ts[0], c.step),
    "dropped": lambda ts, c: OwnK(ts[0]),
    "added": lambda ts, c: _with_extra(Own(ts[0], ts[1], c.step)),
    "ignored": lambda ts, c: Own(ts[0], c.v, c.step),          # keeps the bound v, not the one given
    "not-a-tensor": lambda ts, c: Own(ts[0], None, c.step),
    "raises": lambda ts, c: Own(ts[2], ts[3]),
}


def _own_program(unflatten, rows=False):
    spec = pg.State(rows=bs if rows else None, flatten=_own_flatten, unflatten=unflatten)
    return pg.Program("own", inputs={"a": pg.Input((bs,), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)}, state={"c": spec}, buckets=[1, 2, 4])


def _own_state():
    return {"c": Own(torch.zeros(4), torch.zeros(4))}


def _own_body(x):
    x.c.k[: x.a.shape[0]] = x.a
    x.c.v[: x.a.shape[0]] = x.a * 10
    return {"y": x.c.k + x.c.v}


@pytest.mark.parametrize("rows", [False, True], ids=["bound", "batch-ordered"])
@pytest.mark.parametrize("form", ["inverse", "rewrapped"])
def test_an_inverse_flatten_pair_binds_and_writes_reach_each_leaf(form, rows):
    st = _own_state()
    runner = compile_ref(_own_program(UNFLATTEN[form], rows), _own_body, state=st)
    out = runner(a=torch.tensor([1.0, 2.0, 3.0]))
    assert out.y.tolist() == [11.0, 22.0, 33.0]
    assert st["c"].k.tolist()[:3] == [1.0, 2.0, 3.0] and st["c"].v.tolist()[:3] == [10.0, 20.0, 30.0]


def test_a_flatten_giving_one_tensor_twice_binds():
    """Two leaves that are one tensor (a shared K/V buffer): giving it back at both is the inverse."""
    t = torch.zeros(4)
    prog = _own_program(UNFLATTEN["duplicated"], rows=True)
    runner = compile_ref(prog, lambda x: {"y": x.c.k + x.c.v}, state={"c": Own(t, t)})
    assert runner(a=torch.ones(2)).y.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("rows", [False, True], ids=["bound", "batch-ordered"])
@pytest.mark.parametrize("form,parts", [
    ("swapped", ["at c[0] the tensor given as c[1]", "land in c[1]"]),
    ("duplicated", ["at c[1] the tensor given as c[0]"]),
    ("dropped", ["1 leaves where flatten gave 2", "c[1] is dropped"]),
    ("added", ["3 leaves where flatten gave 2", "c[2] is added"]),
    ("not-a-tensor", ["at c[1] NoneType where unflatten was given a tensor"]),
    ("raises", ["flatten(unflatten(leaves, context))", "IndexError"]),
])
def test_a_pair_that_is_not_inverse_is_refused_at_compile_naming_the_leaf(form, parts, rows):
    st = _own_state()
    with pytest.raises(pg.ContractValueError) as e:
        compile_ref(_own_program(UNFLATTEN[form], rows), _own_body, state=st)
    for p in ["program 'own'", "state 'c'"] + parts:
        assert p in str(e.value), f"message={str(e.value)!r}, but should contain {p!r}"
    assert st["c"].k.tolist() == [0.0] * 4 and st["c"].v.tolist() == [0.0] * 4    # nothing ran


def test_an_unflatten_ignoring_a_tensor_of_batch_ordered_state_is_refused():
    """The body would see the whole bound v, not its rows [0, bucket): its writes skip the cut."""
    with pytest.raises(pg.ContractValueError, match=r"at c\[1\] a tensor unflatten was not given"):
        compile_ref(_own_program(UNFLATTEN["ignored"], rows=True), _own_body, state=_own_state())
    # not batch-ordered: unflatten is never used on other tensors, and the object it builds is the bound one
    compile_ref(_own_program(UNFLATTEN["ignored"]), _own_body, state=_own_state())


# ---- rule 2.4: stride-aware aliasing ----------------------------------------------------------------
def test_byte_span_from_sizes_and_strides():
    buf = torch.zeros(40)
    p = buf.data_ptr()
    assert byte_span(buf[0:20:2]) == (p, p + 19 * 4)
    assert byte_span(buf[4:5].expand(8)) == (p + 16, p + 20)
    assert byte_span(buf[:0]) is None and byte_span(buf.view(4, 10)[:, :0]) is None
    assert byte_span(buf[10:20]) == (p + 40, p + 80)


def _aliasing():
    buf, big, row = torch.zeros(40), torch.zeros(8, 16), torch.zeros(20)
    return [  # (id, state, input, overlaps)
        ("step2-into-state", buf[10:20], buf[0:20:2], True),
        ("step2-before-state", buf[10:20], buf[1:10:2], False),
        ("rows-beside-columns", big[:, :4], big[:, 8:12], False),
        ("row-through-columns", big[:, :4], big[2], True),
        ("column-inside", big[:, :4], big[:, 3], True),
        ("expanded-beside", row[5:10], row[4:5].expand(8), False),
        ("expanded-inside", row[5:10], row[5:6].expand(8), True),
        ("empty", row[5:10], row[6:6], False),
        ("int32-view-beside", row[5:10], row.view(torch.int32)[4:5], False),
        ("int16-view-inside", row[5:10], row.view(torch.int16)[19:20], True),    # upper half of row[9]
        ("long-span-around-a-short-one", buf[0:40:10], buf[21:23], False),
    ]


@pytest.mark.parametrize("case,state,t,hit", _aliasing(), ids=[c[0] for c in _aliasing()])
def test_overlaps_is_exact_through_strides(case, state, t, hit):
    st = _bind(s=state)
    assert (st.overlaps(t) == "s") is hit and (st.overlaps(t) is None) is (not hit)


def test_overlaps_names_the_element_and_walks_nested_spans():
    base = torch.zeros(100)
    st = _bind(s=base[0:100:10], b=[torch.zeros(3), base[41:43]])
    assert st.overlaps(base[42:43]) == "b[1]" and st.overlaps(base[50:51]) == "s"
    assert st.overlaps(base[45:49]) is None and st.overlaps(torch.zeros(3)) is None


def test_overlaps_compares_devices():
    st = _bind(s=torch.zeros(4))
    assert st.overlaps(torch.empty(4, device="meta")) is None


def test_overlaps_stays_exact_past_the_listing_limit(monkeypatch):
    """Past _MAX_RUNS runs a tensor is halved until its runs can be listed: still exact."""
    import padgraph.state_memory as state_mod      # where the overlap test lives
    big = torch.zeros(8, 16)
    for limit in (1 << 22, 4, 1):
        monkeypatch.setattr(state_mod, "_MAX_RUNS", limit)
        st = _bind(s=big[:, :4])
        assert st.overlaps(big[:, 8:12]) is None, limit          # beside it: never assumed
        assert st.overlaps(big[:, 3:5]) == "s", limit             # one shared column
        assert st.overlaps(big[7:, 3]) == "s", limit              # one shared element
        assert st.overlaps(big[:, 4:].t()) is None, limit
        assert st.overlaps(big.t()[1::2]) == "s", limit           # odd columns 1 and 3


def test_runner_refuses_a_strided_input_into_state_and_accepts_one_beside_it():
    buf = torch.arange(40, dtype=torch.float32)
    runner = compile_ref(pg.Program("alias", inputs={"a": pg.Input((bs,), torch.float32, pad=0)},
                                    outputs={"y": pg.Output((bs,), torch.float32)}, state={"kv": pg.State()},
                                    buckets=[16]), lambda x: {"y": x.a * 2}, state={"kv": buf[10:20]})
    with pytest.raises(pg.ContractValueError, match="'alias'.*'a'.*'kv'"):
        runner(a=buf[0:20:2])
    assert runner(a=buf[1:10:2]).y.tolist() == [2.0, 6.0, 10.0, 14.0, 18.0]
    assert runner(a=buf[4:5].expand(3)).y.tolist() == [8.0, 8.0, 8.0]
