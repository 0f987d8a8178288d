"""Goodness of fit for the sampling tests: Pearson's chi-square with its p-value from the
regularised upper incomplete gamma function (torch.special.gammaincc; no scipy needed).

A correct sampler passes with p >= P_MIN; the tests also show that a deliberately wrong one
fails the same test (p < P_MIN) at the same number of draws, so the test can fail."""
from __future__ import annotations

import math

import pytest
import torch

P_MIN = 1e-3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of observed counts [C] against probabilities
    [C]. Cells expected below 5 are pooled into one; an observation in a cell of probability 0
    gives p = 0 (an impossible outcome)."""
    counts, probs = counts.double().reshape(-1), probs.double().reshape(-1)
    n = counts.sum()
    if bool((counts[probs <= 0] > 0).any()):
        return float("inf"), 0, 0.0
    expected = n * probs / probs.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    if df < 1:
        return float(stat), df, 1.0
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)
    return float(stat), df, float(p)


def counts_of(tokens: torch.Tensor, n_cells: int) -> torch.Tensor:
    return torch.bincount(tokens.reshape(-1).long(), minlength=n_cells)



@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for these modules: their ops are many and small, where a second
    thread costs more in hand-offs than it computes (and the machine may be shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def exact_half_row() -> torch.Tensor:
    """Logits [1, V] (temperature 1: d = the logits) where the top token weighs exactly half of
    the row in `fixed_exp`'s integers, then two tied tokens: at top_p = 0.5 the weight above
    the tie is exactly top_p * total, the boundary of top-p's strict comparison."""
    from padgraph.llm.sampling import FIXED_ONE, fixed_exp
    ds, rem = [0.0], FIXED_ONE
    for d in (-0.7, -1.5, -3.0, -6.0, -10.0, -15.0, -20.0):
        w = int(fixed_exp(torch.tensor([d]))[0])
        while rem - w > 2 ** 12:
            ds.append(d)
            rem -= w
    d = torch.tensor(math.log(rem / FIXED_ONE), dtype=torch.float32)
    toward = {True: torch.tensor(0.0), False: torch.tensor(-30.0)}
    while (w := int(fixed_exp(d[None])[0])) != rem:     # weights step by < 1 down here
        d = torch.nextafter(d, toward[w < rem])
    row = torch.tensor([ds + [float(d)]])
    assert int(fixed_exp(row).sum()) == 2 * FIXED_ONE and ds[1] == ds[2] > ds[3]
    return row
