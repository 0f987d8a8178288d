"""The sampling kernels (`padgraph.backends.triton.sampling`) against the torch reference
(`padgraph.llm.sampling`): the same tokens bit for bit for the same keys, on awkward vocabulary
sizes, several chunks a row, ties, non-finite logits and every parameter at its edges; every
row through each way the kernels find a threshold (radix steps, gathers, splits, per-key
counts), and the longest way within the fixed number of passes; on a GPU at a 128256-token
vocabulary with flat and sharp logits, eager and inside a CUDA graph."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sampling_stats import exact_half_row, one_thread  # noqa: F401 (fixture)

from padgraph.backends.triton import sampling as K
from padgraph.llm import sampling as S
from padgraph.llm.sampling import PURPOSE_DECODE, PURPOSE_DRAFT


def random_lanes(n, V, g, device="cpu"):
    """Parameters that reach every branch: greedy, temperature only, top-k at 1 / V-1 / >= V,
    top-p tiny to 1, min-p up to 1, seeds over the whole int64 range."""
    r = lambda *s: torch.rand(*s, generator=g)                                  # noqa: E731
    temp = torch.where(r(n) < 0.2, 0.0, r(n) * 2 + 0.05)
    top_k = torch.randint(0, 6, (n,), generator=g)
    top_k = torch.where(r(n) < 0.2, torch.tensor([1, V - 1, V, V + 5])[torch.randint(4, (n,),
                                                                         generator=g)], top_k)
    top_k = torch.where(r(n) < 0.4, 0, top_k).int()
    top_p = torch.where(r(n) < 0.5, 1.0, r(n).clamp_min(1e-6))
    top_p = torch.where(r(n) < 0.05, 1e-7, top_p)
    min_p = torch.where(r(n) < 0.6, 0.0, r(n) * 0.3)
    min_p = torch.where(r(n) < 0.05, 1.0, min_p)
    seed = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=g).abs()
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    return [t.to(device) for t in (temp, top_k, top_p, min_p, seed, pos)]


def awkward_logits(n, V, g, device="cpu"):
    """Gaussian rows, rows of few distinct values (ties), rows with NaN / +-inf, a dead row."""
    x = torch.randn(n, V, generator=g) * torch.rand(n, 1, generator=g) * 6
    x[1::4] = torch.randint(-2, 3, (len(range(1, n, 4)), V), generator=g).float()
    x[2::7, 3] = float("nan")
    x[3::9, V // 2] = float("inf")
    x[3::9, 1] = float("inf")
    x[4::5, : V // 3] = float("-inf")
    x[5::11] = float("-inf")
    return x.to(device)


def lanes_of(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, device="cpu"):
    """Per-lane parameters [n] from scalars or lists (seeds 0.., position 11)."""
    t = lambda v, dtype: torch.tensor(v if isinstance(v, list) else [v] * n,  # noqa: E731
                                      dtype=dtype, device=device)
    return [t(temperature, torch.float32), t(top_k, torch.int32), t(top_p, torch.float32),
            t(min_p, torch.float32), torch.arange(n, device=device),
            torch.full((n,), 11, device=device)]


def modes_of(stages) -> set[str]:
    """The modes any row of a call went through (`K.MODES` names)."""
    bits = 0
    for m in stages.modes.tolist():
        bits |= m
    return {name for i, name in enumerate(K.MODES) if bits >> i & 1}


def check_stages(logits, args, purpose=PURPOSE_DECODE, **kw):
    """Runs the kernels: the reference's tokens, every row finished within the passes."""
    stages = K.sample_stages(logits, *args, purpose, **kw)
    want = S.sample(logits, *args, purpose, impl="torch")
    assert torch.equal(stages.tokens, want), (stages.tokens != want).nonzero()[:, 0].tolist()
    assert (stages.mode == 0).all() and (stages.passes <= K.PASSES).all(), stages
    return stages


def kept_weights(logits, temperature, kf):
    """The weights the key thresholds kf [n] keep (min-p off)."""
    d, _ = S._scaled(logits, temperature)
    key = d.view(torch.int32) & 0x7FFFFFFF
    return torch.where(key <= kf[:, None], S.fixed_exp(d), 0)


@pytest.mark.parametrize("V,chunk,cap,groups,small,pack,xs", [(37, 16, 4, None, None, None, 0),
                                                                (100, 32, 8, 1, 2, 8, 3),
                                                                (257, 64, 16, None, 4, 0, 1)])
