"""The hazards of hand-written runners, each as the case that would have caught it in the runners padgraph
replaces (SGLang's, vLLM's, TensorRT-LLM's CUDA-graph runners, nano-vllm).

Silent mismatch (wrong numbers or memory faults, no error):
  - stale tail: a padded lane keeps an earlier, larger call's value (`positions`,
    `req_pool_indices`, `topk_index`)                      -> test_stale_tail_after_larger_call
  - stale tail written by the body itself, mutating its inputs in place
                                                           -> test_stale_tail_body_mutates_inputs
  - raw metadata seen by a hook: `out_cache_loc` raw while `batch_size` is padded
                                                           -> test_hook_sees_padded_not_raw
  - padding on the wrong axis: requests vs tokens in draft-extend
                                                           -> test_tokens_pick_the_bucket_and_pad_on_their_axis
  - sums and counts from raw values (`seq_lens_sum`)       -> test_sums_come_from_the_padded_view
  - a buffer sized without its factor (`topk`)             -> test_size_factor_buffer
  - the caller's batch left padded after an exception      -> test_caller_batch_unchanged_when_hook_raises
  - graph outputs overwritten by the next replay           -> test_copied_outputs_survive_later_calls
  - an output aliasing bound state                         -> test_outputs_never_alias_state
  - copies of one runner drifting apart / sharing buffers  -> test_runners_of_one_program_are_independent
Raises (a clear ContractError instead of silent stale memory):
  - storage changed under bound state (KV cache re-allocated after capture)
                                                           -> test_reallocated_state_raises
  - an input sharing memory with bound state               -> test_input_aliasing_state_raises
  - an extent past a dependent axis's capacity             -> test_dependent_axis_past_capacity_raises
  - extents that disagree between buffers                  -> test_disagreeing_extents_raise
"""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 4)


