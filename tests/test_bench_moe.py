"""bench_moe's two bodies: the compiled body's logits are compared with the eager body's at the
same size (a changed next token is counted, not hidden), the report names each row's body, and
the per-class plot takes every profiled (body, size)."""
import torch

from bench import bench_moe


def row(body, bs, logits, profile=None):
    r = {"body": body, "bs": bs, "default_path": "routed" if bs == 1 else "dense",
         "logits": logits, "dense_step_us": 2.0, "routed_step_us": 1.0, "dense_moe_layer_us": 0.2,
         "routed_moe_layer_us": 0.1, "bytes": {"dense": 2e9, "routed": 1e9, "routed_distinct": 1e9},
         "floor_us": {"dense": 700.0, "routed": 400.0, "routed_distinct": 400.0},
         "same_next_tokens": bs, "max_logit_diff": 0.0}
    if profile:
        r["profile"] = profile
    return r


def test_compiled_rows_are_checked_against_the_eager_body():
    eager = torch.tensor([[0.0, 1.0, 0.5], [2.0, 0.0, 1.0]])
    moved = eager.clone()
    moved[1, 2] = 3.0                                        # row 1's argmax moves
    rows = [row("eager", 2, eager), row("compiled", 2, moved)]
    bench_moe.compare_bodies(rows)
    assert all("logits" not in r for r in rows)
    assert "vs_eager" not in rows[0]
    assert rows[1]["vs_eager"] == {"same_next_tokens": 1, "max_logit_diff": 2.0}
    text = bench_moe.report(rows, {"gpu": "cpu", "command": "python -m bench.bench_moe", "date": "d",
                                   "torch": "t", "triton": "t", "model": "tiny", "context": 8,
                                   "copy_bw_gbs": 1.0})
    assert "| eager | 2 | dense |" in text and "| compiled | 2 | dense |" in text, text
    assert "The compiled body at bs 2 against the eager body (default path): same next tokens 1/2" in text


def test_the_class_plot_covers_every_profiled_step(tmp_path):
    prof = lambda us: {"kernels": 3, "kernel_us": us, "span_us": us,            # noqa: E731
                       "classes": [{"class": "gemm/gemv", "kernels": 2, "us": us - 1},
                                   {"class": "copy", "kernels": 1, "us": 1.0}]}
    rows = [row(b, n, None, prof(10.0 * n)) for b in ("eager", "compiled") for n in (1, 16)]
    bench_moe.plot_classes(rows, {"model": "tiny, 1 layer", "gpu": "cpu", "date": "d"},
                           tmp_path / "p.png")
    if bench_moe.pyplot() is not None:
        assert (tmp_path / "p.png").stat().st_size > 0
