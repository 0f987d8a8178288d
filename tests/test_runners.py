"""The runner programs (decode, verify, draft, draft-extend, prefill, draft prefill): declared pad values, axes,
and pg.check with the example model's bodies, sampling parameters included (no pad leakage, no state writes outside raw
targets and sinks, deterministic)."""

import pytest
import torch

import padgraph as pg
from padgraph.llm.programs import (decode_program, draft_extend_program, draft_prefill_program,
                              draft_program, extend_program, verify_program)


from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm import SpecConfig, Worker, checks
from padgraph.llm.programs import SAMPLING_INPUTS, prefill_buckets


def pads(p):
    return {n: s.pad for n, s in p.inputs.items()}


def test_declared_pad_values():
    out = lambda a: {"y": pg.Output((a.bs,), torch.int64)}  # noqa: E731
    d = pads(decode_program(out))
    assert d == {"input_ids": pg.Fill(0), "positions": pg.Fill(0), "seq_lens": pg.Fill(1),
                 "req_pool_indices": pg.Fill(0), "out_cache_loc": pg.Fill(0)}
    v = verify_program(6, out)
    assert pads(v)["tree_mask"] == pg.Fill(True) and pads(v)["seq_lens"] == pg.Fill(1)
    assert pg.Plan(v).shape("input_ids", 4) == (24,)
    dr = draft_program(3, 4, 32, torch.float16, out)
    assert pg.Plan(dr).shape("out_cache_loc", 2) == (2 * 12,)
    assert pads(dr)["topk_p"] == pg.Fill(0) and dr.inputs["hidden_states"].dtype == torch.float16
    de = draft_extend_program(3, 32, torch.float32, out)
    assert pads(de)["qo_indptr"] == pg.Edge() and pads(de)["accept_lens"] == pg.Fill(1)
    plan = pg.Plan(de)
    assert [a.name for a in de.axes] == ["bs", "tokens"]
    assert plan.capacity("tokens", 8) == 32 and plan.shape("qo_indptr", 8) == (9,)


def test_extend_program_is_bucketed_by_tokens():
    """Prefill: the bucket follows the packed tokens; requests are a dependent axis of capacity
    tokens, padded requests own no tokens (qo_indptr repeats), padded tokens write the sink."""
    ex = extend_program(lambda a: {"h": pg.Output((a.tokens, 4), torch.float32),
                                   "last": pg.Output((a.bs, 4), torch.float32)},
                        buckets=pg.Buckets([16, 32, 64]))
    assert [a.name for a in ex.axes] == ["tokens", "reqs"]
    assert pads(ex) == {"input_ids": pg.Fill(0), "positions": pg.Fill(0),
                        "out_cache_loc": pg.Fill(0), "seq_lens": pg.Fill(1),
                        "req_pool_indices": pg.Fill(0), "qo_indptr": pg.Edge()}
    plan = pg.Plan(ex)
    assert plan.bucket_for({"tokens": 17, "reqs": 3}) == 32
    assert plan.bucket_for({"tokens": 16, "reqs": 16}) == 16
    assert plan.shape("qo_indptr", 32) == (33,) and plan.shape("input_ids", 32) == (32,)


def test_draft_prefill_program_pads():
    """Draft prefill: extend's axes and pads, plus the target's hidden per token (pad 0) and its
    first token per request (pad 0)."""
    dp = draft_prefill_program(8, torch.bfloat16, lambda a: {
        "h": pg.Output((a.bs, 8), torch.bfloat16)}, buckets=pg.Buckets([16, 32]))
    assert [a.name for a in dp.axes] == ["tokens", "reqs"]
    assert pads(dp)["hidden_states"] == pg.Fill(0) and pads(dp)["verified_id"] == pg.Fill(0)
    assert pads(dp)["qo_indptr"] == pg.Edge() and dp.inputs["hidden_states"].dtype == torch.bfloat16
    plan = pg.Plan(dp)
    assert plan.bucket_for({"tokens": 17, "reqs": 3}) == 32
    assert plan.shape("hidden_states", 32) == (32, 8) and plan.shape("verified_id", 32) == (32,)


def test_prefill_buckets():
    assert list(prefill_buckets(100)) == [16, 24, 32, 48, 64, 96, 100]
    assert list(prefill_buckets(128)) == [16, 24, 32, 48, 64, 96, 128]
    assert list(prefill_buckets(10)) == [10]


