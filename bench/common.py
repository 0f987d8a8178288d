"""Shared by the benchmarks: where results go, what they were measured on, copy bandwidth, the
kernels of a profiled run."""
from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch


def out_dir() -> Path:
    """$OUT on the device machine, else results/local/."""
    path = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results" / "local")
    path.mkdir(parents=True, exist_ok=True)
    return path


ROOT = Path(__file__).resolve().parents[1]


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as one types it at the repository root: `python -m bench.x ARGS` for
    a benchmark run as a module, `python PATH ARGS` for a script run by its path, PATH relative
    to the root wherever the checkout lies (no machine path is recorded)."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if argv is sys.argv or argv == sys.argv:
        if spec is not None and spec.name.startswith("bench."):     # python -m bench.x
            return " ".join([f"python -m {spec.name}", *argv[1:]])
    script = Path(argv[0]) if argv else Path("?")
    try:
        rel = script.resolve().relative_to(ROOT)
    except ValueError:
        rel = Path(script.name)
    return " ".join([f"python {rel.as_posix()}", *argv[1:]])


def git_commit() -> str:
    """The PADGRAPH_COMMIT environment variable where set (a copy of a tree run on another
    machine, whose own git data may be older than the tree), else the checkout's short commit
    hash, else 'unknown'."""
    if os.environ.get("PADGRAPH_COMMIT", "").strip():
        return os.environ["PADGRAPH_COMMIT"].strip()[:12]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return "unknown"


def module_at(source: str, path: str, package: str):
    """The module at repository path `path` as it was at git revision `source` (or read from
    `source` itself where that is a .py file), imported beside today's as `package`._at_<hash>,
    so its relative imports resolve to today's package: the other side of a same-process A/B
    (`bench_sampling --ab`, `bench_attention --ab`)."""
    import hashlib
    import importlib.util
    import tempfile
    if source.endswith(".py") and Path(source).is_file():
        text = Path(source).read_text()
    else:
        done = subprocess.run(["git", "show", f"{source}:{path}"], cwd=ROOT, capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"--ab {source}: {done.stderr.strip()}")
        text = done.stdout
    name = f"{package}._at_{hashlib.sha1(text.encode()).hexdigest()[:12]}"
    if name not in sys.modules:
        file = Path(tempfile.mkdtemp(prefix="padgraph_ab_")) / f"{name.rsplit('.', 1)[1]}.py"
        file.write_text(text)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def env_info(command: str | None = None) -> dict:
    import triton
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"
    return {"date": datetime.date.today().isoformat(), "gpu": gpu,
            "torch": torch.__version__, "triton": triton.__version__,
            "command": command or command_line(), "commit": git_commit()}


