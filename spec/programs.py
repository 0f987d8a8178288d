"""Programs the cases share, with bodies that copy what they read into probes (bound state).

`pads_program()` has one input of each kind SPEC.md's Terms name: a bucketed-axis buffer
(`seq_lens`), `bs + 1` with Edge (`cu`), a size factor `bs * 4` (`topk`), a fixed trailing dim
(`hidden`), a dependent axis `tok` with capacity `bs * 2` (`ids`), multi-axis Fill (`mask`) and
multi-axis Edge (`edge2`), and an unpadded input (`fixed`).
"""
from __future__ import annotations

import random

import torch

import padgraph as pg

from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2)

PAD_INPUTS = {
    "seq_lens": pg.Input((bs,), torch.int32, pad=1),
    "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
    "topk": pg.Input((bs * 4,), torch.int64, pad=0),
    "hidden": pg.Input((bs, 3), torch.float32, pad=0.5),
    "ids": pg.Input((tok,), torch.int64, pad=-1),
    "mask": pg.Input((bs, tok), torch.int32, pad=7),
    "edge2": pg.Input((tok, bs), torch.int32, pad=pg.Edge(default=9)),
    "fixed": pg.Input((5,), torch.int64),
}
PROBE_SIZE = 2 * S.LADDER[-1] + 2   # probes hold any size the cases reach, past the ladder too


def pads_program(ladder=S.LADDER, name: str = "pads") -> pg.Program:
    state = {f"p_{n}": pg.State() for n in PAD_INPUTS}
    state.update(p_bucket=pg.State(), p_ext=pg.State())
    return pg.Program(name, inputs=PAD_INPUTS, outputs={"y": pg.Output((bs,), torch.int32)},
                      state=state, buckets=pg.Buckets(list(ladder)))


def pads_state(program: pg.Program, device) -> dict:
    st = {f"p_{n}": S.probe(S.padded_shape(program, n, PROBE_SIZE), spec.dtype, device)
          for n, spec in PAD_INPUTS.items()}
    st["p_bucket"] = S.probe((1,), torch.int64, device)
    st["p_ext"] = S.probe((2,), torch.int32, device)
    return st


def probing_body(x, mutate: bool = False):
    """Copies every input, the bucket and the extents into the probes; then, if asked, scribbles
    over its padded inputs in place (a body is allowed to: rule 1.3 makes the next call clean)."""
    for n in PAD_INPUTS:
        S.write_probe(x[f"p_{n}"], x[n])
    x.p_bucket.fill_(x.bucket)
    x.p_ext[0].copy_(x.extent("bs"))
    x.p_ext[1].copy_(x.extent("tok"))
    y = x.seq_lens * 1
    if mutate:
        x.seq_lens.add_(100)
        x.cu.mul_(3)
        x.topk.fill_(123)
        x.hidden.fill_(-9.0)
        x.ids.fill_(55)
        x.mask.fill_(66)
        x.edge2.fill_(77)
    return {"y": y}


def pads_raw(n: int, n_tok: int, device, seed: int) -> dict:
    """Raw inputs with n requests and n_tok tokens; distinct values, so a stale lane shows."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, dtype: torch.randint(2, 1000, shape, generator=g).to(dtype).to(device)
    cu = torch.cumsum(torch.randint(1, 5, (n + 1,), generator=g), 0).to(torch.int32).to(device)
    return {
        "seq_lens": r(n, dtype=torch.int32), "cu": cu, "topk": r(4 * n, dtype=torch.int64),
        "hidden": torch.randn(n, 3, generator=g).to(device), "ids": r(n_tok, dtype=torch.int64),
        "mask": r(n, n_tok, dtype=torch.int32), "edge2": r(n_tok, n, dtype=torch.int32),
        "fixed": r(5, dtype=torch.int64),
    }


def check_probes(program, state, raw, n: int, n_tok: int, case: str) -> None:
    """Every probe shows the padded view SPEC.md's Terms define, at the bucket rule 3 picks."""
    size = S.fit(program, {"bs": n, "tok": n_tok})
    S.assert_equal("x.bucket", int(state["p_bucket"][0]), size, case)
    S.assert_equal("x.extent(bs), x.extent(tok)", state["p_ext"].cpu().tolist(), [n, n_tok], case)
    for name, spec in PAD_INPUTS.items():
        shape = S.padded_shape(program, name, size)
        want = S.expected_padded(raw[name], shape, spec.pad, S.dims_of(program, name))
        got = S.read_probe(state[f"p_{name}"], shape)
        S.assert_equal(f"padded view of {name!r} at size {size}", got, want, case)
        # the probe beyond the bucket's shape is untouched: the view had exactly that shape
        S.assert_equal(f"lanes of {name!r} beyond the bucket's shape",
                       int((state[f"p_{name}"] != S.SENTINEL).sum()), _numel(shape), case)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def extent_cases(n_random: int = 4, seed: int = 1) -> list[tuple[str, int, int]]:
    """(label, n_bs, n_tok): the bs edges of support.extents with token counts at their edges."""
    rng = random.Random(seed)
    cases = []
    for label, n in S.extents(n_random=n_random, seed=seed):
        cap = 2 * S.fit(pads_program(), {"bs": n, "tok": 0})
        cases.append((f"{label},tok=0", n, 0))
        cases.append((f"{label},tok=cap{cap}", n, cap))
        cases.append((f"{label},tok=random", n, rng.randint(1, cap)))
    cases.append(("raw=1,tok=past-bs-cap:5", 1, 5))      # tokens, not requests, pick the bucket
    return cases
