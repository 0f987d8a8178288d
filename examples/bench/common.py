"""Shared by the benchmarks: where results go, what they were measured on, copy bandwidth."""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch


def out_dir() -> Path:
    """$OUT on the device machine, else results/local/."""
    path = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[2] / "results" / "local")
    path.mkdir(parents=True, exist_ok=True)
    return path


def env_info(command: str | None = None) -> dict:
    import triton
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": command or " ".join(["python"] + sys.argv)}


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