def test_kernel_matches_the_reference_bit_for_bit(V, chunk, cap, groups, small, pack, xs):
    """cap: the keys a row may gather; small ones send rows through radix steps and splits.
    groups 1: one program a chunk does every row. small: gathers of at most this many keys
    end in registers that wide. pack: a split packs a chunk's keys first where at most this
    many count (None: the default, which is the whole chunk here; 0: never). xs: the programs
    sharing a row's chunks (0: one a chunk; 1: one program does every chunk)."""
    g = torch.Generator().manual_seed(V + chunk)
    n = 20 if groups else 16
    logits = awkward_logits(n, V, g)
    args = random_lanes(n, V, g)
    purpose = PURPOSE_DRAFT if V % 2 else PURPOSE_DECODE
    stages = check_stages(logits, args, purpose, chunk=chunk, cap=cap, groups=groups,
                          small=small, pack=pack, chunk_groups=xs)
    assert {"greedy", "weights", "k_hist", "p_split"} <= modes_of(stages)
    assert modes_of(stages) & {"k_gather", "p_gather"}


def test_kernel_matches_on_bf16_strided_rows_and_empty_batches():
    g = torch.Generator().manual_seed(3)
    V = 100
    wide = (torch.randn(8, 2 * V, generator=g) * 3).to(torch.bfloat16)
    logits = wide[:, ::2]                                   # stride 2 along the vocabulary
    args = random_lanes(8, V, g)
    assert torch.equal(K.sample_triton(logits, *args, PURPOSE_DECODE, chunk=32, cap=8),
                       S.sample(logits, *args, PURPOSE_DECODE, impl="torch"))
    rows = wide[::2, :V]                                    # a row stride of 4 * V
    args = [a[::2].contiguous() for a in args]
    assert torch.equal(K.sample_triton(rows, *args, PURPOSE_DECODE, chunk=64),
                       S.sample(rows, *args, PURPOSE_DECODE, impl="torch"))
    empty = [a[:0] for a in args]
    assert K.sample_triton(torch.zeros(0, V), *empty, PURPOSE_DECODE).shape == (0,)


def test_kernel_is_exact_at_parameter_edges():
    """Narrow nuclei, top-k at the tie boundary, min-p = 1 (only the top token and its ties),
    near-equal logits (thresholds between neighbouring floats), a NaN top-p (off)."""
    g = torch.Generator().manual_seed(4)
    V, n = 64, 3
    base = torch.randn(1, V, generator=g)
    logits = base + torch.arange(n)[:, None] * 1e-6 * torch.randn(n, V, generator=g)
    logits[:, 10:20] = logits[:, 10:11]                   # ten equal values
    edges = [(11, 1.0, 0.0), (15, 0.5, 0.0), (0, 0.02, 0.0), (0, 1.0, 1.0), (3, 0.999, 0.5),
             (V - 1, 0.9999, 1e-4), (5, float("nan"), 0.0)]       # NaN top_p: off, as HF's
    top_k, top_p, min_p = ([e[i] for e in edges for _ in range(n)] for i in range(3))
    args = lanes_of(n * len(edges), 0.9, top_k, top_p, min_p)
    check_stages(logits.repeat(len(edges), 1), args, chunk=32, cap=4)


def test_extreme_temperatures_match_the_reference():
    """A subnormal temperature (1 / t is inf: a 0 logit times it is NaN, so a row whose largest
    logit is 0 has no finite x) and a huge one, on rows with NaN, +-inf, zeros and ties, greedy
    and sampled parameters alike."""
    g = torch.Generator().manual_seed(12)
    V = 96
    x = awkward_logits(12, V, g)
    x[0] = -torch.rand(V, generator=g)
    x[0, 7] = 0.0                                         # the largest logit is 0
    x[1] = torch.where(torch.rand(V, generator=g) < 0.5, 0.0, -1.0)
    x[2, :5] = 0.0
    rows = x.repeat(3, 1)
    n = rows.shape[0]
    temps = [1e-40] * 12 + [3e-39] * 12 + [1e30] * 12
    for top_k, top_p, min_p in ((0, 1.0, 0.0), (5, 0.9, 0.0), (0, 0.5, 0.1)):
        check_stages(rows, lanes_of(n, temps, top_k, top_p, min_p), chunk=32, cap=8)


