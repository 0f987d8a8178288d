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
