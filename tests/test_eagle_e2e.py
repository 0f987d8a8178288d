"""EAGLE end to end on the CPU (reference backend, fp32, tiny model): speculative output equals
plain greedy token for token, acceptance behaves (oracle draft: all; random draft: ~none), and
finished requests give their KV slots and rows back."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from models.eagle_head import EagleHead  # noqa: E402
from models.llama import LlamaConfig, LlamaModel  # noqa: E402
from spec_decode import SpecConfig, Worker  # noqa: E402

import padgraph as pg  # noqa: E402

LENS = [(5, 14), (11, 6), (3, 19), (8, 1), (6, 11)]   # (prompt, max_new): the batch shrinks


def prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n, _ in LENS]


def run_both(target, head, spec, eos_id=None, buckets=(1, 2, 4, 8)):
    w = Worker(target, head, spec, max_bs=8, max_context=64, eos_id=eos_id,
               buckets=pg.Buckets(list(buckets)))
    ps, mx = prompts(target.cfg.vocab_size), [m for _, m in LENS]
    with torch.no_grad():
        greedy, _ = w.generate_greedy(ps, mx)
        spec_reqs, stats = w.generate_spec(ps, mx)
    return w, greedy, spec_reqs, stats


def assert_released(w):
    assert w.slots.n_free == w.slots.n - 1
    assert w.rows.n_free == w.rows.n - 1
    assert not w.kv.req_to_token.any()


def test_paged_forwards_match_dense():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny()).eval()
    w = Worker(target, None, SpecConfig(), max_bs=4, max_context=32)
    ps = [[3, 9, 4, 1, 7], [5, 2, 8]]
    with torch.no_grad():
        reqs = w.admit(ps, [4, 4])
        logits, hidden, b = w.prefill(reqs)
        for r, p in enumerate(ps):
            dl, dh = target.forward_dense(torch.tensor([p]))
            torch.testing.assert_close(logits[r], dl[0, -1], rtol=1e-4, atol=1e-4)
            lo = int(b.qo[r])
            torch.testing.assert_close(hidden[lo:lo + len(p)], dh[0], rtol=1e-4, atol=1e-4)


def test_random_draft_exact_and_released():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny()).eval()
    head = EagleHead(target).eval()
    w, greedy, spec_reqs, stats = run_both(target, head, SpecConfig(3, 2, 5))
    for g, s in zip(greedy, spec_reqs):
        assert s.output == g.output, f"request {g.rid}"
        assert len(g.output) == g.max_new_tokens
    assert stats.accept_len < 1.5          # a random head accepts almost nothing
    assert_released(w)
    verify = w.runner("verify")
    assert sum(verify.stats.padded_lanes.values()) > 0   # odd raw sizes were padded


def test_oracle_draft_accepts_everything():
    torch.manual_seed(1)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    head = EagleHead.copy_of_target(target).eval()
    spec = SpecConfig(steps=4, topk=1, num_draft_tokens=5)   # a chain: every level is kept
    w, greedy, spec_reqs, stats = run_both(target, head, spec)
    for g, s in zip(greedy, spec_reqs):
        assert s.output == g.output
    assert stats.accept_len >= 0.95 * (spec.steps + 1), stats
    assert_released(w)


def test_eos_stops_both_paths_identically():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    head = EagleHead.copy_of_target(target).eval()
    w0, greedy, _, _ = run_both(target, head, SpecConfig(3, 2, 6))
    eos = greedy[2].output[5]               # a token the longest request emits mid-way
    w, greedy, spec_reqs, _ = run_both(target, head, SpecConfig(3, 2, 6), eos_id=eos)
    assert any(g.output[-1] == eos and len(g.output) < g.max_new_tokens for g in greedy)
    for g, s in zip(greedy, spec_reqs):
        assert s.output == g.output
    assert_released(w)