def test_generated_launches_match_the_reference():
    """Generated calls (hypothesis, fixed derandomized examples): vocabulary, rows, chunk, cap,
    SMALL, PACK, chunk groups X (a chunk a program or several), row groups (the first pass's
    too, which may differ from the later passes'), logits (awkward,
    Gaussian at any scale, tied), fp32 or bf16, every purpose, extreme temperatures; the
    tokens are the torch reference's and every row ends within the passes."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    @settings(max_examples=20, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(V=st.integers(4, 300), n=st.integers(1, 6), chunk=st.sampled_from([16, 32, 64]),
           cap=st.sampled_from([2, 4, 8, 64]), small=st.sampled_from([2, 4, 256]),
           pack=st.sampled_from([0, 8, 64]), xs=st.sampled_from([0, 1, 2, 3, None]),
           groups=st.sampled_from([1, 2, None]), kind=st.sampled_from(["awkward", "gauss", "ties"]),
           bf16=st.booleans(), purpose=st.integers(0, 3), extreme=st.booleans(),
           first=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2 ** 31 - 1))
    def run(V, n, chunk, cap, small, pack, xs, groups, kind, bf16, purpose, extreme, first, seed):
        g = torch.Generator().manual_seed(seed)
        if kind == "awkward":
            x = awkward_logits(n, V, g)
        elif kind == "gauss":
            x = torch.randn(n, V, generator=g) * float(torch.rand(1, generator=g) * 30)
        else:
            x = torch.randint(-3, 3, (n, V), generator=g).float() * 4
        args = random_lanes(n, V, g)
        if extreme:
            temps = torch.tensor([1e-40, 3e-39, 1e30, 1e-20, 0.0, 5.0, 1e-38, 2e-45])
            args[0] = temps[torch.randint(len(temps), (n,), generator=g)]
        chunks = -(-V // chunk)
        x_groups = None if xs is None else (chunks if xs == 0 else xs)   # 0: X = C
        check_stages(x.to(torch.bfloat16) if bf16 else x, args, purpose, chunk=chunk, cap=cap,
                     small=min(small, cap), pack=pack, chunk_groups=x_groups, groups=groups,
                     first_groups=first)

    run()


@pytest.mark.parametrize("cap", [2, 8])
def test_thresholds_are_exact_under_heavy_ties(cap):
    """Five distinct logits in 64: a tie group holds more tokens than a row may gather, so the
    search ends on a bracket narrowed to the group's one key, not on a gather."""
    g = torch.Generator().manual_seed(cap)
    n, V = 12, 64
    logits = torch.randint(-2, 3, (n, V), generator=g).float()
    args = lanes_of(n, 0.8, [3, 10, 20, 0] * 3, [1.0] * 4 + [0.3] * 4 + [0.7] * 4)
    check_stages(logits, args, chunk=32, cap=cap)


def test_every_threshold_keeps_exactly_the_references_weights():
    """Each filtered row's key threshold keeps the reference's weights, with the top tokens
    spread over the chunks or packed into one (sorted logits)."""
    g = torch.Generator().manual_seed(9)
    n, V = 16, 100
    logits = torch.randn(n, V, generator=g) * 2
    logits[::2] = logits[::2].sort(-1, descending=True).values
    logits[1::4] = logits[1::4].sort(-1).values
    temp = (torch.rand(n, generator=g) + 0.2).tolist()
    args = lanes_of(n, temp, [0, 2, 5, 9, 17, 40, 0, 80] * 2,
                    [0.2, 0.5, 0.9, 0.99, 1.0, 0.7, 0.8, 1.0] * 2)
    stages = check_stages(logits, args, chunk=32, cap=8, groups=3,    # rows g, g + 3, ...
                          chunk_groups=2,                            # chunks x, x + 2, ...
                          first_groups=5)                # in the first pass rows g, g + 5, ...
    want, _ = S.sampling_weights(logits, *args[:4])
    filtered = ((args[1] > 0) & (args[1] < V)) | (args[2] < 1)
    assert filtered.sum() >= 12
    got = kept_weights(logits, args[0], stages.kf)
    assert torch.equal(got[filtered], want[filtered])


def test_kernel_keeps_top_ps_strict_boundary():
    """The weight above the tie equals top_p * total exactly: the tie must go (a kernel
    comparing with <= keeps it and draws it half of the time)."""
    logits = exact_half_row().expand(4, -1)
    args = lanes_of(4, 1.0, 0, 0.5)
    for cap in (1, 16):                                     # found by splits, then gathered
        assert (K.sample_triton(logits, *args, PURPOSE_DECODE, chunk=16, cap=cap) == 0).all()


