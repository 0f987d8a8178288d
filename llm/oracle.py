"""The speculative-decoding oracle: greedy speculative output equals plain greedy decoding of the
target token for token (fp32 exact; bf16 allowed to differ only where the target's top-2 logits
tie within `TIE_TOL`)."""
from __future__ import annotations


# bf16 near-tie tolerance for the oracle. The lm_head writes bf16 logits, so two paths that
# compute the same logit differ by whole ulps at its magnitude: ulp = 2**-7 for |x| in [1, 2),
# 2**-6 in [2, 4). Measured on the CPU in bf16 (same prefix, target logits through the decode
# path vs chain trees through the verify path): max |diff| 0.0078 (1 ulp) on the 1B shape at
# init_std 0.008 (|logit| <= 2.05), 0.035 at init_std 0.02 (|logit| <= 5.3). Two logits that
# each move by d can swap only if their gap is <= 2d; allowing the GPU kernels 2 ulps each at
# |logit| in [2, 4) gives 4 * 2**-6.
TIE_TOL = 4 * 2 ** -6


def first_divergences(refs, outs, ref_gaps, tie_tol: float, ids=None):
    """The oracle on token lists. Per request, the first index where `outs` and `refs` differ and
    the reference's top-2 logit gap there; only that first divergence is judged (afterwards the
    two runs continue from different prefixes). Returns (n exact, near ties [(id, index, gap)]
    with gap <= tie_tol, other divergences): a request "matches" when exact or a near tie. One
    output a strict prefix of the other is a length bug, never a tie (gap inf)."""
    match, ties, real = 0, [], []
    for n, (ref, out) in enumerate(zip(refs, outs)):
        rid = ids[n] if ids is not None else n
        if ref == out:
            match += 1
            continue
        i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if i is None:
            real.append((rid, min(len(ref), len(out)), float("inf")))
            continue
        gap = ref_gaps[n][i] if ref_gaps is not None and i < len(ref_gaps[n]) else float("inf")
        (ties if gap <= tie_tol else real).append((rid, i, round(gap, 4)))
    return match, ties, real


def compare(greedy, spec, tie_tol: float):
    """`first_divergences` of speculative requests against greedy ones (ids: the requests' rid)."""
    return first_divergences([g.output for g in greedy], [s.output for s in spec],
                             [g.gaps for g in greedy], tie_tol, [g.rid for g in greedy])


def oracle_line(match, ties, real) -> str:
    """`first_divergences`' verdict as one line: greedy_match=N/N (exact, near ties, other)."""
    n = match + len(ties) + len(real)
    return (f"greedy_match={match + len(ties)}/{n} (exact {match}, first divergence at a "
            f"top-2 near-tie {len(ties)}, other {len(real)})")