def test_tokens_axis_is_decided_separately():
    de = draft_extend_program(3, 8, torch.float32, lambda a: {
        "y": pg.Output((a.bs,), torch.int32)}, buckets=pg.Buckets([1, 2, 4, 8]))
    plan = pg.Plan(de)
    ext = {"bs": 3, "tokens": 5}
    assert plan.bucket_for(ext) == 4
    assert plan.bucket_for({"bs": 1, "tokens": 7}) == 2     # tokens need more than bs does


SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=5)


@pytest.fixture(scope="module")
def worker():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny()).eval()
    head = EagleHead(target).eval()
    w = Worker(target, head, SPEC, max_bs=8, max_context=48, buckets=pg.Buckets([1, 2, 4, 8]),
               prefill="runner", draft_prefill="runner")
    checks.own_slots(w)                                      # every row but 0 owns 48 slots
    return w




@pytest.mark.parametrize("name", ["decode", "verify", "draft", "draft_extend", "prefill",
                                  "draft_prefill"])
def test_check_runner_programs(worker, name):
    with torch.no_grad():
        res = pg.check(worker.programs[name], worker.bodies[name], state=worker.state(name),
                       sample=checks.sampler(worker, name), trials=3,
                       tolerance=(1e-5, 1e-5))
    assert res.ok, str(res)


def test_draft_emits_verify_inputs(worker):
    """The draft body hands verify its inputs (tree root + draft tokens, their positions and
    slots), so no eager work runs between the two replays; they are `verify_inputs` of the raw
    batch (padded to its bucket inside the runner)."""
    from padgraph.backends.triton import eagle as ops
    raw = checks.sampler(worker, "draft")(torch.Generator().manual_seed(3))
    raw["verified_id"] = torch.arange(1, raw["seq_lens"].shape[0] + 1)
    with torch.no_grad():
        d = worker.runner("draft")(**raw)
    ids, pos, loc = ops.verify_inputs(raw["verified_id"], d.draft_tokens, d.depth, raw["seq_lens"],
                                      worker.kv.req_to_token, raw["req_pool_indices"])
    n = raw["seq_lens"].shape[0] * SPEC.num_draft_tokens
    assert d.verify_input_ids.shape == (n,)
    assert torch.equal(d.verify_input_ids, ids) and torch.equal(d.verify_positions, pos)
    assert torch.equal(d.verify_out_cache_loc, loc)


def test_worker_programs_take_sampling_parameters_with_their_pads(worker):
    """decode and verify take each request's sampling parameters as padded inputs whose pads
    make a padded lane greedy with every filter off; the draft programs propose their top-k and
    take none, and a program declared without `sampling=True` is unchanged."""
    pads = {"temperature": (0.0, torch.float32), "top_k": (0, torch.int32),
            "top_p": (1.0, torch.float32), "min_p": (0.0, torch.float32),
            "seed": (0, torch.int64)}
    for name in ("decode", "verify"):
        inputs = worker.programs[name].inputs
        assert {n: (inputs[n].pad.value, inputs[n].dtype) for n in SAMPLING_INPUTS} == pads
        assert all(inputs[n].shape == inputs["seq_lens"].shape for n in SAMPLING_INPUTS)
    for name in ("draft", "draft_extend", "prefill", "draft_prefill"):
        assert not set(SAMPLING_INPUTS) & set(worker.programs[name].inputs), name
    assert not set(SAMPLING_INPUTS) & set(decode_program({}).inputs)


def test_check_sampler_draws_valid_sampling_parameters(worker):
    """Every lane `checks.sampler` draws for a sampling program is a valid `SamplingParams`,
    and the draws cover greedy lanes and each filter."""
    from padgraph.llm.sampling import SamplingParams
    gen, lanes = torch.Generator().manual_seed(0), []
    for _ in range(20):
        raw = checks.sampler(worker, "verify")(gen)
        lanes += list(zip(*(raw[n].tolist() for n in SAMPLING_INPUTS)))
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s)
              for t, k, p, m, s in lanes]
    assert any(p.greedy for p in params) and not all(p.greedy for p in params)
    assert all(any(f(p) for p in params) for f in (lambda p: p.top_k > 0, lambda p: p.top_p < 1,
                                                    lambda p: p.min_p > 0))
