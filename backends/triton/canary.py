"""The canary check in one launch: every canary row of a runner's state compared with the sentinel.

One program per row reads the row's bytes (its address from a table, so rows of any tensors and
dtypes share one compiled kernel) and, where a byte differs, stores the row's index + 1 into the
flag: pinned host memory that the device writes through unified addressing and the host reads
with no sync (`padgraph.canary`). Nothing is written while every row holds its sentinel. Its
torch reference is `padgraph.canary.torch_checker`.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from padgraph.canary import SENTINEL

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 1024


if triton is not None:
    @triton.jit
    def _canary_kernel(table, n_rows, SENTINEL: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        base = tl.load(table + 2 * r).to(tl.pointer_type(tl.uint8))
        n = tl.load(table + 2 * r + 1)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(base + offs, mask=offs < n, other=SENTINEL)
            bad = bad | (v != SENTINEL).to(tl.int32)
        if tl.max(bad, axis=0) > 0:
            flag = tl.load(table + 2 * n_rows).to(tl.pointer_type(tl.int32))
            tl.store(flag, r + 1)


def available(device) -> bool:
    """The kernel can check rows on `device` (CUDA with Triton, or the CPU interpreter)."""
    if triton is None:
        return False
    dev = torch.device(device)
    return dev.type == "cuda" or (dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def checker(regions: list[torch.Tensor], flag: torch.Tensor) -> Callable[[], None]:
    """The check of `regions` (flat uint8 rows) into `flag` ([1] int32, pinned on CUDA) as one
    launch; the address table is built here, outside any capture."""
    rows = [[r.data_ptr(), r.numel()] for r in regions] + [[flag.data_ptr(), 0]]
    table = torch.tensor(rows, dtype=torch.int64).to(regions[0].device)    # [n_rows + 1, 2]
    n_rows = len(regions)

    def check() -> None:
        _canary_kernel[(n_rows,)](table, n_rows, SENTINEL=SENTINEL, BLOCK=BLOCK)
    check.table = table        # kept alive with the closure
    return check
