"""runner.call(raw, extents=...) validates every `extents` value it is given (rule 11.2): a bare
tensor, 0, [] or "" instead of {axis: tensor} is a ContractError before anything runs, never a
host call over the whole bound (whose lanes past the real extent would write stale slots).
"""
import pytest
import torch

import padgraph as pg
from padgraph.llm.programs import draft_extend_program

S, H = 3, 4


def _runner():
    prog = draft_extend_program(S, H, torch.float32, lambda a: {"y": pg.Output((a.tokens,), torch.int64, pad=-7)},
                                buckets=pg.Buckets([1, 2, 4]))
    kv = torch.zeros(64, H)
    st = {"k_cache": kv, "v_cache": torch.zeros(64, H), "req_to_token": torch.zeros(9, 32, dtype=torch.int32)}

    def body(x):
        x.k_cache.index_copy_(0, x.out_cache_loc, x.hidden_states)
        return {"y": x.input_ids * 10 + 1}
    return pg.compile(prog, body, "reference", state=st), kv


def _raw(n=3):
    m = n * (S + 1)
    return dict(input_ids=torch.arange(m) + 1, positions=torch.arange(m), out_cache_loc=torch.arange(m) + 1,
                hidden_states=torch.randn(m, H) + 5, seq_lens=torch.full((n,), 5, dtype=torch.int32),
                req_pool_indices=torch.arange(n, dtype=torch.int32) + 1, accept_lens=torch.ones(n, dtype=torch.int32),
                qo_indptr=torch.arange(n + 1, dtype=torch.int32))


def test_bare_nonzero_tensor_is_rejected():
    r, _ = _runner()
    with pytest.raises(pg.ContractTypeError):
        r.call(_raw(), extents=torch.tensor(3, dtype=torch.int32))


@pytest.mark.parametrize("bad", [torch.tensor(0, dtype=torch.int32), 0, [], ""], ids=["tensor0", "int0", "list", "str"])
def test_falsy_non_mapping_extents_are_rejected(bad):
    r, kv = _runner()
    try:
        r.call(_raw(), extents=bad)
    except pg.ContractError:
        return
    written = kv.abs().sum(1).nonzero().flatten().tolist()
    pytest.fail(f"extents={bad!r} was accepted as 'no device extents'; the call ran over all 12 bound lanes "
                f"and wrote KV rows {written} (SPEC 11.2: must be a ContractError before anything runs)")


def test_multi_element_tensor_extents_is_a_contract_error():
    r, _ = _runner()
    with pytest.raises(pg.ContractError):        # not a RuntimeError from bool(tensor)
        r.call(_raw(), extents=torch.tensor([1, 2], dtype=torch.int32))


def test_a_negative_offset_dimension_is_empty_at_a_raw_extent_of_zero():
    """A dim `tok - 1` on an axis whose raw extent may be 0 (rule 2.3; a device extent clamps to
    0, rule 11.1) is empty there, never a negative length: inputs cut to nothing, outputs all
    pad past their (empty) raw lanes, host and device calls alike."""
    bs = pg.Axis("bs")
    tok = pg.Axis("tok", capacity=bs * 2, device_extent=True)
    read = pg.Program("neg_in", inputs={"a": pg.Input((bs,), torch.float32, pad=0.0),
                                        "k": pg.Input((tok - 1,), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((tok - 1,), torch.float32)}, buckets=pg.Buckets([1, 2, 4]))
    runner = pg.compile(read, lambda x: {"y": x.k * 2}, backend="reference")
    raw = {"a": torch.ones(2), "k": torch.arange(3.0) + 1}
    for e, want in ((4, [2.0, 4.0, 6.0]), (2, [2.0, 0.0, 0.0]), (1, [0.0] * 3), (0, [0.0] * 3),
                    (-5, [0.0] * 3)):
        got = runner.call(dict(raw), extents={"tok": torch.tensor(e, dtype=torch.int32)}).y
        assert got.tolist() == want, (e, got)
    write = pg.Program("neg_out", inputs={"a": pg.Input((bs,), torch.float32, pad=0.0),
                                          "k": pg.Input((tok,), torch.float32, pad=0.0)},
                       outputs={"y": pg.Output((tok - 1,), torch.float32, pad=-9.0)},
                       buckets=pg.Buckets([1, 2, 4]))
    runner = pg.compile(write, lambda x: {"y": x.k[1:] * 2}, backend="reference")
    assert runner.call(dict(raw), extents={"tok": torch.tensor(0, dtype=torch.int32)}).y.tolist() == [-9.0, -9.0]
    assert runner(a=torch.ones(2), k=torch.zeros(0)).y.shape == (0,)