def decode_program():
    return pg.Program(
        "decode_like",
        inputs={"positions": pg.Input((bs,), torch.int64, pad=0),
                "req_pool_indices": pg.Input((bs,), torch.int64, pad=0),
                "out_cache_loc": pg.Input((bs,), torch.int64, pad=0),
                "seq_lens": pg.Input((bs,), torch.int32, pad=1),
                "topk_index": pg.Input((bs * 4,), torch.int64, pad=0)},
        outputs={"y": pg.Output((bs,), torch.int64), "seq_lens_sum": pg.Output((1,), torch.int64)},
        state={"kv": pg.State(sink=0), "seen": pg.State(), "meta": pg.State()},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def decode_state(device):
    return {"kv": torch.zeros(64, dtype=torch.int64, device=device),
            "seen": S.probe((5, 4 * S.LADDER[-1]), torch.int64, device),
            "meta": torch.zeros(1, dtype=torch.int64, device=device)}


NAMES = ("positions", "req_pool_indices", "out_cache_loc", "seq_lens", "topk_index")


def decode_body(x, mutate=False):
    for i, n in enumerate(NAMES):
        S.write_probe(x.seen[i], x[n].to(torch.int64))
    x.kv.index_copy_(0, x.out_cache_loc, x.positions)           # padded lanes write sink slot 0
    y = x.kv.index_select(0, x.req_pool_indices) + x.topk_index.view(-1, 4).sum(1)
    if mutate:
        for n in NAMES:
            x[n].fill_(41)
    return {"y": y, "seq_lens_sum": x.seq_lens.sum(dtype=torch.int64).reshape(1)}


def decode_raw(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    return {"positions": torch.randint(5, 99, (n,), generator=g).to(device),
            "req_pool_indices": torch.randint(1, 64, (n,), generator=g).to(device),
            "out_cache_loc": (torch.randperm(63, generator=g)[:n] + 1).to(device),
            "seq_lens": torch.randint(2, 99, (n,), generator=g).int().to(device),
            "topk_index": torch.randint(1, 64, (4 * n,), generator=g).to(device)}


def check_seen(st, raw, n, case):
    size = S.fit(decode_program(), {"bs": n})
    for i, name in enumerate(NAMES):
        spec = decode_program().inputs[name]
        shape = S.padded_shape(decode_program(), name, size)
        want = S.expected_padded(raw[name].to(torch.int64), shape, spec.pad, [0])
        S.assert_equal(f"padded {name!r}", S.read_probe(st["seen"][i], shape), want, case)


# ---- silent mismatch ----------------------------------------------------------------------

def test_stale_tail_after_larger_call(compile, device):
    st = decode_state(device)
    runner = compile(decode_program(), decode_body, state=st)
    for i, n in enumerate([8, 5, 8, 1, 7, 6]):      # shrinking within a bucket leaves a tail
        raw = decode_raw(n, device, seed=i)
        runner(**raw)
        check_seen(st, raw, n, f"call {i}, bs={n}")


def test_stale_tail_body_mutates_inputs(compile, device):
    st = decode_state(device)
    runner = compile(decode_program(), lambda x: decode_body(x, mutate=True), state=st)
    for i, n in enumerate([6, 6, 5, 8, 2]):
        raw = decode_raw(n, device, seed=i)
        runner(**raw)
        check_seen(st, raw, n, f"call {i}, bs={n}, body filled its inputs with 41 last call")


def test_hook_sees_padded_not_raw(compile, device):
    seen = []

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        seen.append((x.bucket, x.out_cache_loc.detach().cpu().clone(), x.seq_lens.detach().cpu().clone()))

    runner = compile(decode_program(), decode_body, state=decode_state(device), prepare=prepare)
    for n in [3, 8, 3]:
        raw = decode_raw(n, device, seed=n)
        runner(**raw)
        bucket, loc, lens = seen[-1]
        case = f"bs={n}"
        S.assert_equal("out_cache_loc in the hook", loc, S.expected_padded(raw["out_cache_loc"], (bucket,), pg.Fill(0), [0]), case)
        S.assert_equal("seq_lens in the hook", lens, S.expected_padded(raw["seq_lens"], (bucket,), pg.Fill(1), [0]), case)
        S.assert_equal("hook's bucket", bucket, S.fit(decode_program(), {"bs": n}), case)


def extend_program():
    """Draft-extend: requests on `bs`, packed tokens on `tokens` (capacity bs * 4), each padded
    on its own axis with its own raw extent."""
    return pg.Program(
        "draft_extend_like",
        inputs={"input_ids": pg.Input((tok,), torch.int64, pad=0),
                "seq_lens": pg.Input((bs,), torch.int32, pad=1)},
        outputs={"y": pg.Output((tok,), torch.int64)},
        state={"ids_seen": pg.State(), "lens_seen": pg.State(), "b_seen": pg.State()},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def extend_body(x):
    S.write_probe(x.ids_seen, x.input_ids)
    S.write_probe(x.lens_seen, x.seq_lens)
    x.b_seen.fill_(x.bucket)
    return {"y": x.input_ids * 2}


@pytest.mark.parametrize("n,n_tok", [(2, 7), (1, 7), (4, 5), (3, 12), (1, 32), (8, 3)])
def test_tokens_pick_the_bucket_and_pad_on_their_axis(compile, device, n, n_tok):
    st = {"ids_seen": S.probe((4 * S.LADDER[-1],), torch.int64, device),
          "lens_seen": S.probe((S.LADDER[-1],), torch.int32, device),
          "b_seen": torch.zeros(1, dtype=torch.int64, device=device)}
    runner = compile(extend_program(), extend_body, state=st)
    ids = torch.arange(10, 10 + n_tok, device=device)
    lens = torch.full((n,), 3, dtype=torch.int32, device=device)
    out = runner(input_ids=ids, seq_lens=lens)
    case = f"requests={n}, tokens={n_tok}"
    bucket = next(b for b in S.LADDER if b >= n and 4 * b >= n_tok)
    S.assert_equal("bucket", int(st["b_seen"][0]), bucket, case)
    S.assert_equal("input_ids padded on the tokens axis", S.read_probe(st["ids_seen"], (4 * bucket,)),
                   S.expected_padded(ids, (4 * bucket,), pg.Fill(0), [0]), case)
    S.assert_equal("seq_lens padded on the requests axis", S.read_probe(st["lens_seen"], (bucket,)),
                   S.expected_padded(lens, (bucket,), pg.Fill(1), [0]), case)
    S.assert_equal("y (sliced to raw tokens)", out.y, ids * 2, case)


def test_sums_come_from_the_padded_view(compile, device):
    def prepare(x):
        if pg.capturing():  # warm-up/capture of a graph backend: not a call
            return
        x.meta.fill_(int(x.seq_lens.sum()))           # host metadata, from the same padded view

    st = decode_state(device)
    runner = compile(decode_program(), decode_body, state=st, prepare=prepare)
    for n in [1, 3, 8, 5]:
        raw = decode_raw(n, device, seed=n)
        out = runner(**raw)
        size = S.fit(decode_program(), {"bs": n})
        want = int(raw["seq_lens"].sum()) + (size - n) * 1
        S.assert_equal("hook's seq_lens_sum", int(st["meta"][0]), want, f"bs={n}, bucket {size}")
        S.assert_equal("body's seq_lens_sum", int(out.seq_lens_sum[0]), want, f"bs={n}, bucket {size}")


def test_size_factor_buffer(compile, device):
    st = decode_state(device)
    runner = compile(decode_program(), decode_body, state=st)
    for n in [3, 1, 6]:
        raw = decode_raw(n, device, seed=n)
        out = runner(**raw)
        size = S.fit(decode_program(), {"bs": n})
        S.assert_equal("padded topk_index", S.read_probe(st["seen"][4], (4 * size,)),
                       S.expected_padded(raw["topk_index"], (4 * size,), pg.Fill(0), [0]), f"bs={n}")
        want_y = st["kv"].cpu()[raw["req_pool_indices"].cpu()] + raw["topk_index"].cpu().view(-1, 4).sum(1)
        S.assert_equal("y", out.y.cpu(), want_y, f"bs={n}")


class Boom(Exception):
    pass


def test_caller_batch_unchanged_when_hook_raises(compile, device):
    fail = {"now": False}

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        if fail["now"]:
            for n in NAMES:
                x[n].fill_(-1)              # the hook pads/edits the batch in place, then fails
            raise Boom()

    st = decode_state(device)
    runner = compile(decode_program(), decode_body, state=st, prepare=prepare)
    runner(**decode_raw(8, device, seed=8))
    batch = decode_raw(5, device, seed=5)
    keep = {k: v.clone() for k, v in batch.items()}
    fail["now"] = True
    with pytest.raises(Boom):
        runner(**batch)
    for k, v in keep.items():
        S.assert_equal(f"caller's {k!r} after the hook raised", batch[k], v, "hook raised")
    fail["now"] = False
    runner(**batch)
    check_seen(st, batch, 5, "the call after the hook raised")


def test_copied_outputs_survive_later_calls(compile, device):
    runner = compile(decode_program(), decode_body, state=decode_state(device), copy_outputs=True)
    first = runner(**decode_raw(4, device, seed=1))
    keep = {k: v.clone() for k, v in first.items()}
    for n in [4, 3, 8]:
        runner(**decode_raw(n, device, seed=10 + n))
    for k, v in keep.items():
        S.assert_equal(f"first call's {k!r}", first[k], v, "copy_outputs=True, three later calls")


def test_outputs_never_alias_state(compile, device):
    prog = pg.Program("returns_state", inputs={"a": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, state={"kv": pg.State()},
                      buckets=pg.Buckets([2, 4]))
    kv = torch.zeros(16, dtype=torch.int64, device=device)

    def body(x):
        x.kv[: x.bucket].copy_(x.a)
        return {"y": x.kv[: x.bucket]}

    runner = compile(prog, body, state={"kv": kv})
    for n in [3, 5]:                                    # on the ladder, then past it (eager)
        out = runner(a=torch.arange(1, n + 1, device=device))
        out.y.fill_(-1)                                  # the caller owns the output view
        S.assert_equal("kv after the caller wrote its output", kv[:n].cpu(), torch.arange(1, n + 1), f"bs={n}")


def test_runners_of_one_program_are_independent(compile, device):
    a = compile(decode_program(), decode_body, state=decode_state(device))
    b = compile(decode_program(), decode_body, state=decode_state(device))
    raw_a = decode_raw(3, device, seed=1)
    out_a = a(**raw_a)
    keep = {k: v.clone() for k, v in out_a.items()}
    b(**decode_raw(3, device, seed=2))                  # another runner's call: not a's next call
    for k, v in keep.items():
        S.assert_equal(f"runner a's {k!r} after runner b ran", out_a[k], v, "two runners, one program")


# ---- raises -----------------------------------------------------------------------------------

def test_reallocated_state_raises(compile, device):
    st = decode_state(device)
    runner = compile(decode_program(), decode_body, state=st)
    runner(**decode_raw(3, device, seed=0))
    st["kv"].set_(torch.zeros(128, dtype=torch.int64, device=device))     # "grow the cache"
    with pytest.raises(pg.StateStorageError, match="'kv'"):
        runner(**decode_raw(3, device, seed=0))


def test_input_aliasing_state_raises(compile, device):
    st = decode_state(device)
    runner = compile(decode_program(), decode_body, state=st)
    raw = decode_raw(3, device, seed=0)
    raw["positions"] = st["kv"][10:13]
    with pytest.raises(pg.ContractValueError, match="'positions'.*'kv'"):
        runner(**raw)


def test_dependent_axis_past_capacity_raises(compile, device):
    runner = compile(extend_program(), extend_body, overflow="error", state={
        "ids_seen": S.probe((4 * S.LADDER[-1],), torch.int64, device),
        "lens_seen": S.probe((S.LADDER[-1],), torch.int32, device), "b_seen": torch.zeros(1, dtype=torch.int64, device=device)})
    with pytest.raises(pg.BucketOverflowError, match="tokens"):
        runner(input_ids=torch.zeros(4 * S.LADDER[-1] + 1, dtype=torch.int64, device=device),
               seq_lens=torch.ones(2, dtype=torch.int32, device=device))


def test_disagreeing_extents_raise(compile, device):
    runner = compile(decode_program(), decode_body, state=decode_state(device))
    raw = decode_raw(4, device, seed=0)
    raw["out_cache_loc"] = raw["out_cache_loc"][:3]          # raw loc, padded batch elsewhere
    with pytest.raises(pg.ContractValueError, match="'out_cache_loc'"):
        runner(**raw)