def test_wide_nuclei_match_the_reference():
    """Flat rows whose top-p keeps most of the vocabulary (a random model's logits): the
    threshold is found by splits of thousands of keys, then a gather; with top-k, min-p, tiny
    and near-1 top-p and greedy lanes beside them."""
    g = torch.Generator().manual_seed(12)
    n, V = 10, 3000
    logits = torch.randn(n, V, generator=g).to(torch.bfloat16)
    args = lanes_of(n, [1.0, 0.7, 1.5, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0, 1.0],
                    [0, 0, 0, 2500, 0, 40, 0, 0, 0, 1500],
                    [0.9, 0.95, 0.5, 0.9, 0.999, 0.9, 0.9, 1e-7, 0.99, 1.0],
                    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0])
    stages = check_stages(logits, args, chunk=512, cap=64)
    assert {"p_split", "p_gather", "k_hist", "k_gather", "greedy"} <= modes_of(stages)
    assert stages.passes.max() >= 4                         # several splits a row


@pytest.mark.parametrize("draw,small,pack", [(True, None, None), (False, None, None),
                                             (True, 4, 64), (False, 4, 0)])
def test_a_threshold_found_in_a_gather_draws_without_the_weights_pass(draw, small, pack):
    """With `gather_draw`, a row whose key threshold is found among gathered keys draws in that
    same pass (each chunk's kept weight from the splits' per-chunk weights below the bracket and
    its run of gathered keys) unless min-p is on: one pass fewer, the reference's token. Without
    it, every such row takes the weights pass. Flat rows (several splits before the gather) and
    sharp ones (one), top-p alone and after top-k, many seeds. small 4: the sharp rows' gathers
    of a few keys end in [4] registers, the flat rows' in [cap]; pack 64: the splits of chunks
    with at most 64 keys that count pack them first, the others sum every key (0: all do)."""
    g = torch.Generator().manual_seed(14)
    n, V = 16, 2000
    scale = torch.tensor([1.0, 3.0, 8.0])[torch.arange(n) % 3][:, None]
    logits = torch.randn(n, V, generator=g) * scale
    top_k = [0, 0, 40, 1500] * 4
    min_p = [0.0] * 13 + [0.05] * 3
    args = lanes_of(n, 0.9, top_k, [0.9, 0.5, 0.95, 0.8] * 4, min_p)
    args[4] = torch.randint(0, 2 ** 62, (n,), generator=g)
    stages = check_stages(logits, args, chunk=256, cap=64, gather_draw=draw, small=small,
                          pack=pack)
    gathered = (stages.modes & (1 << K.MODES.index("k_gather") | 1 << K.MODES.index("p_gather"))) > 0
    weighed = (stages.modes & 1 << K.MODES.index("weights")) > 0
    no_min_p = torch.tensor(min_p) == 0
    assert gathered[no_min_p].sum() >= 10 and gathered[~no_min_p].any()
    if not draw:
        assert weighed[gathered].all()
        return
    assert not weighed[gathered & no_min_p].any()           # drawn in the gather's pass
    assert weighed[~no_min_p].all()                          # min-p: the weights pass
    assert (stages.modes & 1 << K.MODES.index("p_split") > 0)[gathered & no_min_p].any()
    want, _ = S.sampling_weights(logits, *args[:4])          # the thresholds stay exact
    assert torch.equal(kept_weights(logits, args[0], stages.kf)[no_min_p], want[no_min_p])


def test_the_default_launch_matches_the_reference():
    """The launch serving uses (chunk 2048, cap 4096, SMALL, PACK, select_policy's G and X)
    over three chunks a row: sharp rows (splits that pack their keys, gathers searched in
    [SMALL]), flat ones (splits over every key, gathers in [CAP]), top-k, min-p, greedy."""
    g = torch.Generator().manual_seed(21)
    n, V = 18, 4100
    scale = torch.tensor([12.0, 1.0, 4.0])[torch.arange(n) % 3][:, None]
    logits = torch.randn(n, V, generator=g) * scale
    args = lanes_of(n, [0.7, 1.0, 0.0] * 6, [0, 0, 0, 50, 2000, 0] * 3,
                    [0.9, 0.95, 0.5, 0.9, 0.8, 1.0] * 3, [0.0] * 15 + [0.02] * 3)
    args[4] = torch.randint(0, 2 ** 62, (n,), generator=g)
    stages = check_stages(logits, args)
    assert {"greedy", "p_split", "p_gather", "k_hist"} <= modes_of(stages)


