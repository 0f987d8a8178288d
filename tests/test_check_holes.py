"""pg.check sees what it used to miss, and stays quiet where it used to over-report.

- a padded lane copying a real row onto a non-sink row, in a cache that starts at zeros (the
  rows were equal, so the copy changed nothing a plain before/after could see);
- a row-independent float16 GEMM body: one-ulp differences between sizes are not pad leakage;
- a body that closes over the full batch-ordered state instead of x.<state> and writes rows past
  the bucket.
"""
import torch

import padgraph as pg

bs = pg.Axis("bs")


def test_row_copy_onto_non_sink_row_in_a_zero_cache_is_found():
    program = pg.Program("copy_rows", inputs={"dst": pg.Input((bs,), torch.int64, pad=0),
                                               "src": pg.Input((bs,), torch.int64, pad=1)},
                         state={"kv": pg.State(sink=0)}, buckets=pg.Buckets([4, 8]))
    kv = torch.zeros(16, 4)

    def body(x):
        x.kv.index_copy_(0, x.dst, x.kv.index_select(0, x.src))   # a pad src=1 is a real row
        x.kv[1:3] += 0                                             # touch nothing else
        return {}

    def sample(gen):
        n = int(torch.randint(1, 5, (), generator=gen))
        dst = torch.randperm(12, generator=gen)[:n] + 4
        return {"dst": dst, "src": torch.full((n,), 2, dtype=torch.int64)}

    bad = lambda x: (x.kv.index_copy_(0, torch.where(x.dst == 0, torch.full_like(x.dst, 3), x.dst),  # noqa: E731
                                      x.kv.index_select(0, x.src)), {})[1]
    assert pg.check(program, body, state={"kv": kv}, sample=sample, trials=4).ok
    result = pg.check(program, bad, state={"kv": kv}, sample=sample, trials=4)
    assert any(f.kind == "state-write" and 3 in f.rows for f in result.findings), str(result)


def test_fp16_gemm_rounding_is_not_pad_leakage():
    program = pg.Program("gemm16", inputs={"h": pg.Input((bs, 64), torch.float16, pad=0)},
                         outputs={"y": pg.Output((bs, 64), torch.float16)}, buckets=pg.Buckets([1, 7, 33, 64]))
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).half()

    def body(x):        # a GEMM kernel picked by the row count may round one ulp apart (cuBLAS does)
        y = (x.h.float() @ w.float()).half()
        if x.bucket >= 33:
            y = torch.nextafter(y, torch.full_like(y, float("inf")))
        return {"y": y}

    result = pg.check(program, body, trials=6)
    assert result.ok, str(result)


def test_closure_over_full_batch_ordered_state_is_found():
    program = pg.Program("rows", inputs={"h": pg.Input((bs,), torch.float32, pad=0)},
                         state={"cache": pg.State(rows=bs)}, buckets=pg.Buckets([2, 4]))
    cache = torch.zeros(12, 3)

    def body(x):        # writes rows past the bucket through the closure, not x.cache
        cache[: x.bucket + 2] = 1.0
        return {}

    result = pg.check(program, body, state={"cache": cache}, trials=2)
    assert any(f.kind == "state-write" and "outside the rows" in f.detail for f in result.findings), str(result)

    def good(x):
        x.cache.fill_(1.0)
        return {}

    assert pg.check(program, good, state={"cache": cache}, trials=2).ok


# ---- bugs of one bucket, outlier channels, reads past an extent, coincidental sink pads ----------

def test_every_bucket_runs_once_with_every_lane_padded():
    """A small-batch path (buckets <= 8 of the default 36-bucket ladder) that clamps the slot so a
    padded lane writes live row 2: the trials rarely draw a size that small, the all-pad runs of
    every bucket see it at any seed. A row every call writes (a counter) is no finding."""
    bs_ = pg.Axis("bs")
    prog = pg.Program("small_path", inputs={"loc": pg.Input((bs_,), torch.int64, pad=0),
                                            "x": pg.Input((bs_, 4), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs_, 4), torch.float32)},
                      state={"kv": pg.State(sink=0)}, buckets=pg.Buckets.default(256))

    def good(x):
        x.kv.index_copy_(0, x.loc, x.x)
        x.kv[299] += 1                                          # a call counter
        return {"y": x.kv.index_select(0, x.loc) * 2}

    def bad(x):
        loc = x.loc.clamp(min=2) if x.bucket <= 8 else x.loc
        x.kv.index_copy_(0, loc, x.x)
        return {"y": x.kv.index_select(0, x.loc) * 2}

    def state():
        return {"kv": torch.randn(300, 4, generator=torch.Generator().manual_seed(0))}

    for seed in (0, 2, 4):
        assert pg.check(prog, good, state=state(), seed=seed, trials=4).ok
        found = pg.check(prog, bad, state=state(), seed=seed, trials=4)
        assert any(f.kind == "state-write" and 2 in f.rows for f in found.findings), (seed, found)


def test_a_leak_under_an_outlier_channel_is_caught_in_bf16():
    """pg.check takes fp32's rtol of a row's largest value, not bf16's: statistics over the padded
    batch move channels of ~0.8 by ~0.3 beside a channel of 500, a finding."""
    bs_ = pg.Axis("bs")
    prog = pg.Program("hid", inputs={"h": pg.Input((bs_, 8), torch.bfloat16, pad=0)},
                      outputs={"y": pg.Output((bs_, 8), torch.bfloat16)},
                      buckets=pg.Buckets([1, 2, 4, 8, 16]))

    def outlier(y):
        y = y.clone()
        y[:, 0] = 500.0
        return y

    def good(x):
        return {"y": outlier(x.h.float() * 2).to(torch.bfloat16)}

    def bad(x):
        h = x.h.float()
        y = (h - h.mean(0)) / (h.std(0, unbiased=False) + 1e-3)
        return {"y": outlier(y).to(torch.bfloat16)}

    assert pg.check(prog, good, trials=4).ok
    assert {f.kind for f in pg.check(prog, bad, trials=4).findings} == {"pad-leakage"}


def test_token_ids_padded_like_the_sink_stay_valid_token_ids():
    """The quickstart's shape: input_ids pad 0 beside out_cache_loc pad 0 and a KV sink at row 0.
    Both are drawn as distinct non-sink rows, the lowest first, so a vocabulary smaller than the
    cache still takes them: a correct body has no finding."""
    bs_ = pg.Axis("bs")
    emb = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    prog = pg.Program("decode", inputs={"input_ids": pg.Input((bs_,), torch.int64, pad=0),
                                        "out_cache_loc": pg.Input((bs_,), torch.int64, pad=0)},
                      outputs={"logits": pg.Output((bs_, 32), torch.float32)},
                      state={"kv": pg.State(sink=0)}, buckets=pg.Buckets([1, 2, 4, 8]))

    def body(x):
        h = emb[x.input_ids]
        x.kv.index_copy_(0, x.out_cache_loc, h)
        return {"logits": h @ emb.T}

    assert pg.check(prog, body, state={"kv": torch.zeros(256, 8)}).ok
