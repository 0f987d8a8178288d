"""The canary check in one launch: every canary row of a runner's state compared with the sentinel.

Each row is cut into chunks of at most CHUNK bytes, one program per chunk (a row of megabytes, such
as a hybrid model's recurrent state or a verify's per-node states, is read by many SMs at once,
not walked by one). A chunk's address comes from a table, so rows of any tensors and dtypes share
one compiled kernel; the 8-byte-aligned body of a row is read as int64 words against the sentinel
byte repeated, its unaligned head and tail (under 8 bytes each) byte by byte. Where a byte
differs, the program stores the row's index + 1 into the flag: pinned host memory that the
device writes through unified addressing and the host reads with no sync (`padgraph.canary`).
Nothing is written while every row holds its sentinel. Its torch reference is
`padgraph.canary.torch_checker`.
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

BLOCK = 1024                     # elements a loop step reads (words or bytes)
CHUNK = 64 << 10                 # bytes a program checks at most
WORD = int.from_bytes(bytes([SENTINEL]) * 8, "little", signed=True)    # the sentinel in every byte


if triton is not None:
    @triton.jit
    def _canary_kernel(table, n_chunks, SENTINEL: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        addr = tl.load(table + 3 * c)
        n = tl.load(table + 3 * c + 1)              # elements of this chunk: words or bytes
        tag = tl.load(table + 3 * c + 2)            # 2 * row + 1 for words, 2 * row for bytes
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        if tag % 2 == 1:
            words = addr.to(tl.pointer_type(tl.int64))
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(words + offs, mask=offs < n, other=WORD)
                bad = bad | (v != WORD).to(tl.int32)
        else:
            raw = addr.to(tl.pointer_type(tl.uint8))
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(raw + offs, mask=offs < n, other=SENTINEL)
                bad = bad | (v != SENTINEL).to(tl.int32)
        if tl.max(bad, axis=0) > 0:
            flag = tl.load(table + 3 * n_chunks).to(tl.pointer_type(tl.int32))
            tl.store(flag, tag // 2 + 1)


def chunks(regions: list[torch.Tensor], chunk: int = CHUNK) -> list[tuple[int, int, int]]:
    """(address, elements, tag) of every chunk of the rows: a row's unaligned head and tail as
    bytes (tag 2 * row), its 8-byte-aligned body as words in pieces of at most `chunk` bytes
    (tag 2 * row + 1)."""
    out = []
    for i, r in enumerate(regions):
        p, n = r.data_ptr(), r.numel()
        head = min(n, -p % 8)
        if head:
            out.append((p, head, 2 * i))
        words, tail = divmod(n - head, 8)
        step = max(1, chunk // 8)
        for w in range(0, words, step):
            out.append((p + head + 8 * w, min(step, words - w), 2 * i + 1))
        if tail:
            out.append((p + head + 8 * words, tail, 2 * i))
    return out


def available(device) -> bool:
    """The kernel can check rows on `device` (CUDA with Triton, or the CPU interpreter)."""
    if triton is None:
        return False
    dev = torch.device(device)
    return dev.type == "cuda" or (dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def checker(regions: list[torch.Tensor], flag: torch.Tensor) -> Callable[[], None]:
    """The check of `regions` (flat uint8 rows) into `flag` ([1] int32, pinned on CUDA) as one
    launch of a program per chunk (`chunks`); the address table is built here, outside any capture."""
    rows = [list(c) for c in chunks(regions)]
    n_chunks = len(rows)
    table = torch.tensor(rows + [[flag.data_ptr(), 0, 0]], dtype=torch.int64).to(regions[0].device)

    def check() -> None:
        if n_chunks:
            _canary_kernel[(n_chunks,)](table, n_chunks, SENTINEL=SENTINEL, WORD=WORD, BLOCK=BLOCK)
    check.table = table        # kept alive with the closure
    return check