@pytest.mark.parametrize("draw,first", [(True, None), (False, None), (True, 12)])
def test_a_sharp_row_finds_top_p_in_its_first_pass(draw, first):
    """A top-p row (no top-k) whose chunks hold at most CAP keys within NEAR of their maxima
    gathers its keys with |d| < NEAR in its first pass while it weighs the whole row (P_NEAR).
    Where those keys hold top_p of the weight, top-p's key is found among them and the row is
    drawn in that pass (min-p off, `gather_draw`), else it takes the weights pass; the
    thresholds stay the reference's. first 12: the first pass has a row group a row (the
    later ones the test's default). Top-k rows (the last lane of each three) take K_HIST as
    before."""
    g = torch.Generator().manual_seed(31)
    n, V = 12, 3000
    scale = torch.tensor([15.0, 25.0, 40.0])[torch.arange(n) % 3][:, None]
    logits = torch.randn(n, V, generator=g) * scale
    min_p = [0.0] * 10 + [0.01] * 2
    top_k = [0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 2]
    args = lanes_of(n, [0.7, 1.0, 1.3] * 4, top_k, [0.9, 0.5, 0.99, 0.8] * 3, min_p)
    args[4] = torch.randint(0, 2 ** 62, (n,), generator=g)
    stages = check_stages(logits, args, chunk=256, cap=64, gather_draw=draw, first_groups=first)
    near = (stages.modes & 1 << K.MODES.index("p_near")) > 0
    assert near.tolist() == [k == 0 for k in top_k]
    assert modes_of(stages) >= {"p_near", "k_hist"}
    no_min_p = torch.tensor(min_p) == 0
    assert (stages.passes[no_min_p & near] == (1 if draw else 2)).all()
    assert (stages.passes[~no_min_p & near] == 2).all()
    want, _ = S.sampling_weights(logits, *args[:4])
    assert torch.equal(kept_weights(logits, args[0], stages.kf)[no_min_p], want[no_min_p])


def test_a_near_gather_wider_than_small_is_gathered_again():
    """P_NEAR ends in [SMALL] registers: a row that gathered more keys near its maximum than
    SMALL (but at most CAP) gathers them again in the next pass, which ends as P_GATHER's
    does (drawn there, `gather_draw`); the reference's tokens and thresholds."""
    g = torch.Generator().manual_seed(32)
    n, V = 8, 3000
    logits = torch.randn(n, V, generator=g) * 12
    args = lanes_of(n, 1.0, 0, [0.9, 0.99] * 4)
    args[4] = torch.randint(0, 2 ** 62, (n,), generator=g)
    stages = check_stages(logits, args, chunk=256, cap=64, small=4, gather_draw=True)
    near = (stages.modes & 1 << K.MODES.index("p_near")) > 0
    again = near & ((stages.modes & 1 << K.MODES.index("p_gather")) > 0)
    assert near.all() and again.any() and (stages.passes[again] == 2).all()
    want, _ = S.sampling_weights(logits, *args[:4])
    assert torch.equal(kept_weights(logits, args[0], stages.kf), want)


def test_a_near_gather_short_of_top_p_splits_from_the_start():
    """The top token, then a thousand tokens just past NEAR (|d| = 8.5, each e**-8.5 of the
    top): few keys lie within NEAR, so the row starts in P_NEAR, but they weigh less than
    top_p of the row. The row then splits from the start as if P_NEAR had not been: the
    reference's token. A row whose chunks hold more than CAP keys within NEAR of their maxima
    (flat) never tries P_NEAR, nor does a top-k row."""
    V = 1500
    x = torch.full((V,), -40.0)
    x[:1000] = -8.5
    x[1000] = 0.0
    near_short = x[torch.randperm(V, generator=torch.Generator().manual_seed(1))]
    flat = torch.randn(V, generator=torch.Generator().manual_seed(2))
    logits = torch.stack([near_short, near_short, flat, near_short])
    args = lanes_of(4, 1.0, [0, 0, 0, 500], [0.9, 0.3, 0.9, 0.9])
    stages = check_stages(logits, args, chunk=128, cap=64, gather_draw=True)
    modes = [{K.MODES[i] for i in range(len(K.MODES)) if m >> i & 1} for m in stages.modes.tolist()]
    assert {"p_near", "p_split"} <= modes[0]                # short: split from the start
    assert modes[1] == {"p_near"}                           # top_p 0.3: the top token holds it
    assert "p_near" not in modes[2] and "p_split" in modes[2]
    assert "p_near" not in modes[3] and "k_hist" in modes[3]


