"""The HF client (examples/hf_llama.py) at its edges, on the CPU (fp32, reference backend):
greedy tokens equal HF's own generate (StaticCache and DynamicCache) for batches off the ladder,
prompts of mixed lengths, budgets of one and a batch past the largest bucket, eager and compiled;
repeated serves equal fresh runners; requests that do not fit the cache or the vocabulary are
refused before anything is written; a call never writes the caller's cache counters (an input
taken from one is not changed); rejected calls change nothing; a re-allocated cache is a
StateStorageError."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import hf_llama as H  # noqa: E402

import padgraph as pg  # noqa: E402


@pytest.fixture(scope="session")
def model():
    return H.build_model(H.tiny_config(), torch.device("cpu"), torch.float32)


def fresh(model, rows=4, cache_len=24, ladder=(1, 2, 4), **opts):
    cache, seen = H.new_cache(model, rows, cache_len)
    runner, _, _ = H.build_runner(model, cache, seen, list(ladder), "reference", **opts)
    return runner, cache, seen


def snapshot(cache, seen):
    return [t.clone() for t in H.flatten_cache(cache)[0]] + [seen.clone()]


def changed(snap, cache, seen):
    now = H.flatten_cache(cache)[0] + [seen]
    labels = [f"cache[{i}]" for i in range(len(now) - 1)] + ["seen"]
    return [l for l, a, b in zip(labels, snap, now) if not torch.equal(a, b)]


def _prefilled(model):
    runner, cache, seen = fresh(model)
    prompts, _ = H.make_requests(3, model.config.vocab_size, 8, 4, seed=3)
    first, width = H.prefill(model, cache, seen, prompts)
    pos = torch.tensor([len(p) for p in prompts])
    return runner, cache, seen, first, width, pos


def test_serve_too_long_prompt_raises_before_touching_the_cache(model):
    runner, cache, seen = fresh(model, cache_len=12)
    H.serve(model, runner, cache, seen, [[5, 6, 7], [8, 9]], [3, 3])
    snap = snapshot(cache, seen)
    with pytest.raises(Exception) as e:
        H.serve(model, runner, cache, seen, [[5] * 14, [6] * 3], [2, 2])       # 14 > max_cache_len 12
    assert changed(snap, cache, seen) == [], \
        f"state changed={changed(snap, cache, seen)} by a rejected serve ({e.value!r}), but should be []"
    assert isinstance(e.value, ValueError) and "12" in str(e.value), \
        f"error={e.value!r}, but should be a ValueError naming the cache length 12"


def test_serve_more_requests_than_cache_rows_raises_before_touching_the_cache(model):
    runner, cache, seen = fresh(model, rows=4)
    H.serve(model, runner, cache, seen, [[5, 6, 7], [8, 9]], [3, 3])
    snap = snapshot(cache, seen)
    with pytest.raises(Exception) as e:
        H.serve(model, runner, cache, seen, [[5, 6, 7]] * 5, [2] * 5)          # 5 requests, 4 rows
    assert changed(snap, cache, seen) == [], \
        f"state changed={changed(snap, cache, seen)} by a rejected serve ({e.value!r}), but should be []"
    assert isinstance(e.value, ValueError) and "4" in str(e.value), \
        f"error={e.value!r}, but should be a ValueError naming the 4 cache rows"


def test_serve_budget_past_the_cache_raises_before_touching_the_cache(model):
    """prompt 10 + 6 new tokens needs 15 columns; the cache has 12: refused up front, naming the
    cache, not midway through decode with a shape error about an input the caller never passed."""
    runner, cache, seen = fresh(model, cache_len=12)
    snap = snapshot(cache, seen)
    with pytest.raises(Exception) as e:
        H.serve(model, runner, cache, seen, [[5] * 10, [6] * 3], [6, 2])
    assert "write_pos" not in str(e.value), f"error={e.value!r}, but should say the cache (12 columns) is too short"
    assert changed(snap, cache, seen) == [], \
        f"state changed={changed(snap, cache, seen)} by a rejected serve, but should be []"


def test_an_input_taken_from_the_caches_counter_is_not_written(model):
    """SPEC 5.1: a call never writes the caller's input tensors. The cache's write counters live in
    flatten_cache's context, not among the leaves; the runner's cache has counters of its own, so
    write_pos taken from the caller's cache's counter is left as it was."""
    runner, cache, seen, first, width, pos = _prefilled(model)
    wp = cache.layers[0].cumulative_length.view(1)            # = width: "write where the cache is"
    assert wp.item() == width
    try:
        runner(input_ids=first, position_ids=pos, write_pos=wp)
    except pg.ContractValueError:
        return                                                 # rejected as aliasing state: fine
    assert wp.item() == width, f"write_pos={wp.item()} after the call, but should be {width} (the caller's input)"


def dyn_generate(model, prompts, max_new):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64); mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(max_new))
    return [row[width:width + k] for row, k in zip(out.tolist(), max_new)]


@pytest.mark.parametrize("n,ladder,rows", [(3, (1, 2, 4), 4), (5, (1, 2, 4, 8), 8), (7, (2, 8), 8),
                                           (6, (1, 2, 4), 6)])   # last: past the largest bucket
def test_greedy_matches_hf_static_and_dynamic_generate(model, n, ladder, rows):
    prompts, budgets = H.make_requests(n, 512, 10, 6, seed=n)
    runner, cache, seen = fresh(model, rows=rows, cache_len=max(map(len, prompts)) + max(budgets), ladder=ladder)
    ours = H.serve(model, runner, cache, seen, prompts, budgets)
    with torch.no_grad():
        assert ours == H.hf_generate(model, prompts, budgets)
    assert ours == dyn_generate(model, prompts, budgets)


@pytest.mark.parametrize("budgets", [[1, 1, 1, 1], [1, 5, 1, 3], [4, 1, 1, 1]])
def test_budgets_of_one(model, budgets):
    prompts, _ = H.make_requests(4, 512, 9, 2, seed=7)
    runner, cache, seen = fresh(model, cache_len=20)
    with torch.no_grad():
        assert H.serve(model, runner, cache, seen, prompts, budgets) == H.hf_generate(model, prompts, budgets)


def test_repeated_serves_on_one_runner_equal_fresh_runners(model):
    runner, cache, seen = fresh(model, rows=6, cache_len=24)
    for seed, n in [(1, 3), (2, 4), (3, 1), (4, 6), (1, 3)]:
        p, m = H.make_requests(n, 512, 8, 6, seed=seed)
        r2, c2, s2 = fresh(model, rows=6, cache_len=24)
        assert H.serve(model, runner, cache, seen, p, m) == H.serve(model, r2, c2, s2, p, m)


def test_rejected_calls_change_nothing_and_outputs_are_owned(model):
    runner, cache, seen = fresh(model)
    prompts, _ = H.make_requests(3, 512, 8, 4, seed=3)
    first, width = H.prefill(model, cache, seen, prompts)
    pos = torch.tensor([len(p) for p in prompts])
    snap = snapshot(cache, seen)
    with pytest.raises(pg.ContractTypeError, match="input_ids"):
        runner(input_ids=first.int(), position_ids=pos, write_pos=torch.tensor([width]))
    with pytest.raises(pg.ContractValueError, match="position_ids"):
        runner(input_ids=first, position_ids=pos[:2], write_pos=torch.tensor([width]))
    assert changed(snap, cache, seen) == []
    ids, p0, wp = first.clone(), pos.clone(), torch.tensor([width])
    out1 = runner(input_ids=ids, position_ids=pos, write_pos=wp).next_token
    keep = out1.clone()
    assert torch.equal(ids, first) and torch.equal(pos, p0) and wp.item() == width
    runner(input_ids=out1, position_ids=pos + 1, write_pos=torch.tensor([width + 1]))
    assert torch.equal(out1, keep)          # copy_outputs=True: the next call leaves it alone
    assert all(t.shape[0] == 4 for t in H.flatten_cache(cache)[0])


def test_reallocated_cache_is_a_state_storage_error(model):
    runner, cache, seen = fresh(model)
    cache.layers[1].keys = cache.layers[1].keys.clone()
    with pytest.raises(pg.StateStorageError, match=r"cache.*\[2\]"):
        runner(input_ids=torch.tensor([1]), position_ids=torch.tensor([1]), write_pos=torch.tensor([1]))


@pytest.mark.parametrize("prompt,exc,msg", [([1.5, 2.7], TypeError, "integers"),
                                            ([True, False], TypeError, "integers"),
                                            (["a"], TypeError, "integer token ids"),
                                            ([[1, 2]], ValueError, "1-d")],
                         ids=["float", "bool", "str", "2-d"])
def test_serve_refuses_ids_that_are_not_integers_before_any_write(model, prompt, exc, msg):
    runner, cache, seen = fresh(model)
    before = snapshot(cache, seen)
    with pytest.raises(exc, match=msg):
        H.serve(model, runner, cache, seen, [prompt], [2])
    assert changed(before, cache, seen) == []


def test_serve_refuses_a_cache_the_runner_is_not_bound_to(model):
    runner, cache, seen = fresh(model)
    other, other_seen = H.new_cache(model, 4, 24)
    before = snapshot(other, other_seen)
    with pytest.raises(ValueError, match="the runner was built with"):
        H.serve(model, runner, other, other_seen, [[5, 6, 7]], [4])
    assert changed(before, other, other_seen) == []
    assert H.serve(model, runner, cache, seen, [[5, 6, 7]], [4])[0] == \
        H.serve(model, *fresh(model), [[5, 6, 7]], [4])[0]