def copy_bandwidth(device, n_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n_bytes / times[len(times) // 2]


class CudagraphSkips:
    """Inductor's "skipping cudagraphs due to …" messages while the block runs (a context manager).

    torch logs each skip on the `cudagraphs` artifact logger and counts it in
    counters["inductor"]["cudagraph_skips"]; `reasons` holds the messages, `count` the counter's delta.
    """

    LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"

    def __init__(self):
        self.reasons: list[str] = []
        self.count = 0

    def __enter__(self) -> "CudagraphSkips":
        import logging

        from torch._dynamo.utils import counters
        skips = self

        class _Keep(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "skipping cudagraphs" in msg:
                    skips.reasons.append(msg)

        self._handler, self._counters = _Keep(), counters
        self._start = counters["inductor"]["cudagraph_skips"]
        logging.getLogger(self.LOGGER).addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        import logging
        logging.getLogger(self.LOGGER).removeHandler(self._handler)
        self.count = self._counters["inductor"]["cudagraph_skips"] - self._start

    def summary(self) -> str:
        if not self.count and not self.reasons:
            return "cudagraphs captured (no skip logged)"
        seen = sorted(set(self.reasons)) or ["(no reason logged: torch logs reasons for CUDA graphs only)"]
        return f"{self.count} cudagraph skip(s): " + " | ".join(seen)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed
    (it is not a dependency: the md and JSON are written anyway)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_step_times(rows, names, path, title: str, ylabel: str, floor_key: str | None = None) -> None:
    """Step time (ms) per raw batch size, one line per variant (rows: dicts with variant, bs,
    step_us; `floor_key`: a per-row floor in µs drawn dashed). Skipped without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in names:
        pts = sorted((r["bs"], r["step_us"]) for r in rows if r["variant"] == v)
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=v)
    if floor_key is not None:
        pts = sorted((r["bs"], r[floor_key]) for r in rows if r["variant"] == names[0])
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], "k--", label="bandwidth floor")
    ax.set_xscale("log")
    ax.set(xlabel="raw batch size", ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tie_margin(logits, dtype: torch.dtype | None = None):
    """(top-2 gap [bs], tolerance [bs]): a near tie when the gap is within 4 ulps of the top logit
    in `dtype` (default the logits' own; fp32 logits upcast from a bf16 lm_head: bf16), as two
    kernels that round differently may each move a logit by 2 ulps."""
    top2 = logits.float().topk(2, dim=-1).values                                   # [bs, 2]
    eps = torch.finfo(dtype or logits.dtype).eps
    ulp = eps * torch.exp2(torch.floor(torch.log2(top2[:, 0].abs().clamp(min=1e-6))))
    return top2[:, 0] - top2[:, 1], 4 * ulp


def split_ties(differ, gap, tol) -> tuple[int, list[float]]:
    """(differing rows at a near tie: gap <= tol, the gap in ulps of each other differing row),
    with gap, tol from `tie_margin` (tol is 4 ulps)."""
    far = differ & (gap > tol)
    return int((differ & (gap <= tol)).sum()), [round(u, 1) for u in (4 * gap / tol)[far].tolist()]


def random_tree_masks(bs, k, gen):
    """[bs, k, k] bool on the CPU: each draft token sees itself and the ancestors of a random parent."""
    masks = torch.zeros(bs, k, k, dtype=torch.bool)
    for r in range(bs):
        for i in range(k):
            masks[r, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (), generator=gen))
                masks[r, i] |= masks[r, parent]
    return masks


def kernel_table(events, n_calls: int, top: int = 18) -> dict:
    """GPU kernels of a torch.profiler run (those inside CUDA graphs included) per call of what
    ran `n_calls` times: {"kernels": count per call, "kernel_us": kernel time per call, "top":
    [(µs per call, launches per call, name), ...] the `top` kernels by time}."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    n = max(n_calls, 1)
    by: dict = {}
    for e in kernels:
        c, us = by.get(e.name, (0, 0.0))
        by[e.name] = (c + 1, us + e.device_time)
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(kernels) / n, "kernel_us": sum(us for _, us in by.values()) / n,
            "top": [(us / n, c / n, name) for name, (c, us) in ranked]}


def time_us(replay, iters: int, back_to_back: int = 1) -> float:
    """Median µs per replay over iters samples, each `back_to_back` replays between two events
    (1: a single replay, launch latency included; more: the GPU span of a chain)."""
    if not torch.cuda.is_available():
        return float("nan")
    for _ in range(3):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        for _ in range(back_to_back):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / back_to_back)
    return statistics.median(times)


# (class, name fragments): a kernel is in the first class one of whose fragments its lower-cased
# name contains (cuBLAS / cuBLASLt / CUTLASS GEMMs, padgraph's Triton kernels, inductor's fused
# ones: "triton_red_..._rsqrt" is a norm, "triton_poi_..." a pointwise kernel)
KERNEL_CLASSES = (
    ("fused layer", ("_norm_qkv", "_o_residual", "_proj_residual", "_norm_gate_up", "_down_partials",
                     "_residual_norm")),
    ("lm_head tail", ("_lm_head_kernel", "_argmax_reduce")),
    ("sampling", ("argmax", "_select_kernel", "_chunk_max", "topk", "sample")),
    ("canary", ("_canary",)),
    # before "attention": "_conv_decode_kernel" holds "_decode_kernel"
    ("recurrent", ("_ssm_", "_conv_decode", "_conv_tree", "_conv_prefill", "_delta_")),
    ("moe", ("_gate_up_kernel", "_down_kernel", "_combine_kernel")),
    ("attention", ("attention", "attn", "flash", "fmha", "sdpa", "_mla", "_decode_kernel", "split_kv",
                   "_merge")),
    ("gemm/gemv", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "matmul", "_mm_", "cublas",
                   "grouped_linear")),
    ("norm", ("rsqrt", "rms", "norm", "mean")),
    ("rope", ("rope", "rotary", "sin", "cos")),
    # before "kv store": a native cast's name holds "StoreWithCast"; not "copy" alone: inductor's
    # fused pointwise kernels that cast name "_to_copy"
    ("copy", ("memcpy", "memset", "copy_kernel", "fill")),
    ("kv store", ("store", "scatter", "index_put", "kv_")),
    ("elementwise", ("elementwise", "vectorized", "triton_poi", "silu", "mul", "add")),
)


def kernel_class(name: str) -> str:
    """The class `KERNEL_CLASSES` puts a kernel name in ("other" where no fragment matches)."""
    low = name.lower()
    for cls, frags in KERNEL_CLASSES:
        if any(f in low for f in frags):
            return cls
    return "other"


def kernel_classes(events, n_calls: int) -> list[dict]:
    """The GPU kernels of a torch.profiler run of `n_calls` calls by class (`kernel_class`):
    [{"class", "kernels" per call, "us" kernel time per call, "names": the distinct names}, ...],
    the classes by time, largest first."""
    n = max(n_calls, 1)
    by: dict = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        c = by.setdefault(kernel_class(e.name), {"kernels": 0, "us": 0.0, "names": set()})
        c["kernels"] += 1
        c["us"] += e.device_time
        c["names"].add(e.name)
    rows = [{"class": k, "kernels": v["kernels"] / n, "us": v["us"] / n, "names": sorted(v["names"])}
            for k, v in by.items()]
    return sorted(rows, key=lambda r: -r["us"])


def gpu_span_us(events, n_calls: int) -> float:
    """µs a call from the first kernel's start to the last kernel's end of a profiled run of
    `n_calls` calls queued back to back (kernel time plus the gaps between kernels)."""
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.device_type == torch.autograd.DeviceType.CUDA]
    if not spans:
        return float("nan")
    return (max(e for _, e in spans) - min(s for s, _ in spans)) / max(n_calls, 1)


def kernel_lines(table: dict, what: str, per: str) -> list[str]:
    """The printed form of `kernel_table`: a summary line, then one line per kernel."""
    lines = [f"profile {what}: {table['kernels']:.0f} kernels and {table['kernel_us']:.0f} "
             f"kernel-µs per {per}; top {len(table['top'])} by time:"]
    lines += [f"  {us:8.1f} µs {c:6.1f}x  {name[:110]}" for us, c, name in table["top"]]
    return lines