def test_a_dense_bracket_is_counted_key_by_key():
    """Hundreds of tokens on consecutive floats (a bracket too full to gather but at most 256
    keys wide): its weights come from one count per key."""
    g = torch.Generator().manual_seed(13)
    keys = 0x3F800000 + torch.randperm(300, generator=g)       # |d| just above 1.0
    logits = torch.cat([torch.zeros(1), -keys.to(torch.int32).view(torch.float32)])[None]
    args = lanes_of(3, 1.0, [0, 0, 200], [0.5, 0.97, 0.8])
    stages = check_stages(logits.expand(3, -1), args, chunk=64, cap=8)
    assert "p_hist" in modes_of(stages)


def row_from_keys(keys, V):
    """Logits [1, V] with max 0 at temperature 1 (so d = the logits) whose keys are `keys` and
    0 (the top token); the rest -inf; shuffled."""
    x = torch.full((V,), float("-inf"))
    x[: len(keys)] = -torch.tensor(keys, dtype=torch.int32).view(torch.float32)
    x[len(keys)] = 0.0
    return x[torch.randperm(V, generator=torch.Generator().manual_seed(0))][None]


def test_the_longest_way_fits_the_passes():
    """Keys built so that no bracket ever fits a gather of 2 (clusters at every scale around the
    top-p key, three consecutive keys at the top-k key): top-k takes 4 radix steps, top-p 7
    (the table, five splits, per-key counts), the draw 1: exactly PASSES, and exact."""
    K0, kk = 80 << 23, 100 << 23
    keys = [K0] + [K0 + s * m * 16 ** j for j in range(7) for m in (1, 2, 3) for s in (-1, 1)]
    keys += [kk - 1, kk, kk + 1]
    logits = row_from_keys(keys, 128)
    d = logits[0]
    w, key = S.fixed_exp(d), d.view(torch.int32) & 0x7FFFFFFF
    top_p = float(w[key < K0].sum() + w[key == K0].sum() / 2) / float(w[key <= kk].sum())
    args = lanes_of(1, 1.0, int((key <= kk).sum()), top_p)
    stages = check_stages(logits, args, chunk=32, cap=2)
    assert stages.passes.item() == K.PASSES and stages.kf.item() == K0
    assert {"k_hist", "p_split", "p_hist"} <= modes_of(stages)


def test_the_kernels_integer_helpers_are_the_references():
    """fixed_exp, mulhi62 and the stream through a one-program probe kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(D, W, U, Z, H, SEED, POS, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ok = i < n
        tl.store(W + i, K._fixed_exp_t(tl.load(D + i, mask=ok, other=0.0)), mask=ok)
        tl.store(H + i, K._random_bits_t(tl.load(SEED + i, mask=ok), tl.load(POS + i, mask=ok),
                                         2, 5), mask=ok)
        tl.store(U + i, K._mulhi62_t(tl.load(U + i, mask=ok), tl.load(Z + i, mask=ok)), mask=ok)

    g = torch.Generator().manual_seed(5)
    n = 500
    d = torch.cat([-torch.rand(n - 4, generator=g) * 30, torch.tensor([0.0, -0.0, -28.0,
                                                                        float("-inf")])])
    u = torch.randint(0, 2 ** 62, (n,), generator=g)
    z = torch.randint(0, 2 ** 58 + 1, (n,), generator=g)
    seed = torch.randint(0, 2 ** 63 - 1, (n,), generator=g)
    pos = torch.randint(0, 2 ** 40, (n,), generator=g)
    w, h, got_u = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long), u.clone()
    probe[(1,)](d, w, got_u, z, h, seed, pos, n, BLOCK=512)
    assert torch.equal(w, S.fixed_exp(d))
    assert torch.equal(got_u, S.mulhi62(u, z))
    assert torch.equal(h, S.random_bits(seed, pos, 2, 5))


def test_auto_picks_torch_on_cpu_tensors():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 37, generator=g)
    args = random_lanes(4, 37, g)
    assert torch.equal(S.sample(logits, *args, PURPOSE_DECODE),
                       S.sample(logits, *args, PURPOSE_DECODE, impl="torch"))


@pytest.mark.parametrize("V", [37, 257])
def test_probabilities_from_the_kernels_thresholds_are_the_references(V):
    """`sampling_probs` with the Triton sampler's key thresholds (no sort) gives the sorting
    reference's values bit for bit, on every kind of row and parameter."""
    g = torch.Generator().manual_seed(V)
    n = 24
    logits = awkward_logits(n, V, g)
    args = random_lanes(n, V, g)[:4]
    want = S.sampling_probs(logits, *args, impl="torch")
    got = S.sampling_probs(logits, *args, impl="triton")
    assert torch.equal(got, want), (got != want).any(-1).nonzero()[:, 0].tolist()
    assert torch.equal(S.sampling_probs(logits, *args), want)          # auto: torch on CPU


