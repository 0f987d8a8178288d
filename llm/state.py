"""The batch between two runner calls (one row per active request, on the device) and the packed
prompts of an admission."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from .batch import Batch

TOP_K_MAX = 2 ** 31 - 1                    # an int32 lane; any k >= the vocabulary keeps all
TOP_P_BELOW_ONE = 1.0 - 2.0 ** -24         # the largest fp32 below 1


@dataclass(frozen=True)
class SamplingLanes:
    """The requests' sampling parameters as one lane each ([bs] device tensors, the runner
    programs' `sampling_inputs`): what decode and verify draw with."""
    temperature: Tensor   # [bs] fp32 (0: greedy)
    top_k: Tensor         # [bs] int32 (0: off)
    top_p: Tensor         # [bs] fp32 (1: off)
    min_p: Tensor         # [bs] fp32 (0: off)
    seed: Tensor          # [bs] int64 the request's stream

    @classmethod
    def of(cls, params, seeds, device: torch.device) -> "SamplingLanes":
        """Lanes of `params` (SamplingParams, one per request) with their resolved `seeds` (ints),
        copied without a host synchronisation."""
        def lane(get, dtype):
            return to_device([get(p) for p in params], dtype, device)
        # packed so the fp32 / int32 lanes keep the meaning: a top_p just below 1 must not round
        # to 1 (off), a top_k past int32 is the same "keep all" as the vocabulary's size
        return cls(temperature=lane(lambda p: 0.0 if p.greedy else p.temperature, torch.float32),
                   top_k=lane(lambda p: min(p.top_k, TOP_K_MAX), torch.int32),
                   top_p=lane(lambda p: p.top_p if p.top_p >= 1 else min(p.top_p, TOP_P_BELOW_ONE),
                              torch.float32),
                   min_p=lane(lambda p: p.min_p, torch.float32),
                   seed=to_device(list(seeds), torch.int64, device))

    def inputs(self) -> dict[str, Tensor]:
        """The runner inputs by name (`programs.sampling_inputs`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def repeat(self, n: int) -> "SamplingLanes":
        """Each request's lane n times in a row ([bs * n]: one per tree node, request-major)."""
        return replace(self, **{k: v.repeat_interleave(n) for k, v in self.inputs().items()})

    def head(self, n: int) -> "SamplingLanes":
        """The first n lanes (views, no copy)."""
        return replace(self, **{k: v[:n] for k, v in self.inputs().items()})

    def select(self, keep: Tensor) -> "SamplingLanes":
        return replace(self, **{k: v.index_select(0, keep) for k, v in self.inputs().items()})

    def concat(self, other: "SamplingLanes") -> "SamplingLanes":
        return replace(self, **{k: torch.cat([v, getattr(other, k)])
                                for k, v in self.inputs().items()})


@dataclass
class LoopState:
    """The batch between two calls: every field holds one equal block per active request along
    dim 0 ([bs, ...], or [bs * m] flat), in the order of the active request list; `sampling`
    their sampling lanes (None: all greedy)."""
    rows: Tensor          # [bs] int32 the requests' req_to_token rows
    seq_lens: Tensor      # [bs] int32 tokens in each request's cache
    sampling: SamplingLanes | None = field(default=None, kw_only=True)

    def select(self, keep: Tensor):
        """The requests at positions keep [n] int64 (those still running), in that order."""
        bs = self.rows.shape[0]
        return replace(self, **{f.name: _blocks(getattr(self, f.name), bs, keep)
                                for f in fields(self)})

    def concat(self, other: "LoopState") -> "LoopState":
        """This batch's requests, then `other`'s (admitted into the running batch)."""
        mine, theirs = self.lanes(), other.lanes()
        out = {f.name: torch.cat([getattr(self, f.name), getattr(other, f.name)])
               for f in fields(self) if f.name != "sampling"}
        return replace(self, **out, sampling=mine.concat(theirs))

    def lanes(self) -> SamplingLanes:
        """The sampling lanes, greedy ones (the declared pads) where none were given."""
        if self.sampling is not None:
            return self.sampling
        bs, dev = self.rows.shape[0], self.rows.device
        return SamplingLanes(temperature=torch.zeros(bs, device=dev),
                             top_k=torch.zeros(bs, dtype=torch.int32, device=dev),
                             top_p=torch.ones(bs, device=dev), min_p=torch.zeros(bs, device=dev),
                             seed=torch.zeros(bs, dtype=torch.int64, device=dev))


def _blocks(t, bs: int, keep: Tensor):
    if t is None:
        return None
    if isinstance(t, SamplingLanes):
        return t.select(keep)
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


def drop_done(active: list, st: LoopState, gone=lambda r: r.done):
    """The requests not `gone` (default: not done) and their rows of `st` (an index copied
    without a host sync)."""
    keep = [i for i, r in enumerate(active) if not gone(r)]
    if len(keep) == len(active):
        return active, st
    return [active[i] for i in keep], st.select(to_device(keep, torch.long, st.rows.device))
