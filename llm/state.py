"""The batch between two runner calls (one row per active request, on the device) and the packed
prompts of an admission."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from .batch import Batch


@dataclass
class LoopState:
    """The batch between two calls: every field holds one equal block per active request along
    dim 0 ([bs, ...], or [bs * m] flat), in the order of the active request list."""
    rows: Tensor          # [bs] int32 the requests' req_to_token rows
    seq_lens: Tensor      # [bs] int32 tokens in each request's cache

    def select(self, keep: Tensor):
        """The requests at positions keep [n] int64 (those still running), in that order."""
        bs = self.rows.shape[0]
        return replace(self, **{f.name: _blocks(getattr(self, f.name), bs, keep)
                                for f in fields(self)})


    def concat(self, other: "LoopState") -> "LoopState":
        """This batch's requests, then `other`'s (admitted into the running batch)."""
        return replace(self, **{f.name: torch.cat([getattr(self, f.name), getattr(other, f.name)])
                                for f in fields(self)})


def _blocks(t: Tensor, bs: int, keep: Tensor) -> Tensor:
    return t.reshape(bs, -1).index_select(0, keep).reshape(-1, *t.shape[1:])   # no host sync


@dataclass
class SpecState(LoopState):
    """What the next EAGLE round starts from."""
    verified_id: Tensor   # [bs] int64 the last verified token (the next tree's root)
    topk_p: Tensor        # [bs, topk] fp32 the head's first-step draft distribution
    topk_index: Tensor    # [bs, topk] int64 its tokens
    hidden: Tensor        # [bs, H] the head's hidden at the last verified position
    draft_loc: Tensor     # [bs * steps * topk] int64 KV slots of the draft tree's nodes


@dataclass
class GreedyState(LoopState):
    cur: Tensor           # [bs] int64 the token the next decode step feeds


@dataclass
class PrefillBatch:
    """The batch's prompts packed request after request (the prefill's inputs)."""
    ids: Tensor           # [n_tok] int64
    positions: Tensor     # [n_tok] int64
    rows: Tensor          # [bs] int32 req_to_token rows
    seq_lens: Tensor      # [bs] int32 prompt lengths
    qo: Tensor            # [bs + 1] int32 request r's tokens are ids[qo[r]:qo[r+1]]
    loc: Tensor           # [n_tok] int64 KV slots

    def batch(self, kv) -> Batch:
        """The extend's `Batch` over cache `kv` (the prompts' packed tokens)."""
        return Batch(kv, kv.req_to_token, self.rows, self.seq_lens, self.loc, qo_indptr=self.qo)


def to_device(data, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list (or CPU tensor) on `device` without a host synchronisation: on a GPU through
    a pinned buffer and a copy queued on the current stream (the caching host allocator keeps
    the buffer until the copy has run), so the host does not wait for the work already queued,
    a round in flight included. A plain copy elsewhere."""
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pack_prompts(reqs, req_to_token: Tensor) -> PrefillBatch:
    """The requests' prompts with the slots their rows got at admission (no host sync: a round
    may be in flight while an admission is packed)."""
    dev = req_to_token.device
    lens = [len(r.prompt) for r in reqs]
    positions = to_device([p for n in lens for p in range(n)], torch.int64, dev)
    rows = to_device([r.row for r in reqs], torch.int32, dev)
    seq_lens = to_device(lens, torch.int32, dev)
    token_rows = to_device([r.row for r in reqs for _ in range(len(r.prompt))], torch.int64, dev)
    loc = req_to_token[token_rows, positions].long()
    return PrefillBatch(
        ids=to_device([t for r in reqs for t in r.prompt], torch.int64, dev),
        positions=positions, rows=rows, seq_lens=seq_lens, loc=loc,
        qo=to_device([0] + torch.tensor(lens).cumsum(0).tolist(), torch.int32, dev))