# --------------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_kernel_matches_the_reference_on_gpu_at_llama3_vocabulary(bs):
    V = 128256
    g = torch.Generator().manual_seed(bs)
    logits = (torch.randn(bs, V, generator=g) * torch.rand(bs, 1, generator=g) * 8).cuda()
    logits[1::4, ::3] = float("-inf")
    args = random_lanes(bs, V, g, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        want = S.sample(x, *args, PURPOSE_DECODE, impl="torch")
        got = S.sample(x, *args, PURPOSE_DECODE)                 # auto: the kernel on CUDA
        assert torch.equal(got, want), (got != want).nonzero()[:, 0].tolist()
        greedy = args[0] == 0
        assert torch.equal(got[greedy], x.argmax(-1)[greedy])


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_wide_nuclei_match_the_reference_on_gpu(bs):
    """A random model's flat logits (top-p keeps ~100k tokens) and sharp ones, with top-k,
    min-p and greedy lanes mixed in; every row done within the passes."""
    V = 128256
    g = torch.Generator().manual_seed(100 + bs)
    scale = torch.tensor([1.0, 1.0, 3.0, 8.0])[torch.arange(bs) % 4][:, None]
    x = (torch.randn(bs, V, generator=g) * scale).to(torch.bfloat16).cuda()
    pick = lambda vals: [vals[i % len(vals)] for i in range(bs)]              # noqa: E731
    args = lanes_of(bs, pick([1.0, 0.7, 1.5, 1.0, 0.0]), pick([0, 0, 50, 5000, 0, 0, 100]),
                    pick([0.9, 0.95, 0.99, 0.5, 0.9, 1e-7, 0.9]),
                    pick([0.0, 0.0, 0.0, 0.05, 0.0, 0.0]), device="cuda")
    stages = check_stages(x, args)
    if bs >= 16:
        assert {"p_split", "p_gather", "k_gather"} <= modes_of(stages)


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 64])
def test_probabilities_match_the_reference_on_gpu(bs):
    """`sampling_probs` on CUDA (the kernels' thresholds) against the sorting reference at a
    128256-token vocabulary: flat and sharp rows, every filter, greedy lanes."""
    V = 128256
    g = torch.Generator().manual_seed(200 + bs)
    scale = torch.tensor([1.0, 3.0, 8.0])[torch.arange(bs) % 3][:, None]
    x = (torch.randn(bs, V, generator=g) * scale).cuda()
    args = random_lanes(bs, V, g, device="cuda")[:4]
    want = S.sampling_probs(x, *args, impl="torch")
    got = S.sampling_probs(x, *args)                                 # auto: the kernels on CUDA
    assert torch.equal(got, want), (got != want).any(-1).nonzero()[:, 0].tolist()


