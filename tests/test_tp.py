"""Tensor parallel on the CPU: 2 gloo processes, reference backend, fp32, tiny Llama-like target.

The TP greedy run gives exactly the single-process tokens while the batch shrinks through odd
sizes (rank 0 broadcasts every step's raw batch; every rank picks its bucket from it), with the
cross-rank check on; when ranks do call with different batches, the check raises on every rank
naming the ranks, their buckets and extents. The pieces are also checked in one process: a TP
model of one rank is the single-device model, the distributed top-2 combine is topk's, and the
check off is the runner itself.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist


from padgraph.llm import Batch, Request, SpecConfig, programs
from padgraph.llm import tp_run
from padgraph.llm.kv import new_cache
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.models.llama_tp import LlamaTP, TPGroup, combine_top2

import padgraph as pg
import padgraph.distributed as pgd

SETUP = tp_run.Setup(world=2, check_ranks=True)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- two processes

def test_tp_greedy_and_eagle_equal_single_process(one_thread):
    prompts, news = tp_run.requests(SETUP)
    ranks = tp_run.spawn(both_rank, SETUP, prompts, news)
    want = [r.output for r in tp_run.run_single(SETUP, prompts, news)]
    greedy, eagle = ranks[0]["greedy"], ranks[0]["eagle"]
    assert [o for o, _ in greedy["outputs"]] == want, "TP greedy tokens != single-process tokens"
    assert sum(map(len, want)) > 50
    calls = greedy["calls"]
    assert len(calls) >= 3, f"the batch should shrink through several buckets, got {calls}"
    assert ranks[1]["greedy"]["calls"] == calls, "rank 1 must replay rank 0's buckets"
    assert [o for o, _ in eagle["outputs"]] == want, "TP EAGLE tokens != single-process greedy"
    assert set(eagle["calls"]) == {"draft", "verify", "draft_extend"}
    assert ranks[1]["eagle"]["calls"] == eagle["calls"]


def both_rank(rank, setup, port, out_dir, prompts, news):
    """Greedy as tp_run.rank_main runs it (rank 0 broadcasts each step), then EAGLE rounds."""
    def work(tp, group):
        res = {"greedy": tp_run.greedy(rank, setup, tp, group, prompts, news)}
        target = tp_run.rank_target(rank, setup, tp)
        res["eagle"] = tp_run.run_eagle(target, setup, group, prompts, news)
        return res
    tp_run.put(out_dir, rank, tp_run.in_group(rank, setup, port, work))


def test_disagreement_raises_on_every_rank(one_thread):
    ranks = tp_run.spawn(disagree_rank, SETUP)
    assert sorted(ranks) == [0, 1]
    msg = ranks[0]
    assert ranks[1] == msg, "both ranks must raise the same error"
    assert msg.startswith("RankDisagreementError: program 'decode'"), msg
    assert "rank 0: bucket 4 extents {'bs': 3}" in msg, msg
    assert "rank 1: bucket 8 extents {'bs': 5}" in msg, msg


def disagree_rank(rank, setup, port, out_dir):
    """Rank 0 calls decode with 3 requests, rank 1 with 5: a driver bug the check catches."""
    def work(tp, group):
        shard = tp_run.rank_shard(rank, setup, tp, group)
        try:
            with torch.no_grad():
                shard.decode(**decode_raw(3 if rank == 0 else 5))
        except pg.ContractError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"
    tp_run.put(out_dir, rank, tp_run.in_group(rank, setup, port, work))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_greedy_and_eagle_match_one_gpu():
    """2 GPUs, NCCL collectives captured in every bucket's graph, 1B shape, bf16: tokens equal
    one GPU's up to a first divergence at a top-2 near-tie (eagle.py's rule)."""
    from padgraph.llm.oracle import TIE_TOL, compare
    setup = tp_run.Setup(**{**tp_run.GPU.__dict__, "n_requests": 8, "check_ranks": True})
    prompts, news = tp_run.requests(setup)
    ranks = tp_run.spawn(both_rank, setup, prompts, news)
    single = tp_run.run_single(setup, prompts, news)
    for mode in ("greedy", "eagle"):
        got = [Request(r.rid, r.prompt, r.max_new_tokens, output=o, gaps=g)
               for r, (o, g) in zip(single, ranks[0][mode]["outputs"])]
        match, ties, real = compare(single, got, tie_tol=TIE_TOL)
        assert not real, f"{mode}: divergences (rid, index, gap)={real}, but should be none"


def decode_raw(bs: int) -> dict:
    return {"input_ids": torch.ones(bs, dtype=torch.int64),
            "positions": torch.zeros(bs, dtype=torch.int64),
            "seq_lens": torch.ones(bs, dtype=torch.int32),
            "req_pool_indices": torch.zeros(bs, dtype=torch.int32),
            "out_cache_loc": torch.zeros(bs, dtype=torch.int64)}


# ------------------------------------------------------------------------------ one process

def test_one_rank_tp_model_is_the_model():
    cfg = LlamaConfig.tiny()
    full = LlamaModel(cfg, seed=0).eval()
    tp = LlamaTP.shard(full, TPGroup())
    kv_a = new_cache(full, cfg.n_layers, 32, 8, 4)
    kv_b = tp.new_cache(cfg.n_layers, 32, 8, 4)
    for kv in (kv_a, kv_b):
        kv.req_to_token[1:4, :1] = torch.tensor([[5], [6], [7]], dtype=torch.int32)
    ids, pos = torch.tensor([3, 200, 17]), torch.zeros(3, dtype=torch.int64)
    rows, lens, loc = torch.arange(1, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32), \
        torch.tensor([5, 6, 7])
    with torch.no_grad():
        b = Batch(kv_b, kv_b.req_to_token, rows, lens, loc)
        want, _ = full.forward_decode(ids, pos, Batch(kv_a, kv_a.req_to_token, rows, lens, loc))
        got, _ = tp.forward_decode(ids, pos, b)
        values, top = tp.decode_top2(ids, pos, b)
    assert torch.equal(got, want), f"max |diff|={(got - want).abs().max()}, but should be 0"
    assert torch.equal(top[:, 0], want.argmax(-1))
    assert torch.equal(values, want.topk(2, dim=-1).values)


def test_combine_top2_breaks_ties_to_the_lower_id():
    # candidates of 2 ranks x 2: values and global ids, as LlamaTP.top2 gathers them
    values = torch.tensor([[1.0, 0.5, 1.0, 0.2],     # tie at the max: ids 7 and 3 -> 3
                           [0.1, 0.0, 2.0, 2.0]])    # both of rank 1 tie: 9 then 12
    ids = torch.tensor([[7, 1, 3, 9], [0, 2, 12, 9]])
    v, i = combine_top2(values, ids)
    assert i.tolist() == [[3, 7], [9, 12]], f"ids={i.tolist()}, but should be [[3, 7], [9, 12]]"
    assert v.tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_disagreement_message_and_check_off():
    keys = [("decode", 4, {"bs": 3}), ("decode", 4, {"bs": 3}), ("decode", 8, {"bs": 5})]
    msg = pgd.disagreement(keys)
    assert msg.startswith("program 'decode': every rank"), msg
    assert "ranks 0, 1: bucket 4 extents {'bs': 3}; rank 2: bucket 8 extents {'bs': 5}" in msg
    assert pgd.disagreement(keys[:2]) is None
    assert issubclass(pgd.RankDisagreementError, pg.ContractValueError)
    runner = object()
    assert pgd.agree(runner, enabled=False) is runner, "the check off must cost nothing"


def test_call_key_is_the_plan_bucket():
    prog = programs(LlamaConfig.tiny(), SpecConfig(), torch.float32,
                    pg.Buckets([1, 2, 4, 8]))["decode"]
    runner = SimpleNamespace(program=prog, plan=pg.Plan(prog))   # what call_key reads
    assert pgd.call_key(runner, decode_raw(3)) == ("decode", 4, {"bs": 3})
    assert pgd.call_key(runner, decode_raw(9)) == ("decode", "overflow", {"bs": 9})
    name, kind, why = pgd.call_key(runner, {"input_ids": torch.ones(2, dtype=torch.int64)})
    assert (name, kind) == ("decode", "invalid") and "missing" in why