@pytest.mark.cuda
def test_kernel_in_a_cuda_graph_draws_fresh_keys_on_every_replay():
    """Captured once; each replay reads the seeds and positions in its input buffers, and
    returns the eager call's tokens for them (no capture-time value survives)."""
    V, bs = 128256, 16
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(bs, V, generator=g).cuda()
    args = random_lanes(bs, V, g, device="cuda")
    static = [a.clone() for a in args]
    S.sample(logits, *static, PURPOSE_DECODE)                    # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = S.sample(logits, *static, PURPOSE_DECODE)
    for step in range(3):
        fresh = random_lanes(bs, V, g, device="cuda")
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        assert torch.equal(out, S.sample(logits, *fresh, PURPOSE_DECODE, impl="torch"))


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_pdl_launches_in_a_cuda_graph_give_the_reference_tokens(bs):
    """`sample_stages(pdl=True)` (each pass launched while the one before runs, waiting before
    its first read) captured after a kernel that writes the logits: every replay's tokens are
    the torch reference's for the logits and lanes of that replay."""
    V = 128256
    g = torch.Generator().manual_seed(300 + bs)
    base = torch.randn(bs, V, generator=g).cuda()
    scale = torch.ones(bs, 1, device="cuda")
    args = random_lanes(bs, V, g, device="cuda")
    static = [a.clone() for a in args]
    logits = base * scale
    K.sample_stages(logits, *static, PURPOSE_DECODE, pdl=True)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = base * scale                                   # the kernel before the sampler
        out = K.sample_stages(logits, *static, PURPOSE_DECODE, pdl=True).tokens
    for step in range(3):
        scale.fill_(1.0 + 3.0 * step)
        for s_, f in zip(static, random_lanes(bs, V, g, device="cuda")):
            s_.copy_(f)
        graph.replay()
        want = S.sample(base * scale, *static, PURPOSE_DECODE, impl="torch")
        assert torch.equal(out, want), step


COMPILE_SCRIPT = textwrap.dedent('''
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from padgraph.backends.triton import sampling as K

    def build(kernel, types, constexprs, num_warps, **options):
        params = inspect.signature(kernel.fn).parameters
        sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
        out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=num_warps, enable_fp_fusion=False,
                                          **options))
        assert "cubin" in out.asm, sorted(out.asm)
        ptx = out.asm["ptx"]
        assert "fma.rn.f32" not in ptx, "an fp32 FMA: the weights would differ"
        assert "div.full.f32" not in ptx and "div.approx.f32" not in ptx, "an inexact divide"
        print("compiled", kernel.fn.__name__)
        return out

    lanes = {"L": "*bf16", "Temp": "*fp32", "TopK": "*i32", "TopP": "*fp32", "MinP": "*fp32",
             "Seed": "*i64", "Pos": "*i64", "Out": "*i64", "PartV": "*fp32", "PartI": "*i32",
             "PartNan": "*i32", "PartM": "*fp32", "PartN": "*i32", "State": "*i64", "HistPart": "*i32",
             "CntPart": "*i32", "MassPart": "*i64", "BoundPart": "*i32", "ZPart": "*i64",
             "Buf": "*i32", "Count": "*i32", "Arrive": "*i32", "Span": "*i32", "CBase": "*i64",
             "Pref": "*i64", "Pack": "*i32"}
    build(K._chunk_max_kernel, lanes, dict(CHUNK=K.CHUNK, SP=16, PDL=False), K.CHUNK_WARPS)
    # one row: 8 warps, a program a chunk (ONE); 16 rows and more: 4 warps, a chunk loop
    for first, draw, warps, pdl, one in ((True, False, 8, False, True),
                                         (False, False, 8, False, True),
                                         (True, True, 4, False, False),
                                         (False, True, 4, False, False),
                                         (False, True, 4, True, False)):
        k = build(K._select_kernel, lanes, dict(FIRST=first, CHUNK=K.CHUNK, SUB=K.SUB, CP=64,
                                                CAP=K.CAP, SMALL=K.SMALL, PACK=K.PACK, DRAW=draw,
                                                ONE=one, PDL=pdl),
                  warps,
                  maxnreg=K.SELECT_REGS)
        ptx = k.asm["ptx"]
        if pdl:     # the wait comes before the first global load: nothing of the pass before
            assert ptx.count("griddepcontrol.wait") == 1, "one wait"
            assert "ld.global" not in ptx[:ptx.find("griddepcontrol.wait")], "a read before it"
        else:
            assert "griddepcontrol" not in ptx
''')


def test_kernels_compile_for_sm90_without_fp32_fmas(tmp_path):
    """Triton's real compiler (no GPU): the interpreter would not catch code it rejects (a
    non-constexpr global, a loop-carried type change), nor an FMA that breaks bit-exactness."""
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no NVIDIA backend in this Triton: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                       text=True)
    if p.returncode and "ptxas" in p.stderr and "not found" in p.stderr.lower():
        pytest.skip("no ptxas for sm_90 in this Triton")
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.count("compiled") == 6
