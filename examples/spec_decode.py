"""EAGLE speculative decoding (and plain greedy decoding) over padgraph's runner programs.

Every step of the loop is a call of a compiled program (backend "cuda" on a GPU, "reference" on
the CPU): draft → verify → draft-extend for EAGLE, decode for greedy. Prefill runs eagerly, or
through the "prefill" program (`Worker(prefill="runner")`). The batch shrinks as requests finish
(EOS or max tokens), so raw batch sizes are odd; a finished request's KV slots and req_to_token
row go back to the allocators once no round in flight uses them. Given more requests than
max_bs, the rest wait and are admitted as rows free up (continuous admission: each admission
is prefilled and appended to the running batch before the next round is queued, with no host
synchronisation when overlapped: its first tokens are read back after that round is queued).

Per-request KV: a request owns one req_to_token row and, from admission, the slots for its whole
budget (prompt + max_new_tokens + tree scratch), so draft and verify tokens use the slots of the
positions they occupy; verify commits the accepted path by permuting the row (no KV copies).
Draft position p holds (token p+1, target hidden p), so the draft cache is one position behind.

Model protocol (Llama-like and DeepSeek-like targets alike): `forward_decode / forward_extend /
forward_verify` return `(logits, hidden)` and read their cache from `kv` (`kv.k[i]`/`kv.v[i]`
K/V pools, or `kv.latent[i]` MLA latent rows); a target with `forward_verify_hidden` verifies
with it and `greedy_ids(hidden)` (the argmax of its logits; default `logits(hidden).argmax(-1)`),
without writing fp32 logits; a target with `new_cache(n_layers, n_slots, max_context,
n_req_rows)` allocates its own cache (an object with `req_to_token` and `state()`, the bound
tensors by state name), otherwise K/V pools of its `cfg` are used. Draft heads: `forward_extend`,
`forward_draft_step`, `topk` (a `models.draft_head.DraftHead`: EagleHead, MTPHead).

Between calls the loop keeps one row per active request in a `SpecState` (or `GreedyState`);
`select(keep)` drops the finished ones. `RunStats.phases` says where the time went (`PhaseClock`:
CUDA events on a GPU, so timing adds no host synchronisation).

Overlap scheduling (`Worker(..., overlap=True)`, the default): a round needs nothing from the
host, only the previous round's device-side state, so round N+1 is queued before round N's
results are read. After queuing a round the loop starts a non-blocking copy of its accept
lengths and tokens (greedy: next tokens and top-2 gaps) into pinned host memory and records an
event (`Readback`); it then queues the next round, and only then waits for the previous round's
event and processes its results (emit, detect finished requests). A request that finishes in
round N has already been queued into round N+1: that lane's results are discarded, its rows
are dropped before round N+2 is queued, and its KV is released once round N+1 has been read
back (`Worker._loop`); a request sure to finish in the round in flight (one token left) is kept
out of the next round instead. The run is the same token for token as without overlap; with
at most max_bs requests it costs at most one trailing round (`RunStats.rounds` counts it) and
at most one discarded lane-round per request (none for a finish foreseen: greedy without EOS
runs none). Tail sync (`Worker(tail_sync=True)`, the default): when every running request may
finish in the round in flight (its budget left is at most what one round can emit), the loop
reads that round back before queuing the next instead of queuing a round that may be discarded
whole: at the end of a batch it costs a host round trip (the GPU waits for the host's next
launches) instead of a whole trailing round. With more requests (continuous admission) a row freed by a finish found one round
late is handed out one round later too, so a queued request can start later and the run can
take a few more rounds than without overlap.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

import padgraph as pg
from padgraph.backends.triton import eagle as ops
from padgraph.backends.triton.kv import KVCache, RowAllocator, SlotAllocator
from padgraph.runners import (decode_program, draft_extend_program, draft_prefill_program,
                              draft_program,
                              extend_program, verify_program)

from models.llama import last_tokens
from request_checks import budget, prompt_ids


@dataclass(frozen=True)
class SpecConfig:
    steps: int = 4          # draft depth (steps - 1 draft forwards)
    topk: int = 4           # expansion width per step
    num_draft_tokens: int = 8   # k: tree nodes verified per request, root included

    def __post_init__(self):
        for name in ("steps", "topk", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"SpecConfig.{name} must be an int; got {v!r}")
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"SpecConfig: steps and topk must be >= 1; got steps={self.steps}, "
                             f"topk={self.topk}")
        if not 2 <= self.num_draft_tokens <= self.n_candidates + 1:
            raise ValueError(
                f"SpecConfig: num_draft_tokens (k, root included) must be in 2 .. "
                f"{self.n_candidates + 1}: the root plus at most the {self.n_candidates} "
                f"candidates that steps={self.steps}, topk={self.topk} draft (topk + "
                f"(steps - 1) * topk**2); got {self.num_draft_tokens}")

    @property
    def n_candidates(self) -> int:
        """Draft tokens a round scores: topk at the first step, topk**2 at each later one."""
        return self.topk + (self.steps - 1) * self.topk ** 2

    @property
    def n_path(self) -> int:
        return self.steps + 1


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    row: int = 0
    slots: list[int] = field(default_factory=list)
    done: bool = False
    gaps: list[float] = field(default_factory=list)   # greedy: target's top-1 minus top-2 logit


def _sure_to_finish(r: Request) -> bool:
    """One token left: the round in flight finishes it (every round emits at least one)."""
    return r.max_new_tokens - len(r.output) <= 1


def _may_finish(r: Request, max_emit: int) -> bool:
    """At most max_emit tokens left (a round emits up to max_emit): the round in flight may
    finish it."""
    return r.max_new_tokens - len(r.output) <= max_emit


_CACHE_NAMES = {"k_cache": "k", "v_cache": "v", "latent_cache": "latent"}   # state -> kv.<attr>


class _Caches:
    """The bound caches as the models read them (`kv.k`, `kv.v` or `kv.latent`); a plain class,
    which torch.compile traces (a SimpleNamespace it does not)."""

    def __init__(self, caches: dict):
        for attr, value in caches.items():      # setattr: dynamo traces it
            setattr(self, attr, value)


class _Raw(dict):
    """Raw tensors and bound state by name, read as a body reads its view (`x.name`, `x[name]`):
    for calling a runner's body eagerly at the raw sizes."""
    __getattr__ = dict.__getitem__


def _kv(x):
    return _Caches({attr: x[name] for name, attr in _CACHE_NAMES.items() if name in x})


def new_cache(target, n_layers: int, n_slots: int, max_context: int, n_req_rows: int):
    """The target's paged cache: its own `new_cache` (e.g. a latent cache), else K/V pools."""
    if hasattr(target, "new_cache"):
        return target.new_cache(n_layers, n_slots, max_context, n_req_rows)
    cfg, p = target.cfg, target.lm_head.weight
    return KVCache(n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, max_context, n_req_rows,
                   p.dtype, p.device)


def cache_state(cache) -> dict:
    """A cache's bound state by name, req_to_token aside: its `state()`, or K/V pools."""
    return cache.state() if hasattr(cache, "state") else {"k_cache": cache.k, "v_cache": cache.v}


# ------------------------------------------------------------------------------------ bodies

def decode_body(target):
    def body(x):
        logits, _ = target.forward_decode(x.input_ids, x.positions, _kv(x), x.req_to_token,
                                          x.req_pool_indices, x.seq_lens, x.out_cache_loc)
        top2 = logits.topk(2, dim=-1).values                         # [bs, 2]
        return {"next_token": logits.argmax(-1), "top2_gap": top2[:, 0] - top2[:, 1]}
    return body


def extend_body(target):
    """Prefill: the target over the packed prompts; every token's hidden (the draft's prefill
    reads them) and each request's last one (the caller applies the lm_head to the real rows)."""
    def body(x):
        hidden = target.forward_extend_hidden(
            x.input_ids, x.positions, _kv(x), x.req_to_token, x.req_pool_indices, x.seq_lens,
            x.qo_indptr, x.out_cache_loc)                            # [tokens, H]
        return {"hidden": hidden, "last_hidden": hidden[last_tokens(x.qo_indptr)]}
    return body


def prefill_buckets(max_tokens: int) -> pg.Buckets:
    """Packed-token ladder for the prefill program: 16, 24, 32, 48, 64, ... (powers of two and
    1.5x them), up to max_tokens: a batch pads by at most a third."""
    sizes = sorted({s for i in range(4, max(4, max_tokens.bit_length()) + 1)
                    for s in (1 << i, 3 << (i - 1)) if s <= max_tokens})
    return pg.Buckets(sizes + ([max_tokens] if not sizes or sizes[-1] != max_tokens else []))


def verify_ids(target):
    """(*verify args) -> (hidden [bs*k, H], the target's argmax ids [bs*k]): through
    `forward_verify_hidden` and `greedy_ids` (default `logits(hidden).argmax(-1)`) where the
    target has them, with no fp32 [bs*k, V] logits; else `forward_verify`'s logits."""
    if not hasattr(target, "forward_verify_hidden"):
        def forward(*args):
            logits, hidden = target.forward_verify(*args)
            return hidden, logits.argmax(-1)
        return forward
    greedy_ids = getattr(target, "greedy_ids", None) or (lambda h: target.logits(h).argmax(-1))

    def forward(*args):
        hidden = target.forward_verify_hidden(*args)
        return hidden, greedy_ids(hidden)
    return forward


def verify_body(target, spec: SpecConfig):
    k, steps = spec.num_draft_tokens, spec.steps
    forward = verify_ids(target)

    def body(x):
        bs = x.bucket
        args = (x.input_ids, x.positions, _kv(x), x.req_to_token, x.req_pool_indices,
                x.seq_lens + k, x.tree_mask, x.out_cache_loc)
        hidden, ids = forward(*args)                                 # [bs*k, H], [bs*k]
        predict = ids.view(bs, k)
        acc_len, acc_idx, out_tokens = ops.verify_greedy(
            x.input_ids.view(bs, k), x.tree_mask, predict, x.req_to_token,
            x.req_pool_indices, x.seq_lens, steps)
        ids, pos, loc, hid, qo, new_lens = ops.pack_draft_extend(
            acc_len, acc_idx, out_tokens, hidden, x.seq_lens, x.req_to_token,
            x.req_pool_indices, x.extent("bs"))
        bonus = out_tokens.gather(1, (acc_len.long() - 1)[:, None])[:, 0]
        return {"accept_len": acc_len, "out_tokens": out_tokens, "bonus": bonus,
                "de_input_ids": ids, "de_positions": pos, "de_out_cache_loc": loc,
                "de_hidden": hid, "de_qo_indptr": qo, "de_seq_lens": new_lens}
    return body


def draft_body(head, spec: SpecConfig):
    steps, topk, k = spec.steps, spec.topk, spec.num_draft_tokens
    n = (steps - 1) * topk                                           # nodes run through the head

    def body(x):
        bs = x.bucket
        loc = x.out_cache_loc.view(bs, steps * topk)
        mask = torch.eye(max(n, 1), dtype=torch.bool, device=loc.device).expand(bs, -1, -1)
        p, idx, hid, scores, prev = x.topk_p, x.topk_index, x.hidden_states, None, None
        levels = []
        for step in range(steps):
            ids, hid, scores, lv_s, lv_t, expanded, parent_slot = ops.select_top_k(
                step, p, idx, hid, scores, topk)
            par = torch.full_like(lv_t, -1) if step == 0 else ops.level_parents(prev, topk)
            levels.append((lv_s, lv_t, par))
            prev = ops.level_offset(step, topk) + expanded
            if step == steps - 1:
                break
            mask = ops.expand_draft_mask(mask, step, topk, parent_slot)
            positions = (x.positions[:, None] + step).expand(bs, topk).reshape(-1)
            hid = head.forward_draft_step(
                step, ids, hid, positions, _kv(x), x.req_to_token, x.req_pool_indices,
                x.seq_lens + n, mask, loc[:, step * topk:(step + 1) * topk].reshape(-1))
            p, idx = head.topk(hid, topk)                            # [bs*topk, topk]
        s, t, par = (torch.cat(c, dim=1) for c in zip(*levels))
        draft_tokens, tree_mask, depth, _ = ops.build_tree(s, t, par, k, topk, steps)
        return {"draft_tokens": draft_tokens, "tree_mask": tree_mask, "depth": depth}
    return body


def first_draft(head, h_last, req_to_token, req_pool_indices, seq_lens, spec: SpecConfig) -> dict:
    """What the next draft starts from, per request: the head's top-k at its last hidden
    h_last [bs, H] and the slots of its steps * topk draft nodes (after seq_lens)."""
    p, idx = head.topk(h_last, spec.topk)
    loc = ops.assign_cache_locs(req_to_token, req_pool_indices, seq_lens, spec.steps * spec.topk)
    return {"topk_p": p, "topk_index": idx, "next_hidden": h_last, "draft_out_cache_loc": loc}


def shifted_prompts(input_ids, qo_indptr, first):
    """The head's prefill tokens over packed prompts: token t becomes token t+1 of its prompt,
    or at each prompt's last position its request's first generated token `first` [reqs].
    Padded tokens (past qo_indptr[-1]) are never a prompt's last; padded requests own none."""
    n, bs = input_ids.shape[0], first.shape[0]
    ends = qo_indptr[1:].long()                                      # [reqs] one past the last
    t = torch.arange(n, device=ends.device)
    req = torch.searchsorted(ends, t, right=True).clamp(max=bs - 1)  # token -> request
    nxt = torch.cat([input_ids[1:], input_ids[:1]])
    return torch.where((t + 1) == ends[req], first[req], nxt)


def draft_extend_body(head, spec: SpecConfig):
    def body(x):
        h = head.forward_extend(x.input_ids, x.hidden_states, x.positions, _kv(x),
                                x.req_to_token, x.req_pool_indices, x.seq_lens, x.qo_indptr,
                                x.out_cache_loc)                     # [tokens, H]
        last = (x.qo_indptr[:-1] + x.accept_lens - 1).clamp(0, h.shape[0] - 1).long()
        return first_draft(head, h[last], x.req_to_token, x.req_pool_indices, x.seq_lens, spec)
    return body


def draft_prefill_body(head, spec: SpecConfig):
    """The head over the packed prompts the target has just prefilled (`shifted_prompts`, the
    target's hidden per token); each request's last token gives its first draft. The body of
    the draft-prefill program, and what `Worker.draft_prefill` runs eagerly."""
    def body(x):
        ids = shifted_prompts(x.input_ids, x.qo_indptr, x.verified_id)
        h = head.forward_extend(ids, x.hidden_states, x.positions, _kv(x), x.req_to_token,
                                x.req_pool_indices, x.seq_lens, x.qo_indptr,
                                x.out_cache_loc)                     # [tokens, H]
        last = (x.qo_indptr[1:].long() - 1).clamp(0, h.shape[0] - 1)
        return first_draft(head, h[last], x.req_to_token, x.req_pool_indices, x.seq_lens, spec)
    return body


# ---------------------------------------------------------------------------------- programs

def _state_decl(cache_names) -> dict[str, pg.State]:
    """The runners' bound state: the caches (sink slot 0) and req_to_token (sink row 0)."""
    return {**{n: pg.State(sink=0) for n in cache_names}, "req_to_token": pg.State(sink=0)}


def programs(cfg, spec: SpecConfig, hidden_dtype, buckets=None,
             cache_names=("k_cache", "v_cache")) -> dict[str, pg.Program]:
    """The four runner programs with this model's outputs and cache state names."""
    H, k, S, topk = cfg.hidden_size, spec.num_draft_tokens, spec.steps, spec.topk
    O = pg.Output
    state = _state_decl(cache_names)
    return {
        "decode": decode_program(lambda a: {
            "next_token": O((a.bs,), torch.int64), "top2_gap": O((a.bs,), torch.float32)},
            buckets=buckets, state=state),
        "verify": verify_program(k, lambda a: {
            "accept_len": O((a.bs,), torch.int32), "out_tokens": O((a.bs, S + 1), torch.int64),
            "bonus": O((a.bs,), torch.int64),
            "de_input_ids": O((a.bs * (S + 1),), torch.int64),
            "de_positions": O((a.bs * (S + 1),), torch.int64),
            "de_out_cache_loc": O((a.bs * (S + 1),), torch.int64),
            "de_hidden": O((a.bs * (S + 1), H), hidden_dtype),
            "de_qo_indptr": O((a.bs + 1,), torch.int32),
            "de_seq_lens": O((a.bs,), torch.int32)}, buckets=buckets, state=state),
        "draft": draft_program(S, topk, H, hidden_dtype, lambda a: {
            "draft_tokens": O((a.bs, k - 1), torch.int64),
            "tree_mask": O((a.bs, k, k), torch.bool),
            "depth": O((a.bs, k), torch.int64)}, buckets=buckets, state=state),
        "draft_extend": draft_extend_program(S, H, hidden_dtype, lambda a: {
            "topk_p": O((a.bs, topk), torch.float32), "topk_index": O((a.bs, topk), torch.int64),
            "next_hidden": O((a.bs, H), hidden_dtype),
            "draft_out_cache_loc": O((a.bs * (S * topk),), torch.int64)}, buckets=buckets,
            state=state),
    }


def extend_prefill_program(cfg, hidden_dtype, max_tokens: int,
                           cache_names=("k_cache", "v_cache")) -> pg.Program:
    """The prefill runner program (bucketed by packed prompt tokens, `prefill_buckets`)."""
    O = pg.Output
    return extend_program(lambda a: {
        "hidden": O((a.tokens, cfg.hidden_size), hidden_dtype),
        "last_hidden": O((a.bs, cfg.hidden_size), hidden_dtype)},
        buckets=prefill_buckets(max_tokens), state=_state_decl(cache_names), name="prefill")


def draft_prefill_runner_program(cfg, spec: SpecConfig, hidden_dtype, max_tokens: int,
                                 cache_names=("k_cache", "v_cache")) -> pg.Program:
    """The draft-prefill runner program, on the prefill program's ladder of packed tokens."""
    O, S, topk = pg.Output, spec.steps, spec.topk
    return draft_prefill_program(cfg.hidden_size, hidden_dtype, lambda a: {
        "topk_p": O((a.bs, topk), torch.float32), "topk_index": O((a.bs, topk), torch.int64),
        "next_hidden": O((a.bs, cfg.hidden_size), hidden_dtype),
        "draft_out_cache_loc": O((a.bs * (S * topk),), torch.int64)},
        buckets=prefill_buckets(max_tokens), state=_state_decl(cache_names),
        name="draft_prefill")


def bodies(target, head, spec: SpecConfig) -> dict:
    return {"decode": decode_body(target), "verify": verify_body(target, spec),
            "draft": draft_body(head, spec), "draft_extend": draft_extend_body(head, spec)}


# ---------------------------------------------------------------------------- loop state

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


# -------------------------------------------------------------------------------- timing

def to_host(*tensors) -> list[list]:
    """Tensors → host lists; device tensors with one synchronisation (a `Readback` hands its
    host copies, already complete, through here)."""
    if tensors[0].is_cuda:
        outs = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream().synchronize()
    else:
        outs = [t.cpu() for t in tensors]
    return [o.tolist() for o in outs]


class Readback:
    """One round's results on their way to the host, started as soon as the round is queued.

    On a GPU: non-blocking device → host copies into pinned buffers, queued on the current
    stream behind the round, and an event recorded after them; nothing waits until `wait()`.
    The copies are queued before the next round, so they read this round's outputs before the
    next round's graphs overwrite them (runners hand out the same output buffers again). On the
    CPU the copies are plain and complete at once (the same code path, `wait` does not block).
    """

    def __init__(self, *tensors: Tensor):
        cuda = tensors[0].is_cuda
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                     .copy_(t, non_blocking=cuda) for t in tensors]
        self.event = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[list]:
        """The results as host lists: the loop's one host synchronisation per round."""
        if self.event is not None:
            self.event.synchronize()
        return to_host(*self.host)


class PhaseClock:
    """Time per phase of a loop: `mark(phase)` ends the interval since the previous mark and
    charges it to `phase`.

    On a GPU a mark records a CUDA event on the current stream and nothing waits for it: the
    intervals are the stream's timeline, so a phase includes any wait for the host to launch it
    and the phases of a run add up to its wall time. `totals()` reads them once the run has
    synchronised. On the CPU a mark reads perf_counter (the work is synchronous).

    The loop's "host" phase is the host waiting for the previous round's readback and processing
    it (emit, retire). With overlap the next round is already queued meanwhile: on the CPU the
    phase is that wait + processing in wall time; on a GPU it is the stream's time from the end
    of the queued round to the host's mark, i.e. the readback copies and row drops plus any time
    the GPU ran dry waiting for the host (near zero when the host keeps ahead).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks: list[tuple[str | None, object]] = []
        self.mark(None)

    def mark(self, phase: str | None) -> None:
        if self.cuda:
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        self._marks.append((phase, stamp))

    def totals(self) -> dict[str, float]:
        """Seconds per phase, in order of first appearance (GPU: after a synchronisation)."""
        out: dict[str, float] = {}
        for (_, a), (phase, b) in zip(self._marks, self._marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[phase] = out.get(phase, 0.0) + dt
        return out


@dataclass
class RunStats:
    """What one `generate_*` run did.

    rounds counts the rounds (EAGLE) or decode steps (greedy) launched on the device. With
    overlap that includes a trailing round queued before the host knew every request had
    finished (every lane of it discarded), so with at most max_bs requests it is at most one
    more than without overlap (with continuous admission, rows freed one round late can delay
    the queued requests' start by a round each time);
    `round_seconds` divides the loop's time by it. accepted and request_rounds count only
    real request-rounds, whose results were emitted; discarded counts the lane-rounds whose
    results were thrown away (a request finished one round earlier, unforeseen: at most one
    per request that ran a round, with overlap; 0 without). overlap: whether this run was
    overlapped.
    """
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0            # verify rounds (EAGLE) or decode steps (greedy) launched
    accepted: int = 0          # accept lengths summed over real request-rounds (verify's count)
    emitted: int = 0           # tokens those request-rounds emitted (EOS / budget cut the last)
    request_rounds: int = 0    # real request-rounds, for the mean accept length
    discarded: int = 0         # lane-rounds run for an already finished request (overlap)
    overlap: bool = False
    prefills: int = 0          # prefill batches: 1, more with continuous admission
    phases: dict[str, float] = field(default_factory=dict)   # seconds: prefill, draft, verify,
    #                            draft_extend, host (EAGLE) or prefill, decode, host (greedy);
    #                            host: waiting for the previous readback + processing it

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept_len(self) -> float:
        """Tokens the target accepted per request-round, bonus token included (draft quality)."""
        return self.accepted / self.request_rounds if self.request_rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a request gained per round: accept_len less what EOS or the budget cut."""
        return self.emitted / self.request_rounds if self.request_rounds else 0.0

    @property
    def round_seconds(self) -> float:
        """Mean time of one round (EAGLE) or step (greedy): the phases after prefill."""
        loop = sum(t for name, t in self.phases.items() if name != "prefill")
        return loop / self.rounds if self.rounds else 0.0


# ------------------------------------------------------------------------------------ worker

class Worker:
    """Serves one batch of requests with EAGLE (`generate_spec`) or greedy (`generate_greedy`).

    backend: "cuda" | "reference"; runners are compiled on first use and kept, so repeated
    calls replay the same graphs. torch_compile: compile the decoder layers inside the runners
    (`options`); None: on for "cuda", off for "reference" (the eager oracle). draft_compile
    (with torch_compile): "regions" (the default) compiles the head's layer in draft and
    draft-extend, "whole" their whole bodies (tree expansion, top-k, tree build included: fewer,
    fused launches per draft step; in the H200 Llama main job the draft phase fell from 1.98 to
    1.52 ms a round; not yet run on a GPU for the DeepSeek MTP head, hence not the default).
    overlap: queue round N+1 before reading round N back (see the module docstring and `_loop`);
    False runs the plain loop (read back, then queue the next). tail_sync (with overlap): read
    the round in flight back before queuing the next when it may finish every running request
    (`_loop`), so a batch's end runs no round discarded whole.
    max_context bounds prompt + max_new_tokens + the tree margin per request (checked at
    admission); with overlap the worker reserves `overlap_margin` more positions where they fit.
    prefill: "eager" runs the target's extend over the prompts as plain torch calls; "runner"
    through the "prefill" program on the worker's backend (cuda: one graph per bucket of packed
    prompt tokens, `prefill_buckets`, the decoder layers compiled as in decode), followed by the
    lm_head of the requests' last rows (eager: real rows only). prefill_tokens: the top of
    that ladder (default max_bs * max_context, all a batch can hold); a batch past it runs
    through the runner's overflow policy.
    """

    def __init__(self, target, head, spec: SpecConfig, *, backend: str = "reference",
                 max_bs: int = 16, max_context: int = 512, eos_id: int | None = None,
                 buckets=None, compile_options: dict | None = None, overlap: bool = True,
                 torch_compile: bool | None = None, draft_compile: str = "regions",
                 prefill: str = "eager", prefill_tokens: int | None = None,
                 draft_prefill: str = "eager", tail_sync: bool = True):
        if draft_compile not in ("regions", "whole"):
            raise ValueError(f"draft_compile must be 'regions' or 'whole'; got {draft_compile!r}")
        if prefill not in ("eager", "runner"):
            raise ValueError(f"prefill must be 'eager' or 'runner'; got {prefill!r}")
        if draft_prefill not in ("eager", "runner"):
            raise ValueError(f"draft_prefill must be 'eager' or 'runner'; got {draft_prefill!r}")
        p = target.lm_head.weight
        self.target, self.head, self.spec, self.eos_id = target, head, spec, eos_id
        self.backend, self.max_bs, self.max_context = backend, max_bs, max_context
        self.overlap, self.tail_sync = overlap, tail_sync
        self.margin = max(spec.num_draft_tokens, spec.steps * spec.topk) + 1
        # A round that starts at seq_len s touches positions < s + margin - 1 (verify's k tree
        # tokens, the draft's steps * topk nodes). A request still running after a round has
        # emitted seq_len - prompt + 1 < max_new_tokens tokens, so real rounds start at
        # s <= prompt + max_new - 2, inside `prompt + max_new + margin`. With overlap a finished
        # request runs one more round, which starts up to steps + 1 (one round's accepted
        # tokens) further on: it needs steps + 1 more positions. (Greedy's extra step writes
        # position prompt + max_new - 1: inside the reservation anyway.)
        self.overlap_margin = spec.steps + 1
        n_slots = max_bs * max_context + 1      # every request reserves at most max_context
        self.kv = new_cache(target, target.cfg.n_layers, n_slots, max_context, max_bs + 1)
        self.dkv = new_cache(target, 1, n_slots, 2, 2)   # the head's layer; rows: self.kv's
        self.slots, self.rows = SlotAllocator(n_slots), RowAllocator(max_bs + 1)
        self.programs = programs(target.cfg, spec, p.dtype, buckets or pg.Buckets.default(max_bs),
                                 cache_names=tuple(cache_state(self.kv)))
        self.bodies = bodies(target, head, spec) if head is not None else {
            "decode": decode_body(target)}
        self.prefill_mode = prefill
        if prefill == "runner":     # a batch holds at most max_bs * max_context prompt tokens
            self.programs["prefill"] = extend_prefill_program(
                target.cfg, p.dtype, prefill_tokens or max_bs * max_context,
                tuple(cache_state(self.kv)))
            self.bodies["prefill"] = extend_body(target)
        self.draft_prefill_mode = draft_prefill if head is not None else "eager"
        if self.draft_prefill_mode == "runner":   # the head's prefill on the same ladder
            self.programs["draft_prefill"] = draft_prefill_runner_program(
                target.cfg, spec, p.dtype, prefill_tokens or max_bs * max_context,
                tuple(cache_state(self.dkv)))
            self.bodies["draft_prefill"] = draft_prefill_body(head, spec)
        self.compile_options = compile_options or {}
        self.torch_compile = backend == "cuda" if torch_compile is None else torch_compile
        self.draft_compile = draft_compile
        self._runners: dict = {}

    def state(self, name: str) -> dict:
        kv = self.kv if name in ("decode", "verify", "prefill") else self.dkv
        return {**cache_state(kv), "req_to_token": self.kv.req_to_token}

    def options(self, name: str) -> dict:
        """pg.compile options of runner `name`: `compile_options`, plus (torch_compile) the
        decoder layers compiled regionally — the target's for decode / verify, the head's one
        layer for draft / draft-extend — so each layer kind compiles once for the whole ladder
        and inductor's fused kernels (norms, RoPE, activations) replace eager's small ones;
        draft_compile="whole": the draft and draft-extend bodies compiled whole."""
        opts = dict(self.compile_options)
        if self.torch_compile and "torch_compile" not in opts:
            if name in ("draft", "draft_extend") and self.draft_compile == "whole":
                opts["torch_compile"] = {"fullgraph": True}
            else:
                layers = (self.target.layers if name in ("decode", "verify", "prefill")
                          else [self.head.layer])
                opts["torch_compile"] = {"regions": layers, "fullgraph": True}
        return opts

    def runner(self, name: str):
        if name not in self._runners:
            self._runners[name] = pg.compile(self.programs[name], self.bodies[name],
                                             self.backend, state=self.state(name),
                                             **self.options(name))
        return self._runners[name]

    # ---- request lifecycle -------------------------------------------------------------
    def check_requests(self, prompts, max_new_tokens) -> None:
        """Before any request is admitted: each has a non-empty prompt of token ids in
        [0, vocab), max_new_tokens >= 1 (an int), and fits max_context with the tree margin."""
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        vocab = self.target.cfg.vocab_size
        for i, (prompt, n_new) in enumerate(zip(prompts, max_new_tokens)):
            n_new = budget(i, n_new)
            prompt_ids(i, prompt, vocab)
            if len(prompt) + n_new + self.margin > self.max_context:
                raise ValueError(f"request {i}: prompt {len(prompt)} + max_new_tokens {n_new} + "
                                 f"tree margin {self.margin} must fit max_context "
                                 f"{self.max_context}")

    def admit(self, prompts, max_new_tokens, rids=None) -> list[Request]:
        """Rows and KV slots for these requests (ids `rids`, default 0, 1, ...)."""
        self.check_requests(prompts, max_new_tokens)
        return self._admit(prompts, max_new_tokens, rids)

    def _admit(self, prompts, max_new_tokens, rids=None) -> list[Request]:
        """`admit` for requests `check_requests` has passed."""
        if len(prompts) > self.rows.n_free:
            raise ValueError(f"{len(prompts)} requests but {self.rows.n_free} free rows "
                             f"(max_bs={self.max_bs} running at once)")
        reqs = []
        rids = range(len(prompts)) if rids is None else rids
        try:
            for i, prompt, n_new in zip(rids, prompts, max_new_tokens):
                need = len(prompt) + n_new + self.margin
                if self.overlap:     # room for the extra round, as far as max_context allows
                    need = min(need + self.overlap_margin, self.max_context)
                r = Request(i, [int(t) for t in prompt], int(n_new), row=self.rows.alloc(1)[0])
                reqs.append(r)
                r.slots = self.slots.alloc(need)
                self.kv.req_to_token[r.row, :need] = to_device(r.slots, torch.int32,
                                                               self.kv.req_to_token.device)
        except BaseException:       # none of this batch stays held
            for r in reqs:
                if r.slots:
                    self.release(r)
                else:
                    self.rows.free([r.row])
            raise
        return reqs

    def spec_overlap_fits(self, prompts, max_new_tokens) -> bool:
        """Whether every request gets the positions an EAGLE round past its end touches; where
        one does not (max_context too small), the run goes without overlap (with a warning)."""
        if not self.overlap:
            return False
        short = [i for i, (p, n) in enumerate(zip(prompts, max_new_tokens))
                 if len(p) + n + self.margin + self.overlap_margin > self.max_context]
        if short:
            warnings.warn(f"overlap off for this run: requests {short} lack the "
                          f"{self.overlap_margin} positions past prompt + max_new_tokens + tree "
                          f"margin that the round after their end needs (max_context "
                          f"{self.max_context})", stacklevel=3)
        return not short

    def release(self, req: Request) -> None:
        self.kv.req_to_token[req.row].zero_()
        self.slots.free(req.slots)
        self.rows.free([req.row])
        req.slots, req.row = [], 0

    def emit(self, req: Request, tokens) -> bool:
        """Append tokens up to EOS / max_new_tokens; True when the request finished."""
        for t in tokens:
            req.output.append(t)
            if t == self.eos_id or len(req.output) >= req.max_new_tokens:
                req.done = True
                break
        return req.done

    def retire(self, active: list[Request], st: LoopState):
        """Release the finished requests and drop their rows of `st` (after prefill, read at
        once: no round has used the rows yet)."""
        for r in active:
            if r.done:
                self.release(r)
        return self._drop_done(active, st)

    @staticmethod
    def _drop_done(active: list[Request], st: LoopState, gone=lambda r: r.done):
        """The requests not `gone` (default: not done) and their rows of `st` (an index copied
        without a host sync)."""
        keep = [i for i, r in enumerate(active) if not gone(r)]
        if len(keep) == len(active):
            return active, st
        return [active[i] for i in keep], st.select(to_device(keep, torch.long, st.rows.device))

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self, active: list[Request], st: LoopState, step, consume, stats: RunStats,
              clock: PhaseClock, overlap: bool, refill: "_Refill | None" = None,
              max_emit: int = 1) -> None:
        """Run rounds until every request has finished (and, with `refill`, every queued one
        has been admitted and finished).

        step(st) queues one round for st's batch, starts its `Readback` and returns (the state
        the next round starts from, the readback); it needs nothing from the host. consume(req,
        values) takes one real lane's results (its entry of each read-back tensor), emits its
        tokens and returns whether the request finished.

        overlap=False: queue round N, read it back, retire, queue round N+1.

        overlap=True: queue round N+1 from round N's device-side state, then wait for round N's
        readback and process it. Requests found finished in round N are retired one round late:
        round N+1 is already queued with them, so their round-N+1 lanes are discarded when read;
        their rows are dropped (`LoopState.select`) from round N+1's output state before round
        N+2 is queued, and their KV row and slots are released only after round N+1 (the last
        round that touched them) has been read back. A request that is sure to finish in round
        N — one token left, and every round emits at least one — is kept out of round N+1
        instead (its rows dropped before that round is queued, released at round N's
        readback): greedy decoding without EOS then never runs a discarded lane, and a batch
        ends without a trailing round. Why that is safe: all rounds run on one
        stream, in order, so when round N+1's readback event has completed, round N+1 and
        everything queued before it have finished; the rows were dropped before round N+2, so
        no round queued later uses them. A released row or slot is therefore touched by no
        round still in flight, and a later reuse (the allocators hand them to the next batch's
        admission, which writes req_to_token from the host) cannot race with one. Releasing at
        once would rely on that host write being ordered behind the in-flight round.

        Tail sync (self.tail_sync): when every running request may finish in round N (at most
        max_emit tokens left, the most one round emits), round N+1 could be discarded whole: the
        loop reads round N back first, retires, and only then queues the next round (for the
        requests still running, and admissions), as without overlap. Greedy's max_emit is 1:
        those requests are sure to finish and kept out anyway, so its runs do not change.

        refill (continuous admission): before each round is queued, queued requests take the
        rows freed so far; they are prefilled (queued behind the round in flight) and their
        state is appended to the batch's, so the round about to be queued runs them too. Rows
        are freed as above, so an admitted request never gets a row a round in flight uses.
        With overlap nothing in an admission waits for the device (prompts and slot rows go
        through pinned buffers; `_Refill`): its first tokens are read once the next round is
        queued, beside round N's results, and a request its first token finishes (EOS) is
        retired one round late like any other.
        """
        stats.overlap = overlap
        pending = None                  # (lanes, Readback) of a queued round not yet read back
        late: list[Request] = []        # finished, but in the batch of the round in flight
        while active or pending or (refill is not None and refill.waiting):
            if not active and pending is None and self.rows.n_free == 0:
                raise RuntimeError(
                    f"{len(refill.queue)} requests wait for a row but none of the "
                    f"{self.rows.n - 1} is free and none is running: rows admitted outside this "
                    f"call (Worker.admit) must be released first")
            launched, kept_out = None, []
            # round N may finish every running request: read it back before queuing N+1
            sync_first = (self.tail_sync and overlap and pending is not None and bool(active)
                          and all(_may_finish(r, max_emit) for r in active))
            if active and overlap and pending is not None and not sync_first:  # N in flight
                kept_out = [r for r in active if _sure_to_finish(r)]
                if kept_out:
                    active, st = self._drop_done(active, st, gone=_sure_to_finish)
            if refill is not None and refill.waiting and not sync_first:   # after kept_out
                active, st = refill(active, st)
            if active and not sync_first:
                st, rb = step(st)       # round N+1, from round N's state on the device
                stats.rounds += 1
                launched = (active, rb)
            if not overlap:
                pending, launched = launched, None
            finished = []
            if pending is not None:
                lanes, rb = pending
                values = rb.wait()      # round N's results (round N+1 runs meanwhile)
                for i, r in enumerate(lanes):
                    if r.done:          # finished in round N-1: this lane ran for nothing
                        stats.discarded += 1
                    elif consume(r, [v[i] for v in values]):
                        finished.append(r)
                for r in late:          # their last round, N, is read back: release them
                    self.release(r)
                late = []
                for r in kept_out:      # kept out of round N+1 as sure to finish in round N
                    if not r.done:
                        raise RuntimeError(f"request {r.rid} was kept out of the next round as "
                                           f"sure to finish, but did not finish")
            if refill is not None and refill.unread:  # admitted before round N+1 was queued
                finished += refill.read_first()       # those their first token finished (EOS)
            if finished:
                in_flight = {id(r) for r in launched[0]} if launched is not None else set()
                for r in finished:      # round N+1 holds them: release after its readback
                    if id(r) in in_flight:
                        late.append(r)
                    else:               # no round in flight holds them (or kept out of N+1)
                        self.release(r)
                active, st = self._drop_done(active, st)   # before round N+2 is queued
            clock.mark("host")
            pending = launched

    # ---- prefill (eager, or the "prefill" runner) ---------------------------------------
    def prefill(self, reqs):
        """Target extend over the prompts; (last logits [bs, V], hidden, PrefillBatch)."""
        b = pack_prompts(reqs, self.kv.req_to_token)
        if self.prefill_mode == "runner":
            out = self.runner("prefill")(input_ids=b.ids, positions=b.positions,
                                         out_cache_loc=b.loc, seq_lens=b.seq_lens,
                                         req_pool_indices=b.rows, qo_indptr=b.qo)
            return self.target.logits(out.last_hidden), out.hidden, b
        logits, hidden = self.target.forward_extend(b.ids, b.positions, self.kv,
                                                    self.kv.req_to_token, b.rows, b.seq_lens,
                                                    b.qo, b.loc)
        return logits, hidden, b

    def draft_prefill(self, first, hidden, b: PrefillBatch) -> SpecState:
        """The head over (prompt[1:] + first token, target hidden): the first draft inputs.
        draft_prefill="runner": one runner call (`draft_prefill_body`, graphs on cuda) instead
        of the head's eager layer, top-k and slot assignment, whose launches the host issues
        one by one while the GPU, done with a short prefill, waits."""
        raw = dict(input_ids=b.ids, positions=b.positions, out_cache_loc=b.loc,
                   hidden_states=hidden, seq_lens=b.seq_lens, req_pool_indices=b.rows,
                   qo_indptr=b.qo, verified_id=first)
        if self.draft_prefill_mode == "runner":
            o = self.runner("draft_prefill")(**raw)
            # the outputs live until the runner's next call (the next admission): the batch
            # state owns copies (four small tensors an admission)
            o = {k: v.clone() for k, v in o.items()}
        else:                       # the same body, called on the raw tensors and bound caches
            o = draft_prefill_body(self.head, self.spec)(
                _Raw(**raw, **self.state("draft_prefill")))
        return SpecState(rows=b.rows, seq_lens=b.seq_lens, verified_id=first,
                         topk_p=o["topk_p"], topk_index=o["topk_index"],
                         hidden=o["next_hidden"], draft_loc=o["draft_out_cache_loc"])

    # ---- EAGLE -------------------------------------------------------------------------
    def spec_round(self, st: SpecState, clock: PhaseClock):
        """Queue draft → verify → draft-extend for the batch in `st` and start the readback of
        its accept lengths and tokens; (next state, Readback of (accept lengths [bs], tokens
        [bs, steps + 1] of which each request's first accept-length are its output)). No host
        synchronisation: the next round can be queued from the next state at once."""
        rt = self.kv.req_to_token
        d = self.runner("draft")(
            topk_p=st.topk_p, topk_index=st.topk_index, hidden_states=st.hidden,
            positions=st.seq_lens.long(), seq_lens=st.seq_lens, req_pool_indices=st.rows,
            out_cache_loc=st.draft_loc)
        clock.mark("draft")
        ids, pos, loc = ops.verify_inputs(st.verified_id, d.draft_tokens, d.depth, st.seq_lens,
                                          rt, st.rows)
        v = self.runner("verify")(input_ids=ids, positions=pos, out_cache_loc=loc,
                                  seq_lens=st.seq_lens, req_pool_indices=st.rows,
                                  tree_mask=d.tree_mask)
        clock.mark("verify")
        # draft-extend takes verify's packed tokens at their bound; their count stays on the GPU
        e = self.runner("draft_extend").call(
            dict(input_ids=v.de_input_ids, positions=v.de_positions, out_cache_loc=v.de_out_cache_loc,
                 hidden_states=v.de_hidden, seq_lens=v.de_seq_lens, req_pool_indices=st.rows,
                 accept_lens=v.accept_len, qo_indptr=v.de_qo_indptr),
            extents={"tokens": v.de_qo_indptr[-1]})
        clock.mark("draft_extend")
        rb = Readback(v.accept_len, v.out_tokens)   # queued behind the round, before the next
        nxt = SpecState(rows=st.rows, seq_lens=v.de_seq_lens, verified_id=v.bonus,
                        topk_p=e.topk_p, topk_index=e.topk_index, hidden=e.next_hidden,
                        draft_loc=e.draft_out_cache_loc)
        return nxt, rb

    def generate_spec(self, prompts, max_new_tokens) -> tuple[list[Request], RunStats]:
        """EAGLE over the requests: up to max_bs run at once; past that the rest wait and are
        admitted as rows free up (continuous admission). (Requests in prompt order, stats.)"""
        stats, t0 = RunStats(), _now(self)
        clock = PhaseClock(self.kv.req_to_token.is_cuda)

        def prefill_batch(reqs):
            logits, hidden, b = self.prefill(reqs)
            first = logits.argmax(-1)
            st = self.draft_prefill(first, hidden, b)
            stats.prefills += 1
            clock.mark("prefill")
            return st, Readback(first)

        def take_first(r: Request, values) -> bool:
            return self.emit(r, [values[0]])

        def consume(r: Request, values) -> bool:
            acc, toks = values
            stats.accepted += acc
            stats.request_rounds += 1
            before = len(r.output)
            done = self.emit(r, toks[:acc])
            stats.emitted += len(r.output) - before      # less than acc where EOS or the budget cut
            return done

        overlap = self.spec_overlap_fits(prompts, max_new_tokens)
        refill = _Refill(self, prompts, max_new_tokens, prefill_batch, take_first,
                         defer=overlap)                              # checks them all
        with self._abandon_on_error(refill):
            active, st = refill([], None)
            self._loop(active, st, lambda s: self.spec_round(s, clock), consume, stats, clock,
                       overlap, refill, max_emit=self.spec.steps + 1)
        return refill.reqs, self._finish(stats, t0, clock, refill.reqs)

    # ---- greedy ------------------------------------------------------------------------
    def decode_step(self, st: GreedyState, clock: PhaseClock):
        """Queue one decode step for the batch in `st` and start the readback of its tokens and
        top-2 gaps; (next state, Readback). No host synchronisation."""
        s1 = st.seq_lens + 1
        out = self.runner("decode")(
            input_ids=st.cur, positions=st.seq_lens.long(), seq_lens=s1, req_pool_indices=st.rows,
            out_cache_loc=ops.assign_cache_locs(self.kv.req_to_token, st.rows, st.seq_lens, 1))
        clock.mark("decode")
        rb = Readback(out.next_token, out.top2_gap)
        return GreedyState(st.rows, s1, out.next_token), rb

    def generate_greedy(self, prompts, max_new_tokens) -> tuple[list[Request], RunStats]:
        """Greedy decoding over the requests, admitted as `generate_spec` admits them."""
        stats, t0 = RunStats(), _now(self)
        clock = PhaseClock(self.kv.req_to_token.is_cuda)

        def prefill_batch(reqs):
            logits, _, b = self.prefill(reqs)
            first, top2 = logits.argmax(-1), logits.topk(2, dim=-1).values
            st = GreedyState(rows=b.rows, seq_lens=b.seq_lens, cur=first)
            stats.prefills += 1
            clock.mark("prefill")
            return st, Readback(first, top2[:, 0] - top2[:, 1])

        def take_first(r: Request, values) -> bool:
            tok, gap = values
            r.gaps = [gap]
            return self.emit(r, [tok])

        def consume(r: Request, values) -> bool:
            tok, gap = values
            r.gaps.append(gap)          # gaps[i]: the step that produced output[i] (real only)
            return self.emit(r, [tok])

        # greedy's extra step writes position prompt + max_new - 1: always inside the
        # reservation, so greedy overlaps whenever the worker does
        refill = _Refill(self, prompts, max_new_tokens, prefill_batch, take_first,
                         defer=self.overlap)                          # checks them all
        with self._abandon_on_error(refill):
            active, st = refill([], None)
            self._loop(active, st, lambda s: self.decode_step(s, clock), consume, stats, clock,
                       self.overlap, refill)
        return refill.reqs, self._finish(stats, t0, clock, refill.reqs)

    @contextlib.contextmanager
    def _abandon_on_error(self, refill: "_Refill"):
        """A generate call that raises (a bad request past the checks, an interrupt, a failing
        kernel) gives back every row and slot it admitted before the error propagates: the
        queued device work is waited for first (no round in flight may still use them), so the
        worker's next call starts from free rows, as after a call that returned."""
        try:
            yield
        except BaseException:
            if self.kv.req_to_token.is_cuda:
                try:
                    torch.cuda.synchronize()
                except Exception:       # a device error: the rows still come back
                    pass
            for r in refill.reqs:
                if r.slots:             # still held (release empties them)
                    self.release(r)
            raise

    def _finish(self, stats: RunStats, t0: float, clock: PhaseClock, reqs) -> RunStats:
        stats.seconds = _now(self) - t0
        stats.phases = clock.totals()
        stats.tokens = sum(len(r.output) for r in reqs)
        return stats


class _Refill:
    """Continuous admission for one generate_* call: the requests not yet admitted, in order;
    a call admits as many as there are free rows, prefills them and appends them to the running
    batch ((active, state) -> (active, state); state None: no batch yet).

    prefill_batch(reqs) queues the prefill and returns (state, Readback of the first tokens);
    take_first(req, values) emits a request's first token and says whether that finished it.

    defer=False, and the call that starts a batch: the first tokens are read back at once (a
    host synchronisation, with no round in flight to stall or none to overlap), the requests
    they finish are released and left out. defer=True (overlap scheduling), later admissions:
    nothing waits. The admitted requests join the batch at once; the loop reads their first
    tokens (`read_first`) after it has queued the next round, which then runs meanwhile, as
    it reads a round. A request whose budget is one token is sure to finish on its first and is
    kept out of the batch; one that its first token finishes otherwise (EOS) is in the round
    already queued: its lane there is discarded and its rows are released after that round's
    readback, as for a request that finished in a round.
    """

    def __init__(self, worker: Worker, prompts, max_new_tokens, prefill_batch, take_first,
                 defer: bool = False):
        worker.check_requests(prompts, max_new_tokens)      # all of them, before any is admitted
        self.worker, self.prefill_batch, self.take_first = worker, prefill_batch, take_first
        self.defer = defer
        self.queue = list(zip(range(len(prompts)), prompts, max_new_tokens))
        self.reqs: list[Request] = []
        self.unread: list[tuple[list[Request], Readback]] = []   # deferred first tokens

    @property
    def waiting(self) -> bool:
        return bool(self.queue)

    def __call__(self, active: list[Request], st: LoopState | None):
        n = min(len(self.queue), self.worker.rows.n_free)
        if n == 0:
            return active, st
        batch, self.queue = self.queue[:n], self.queue[n:]
        rids, prompts, news = zip(*batch)
        w = self.worker
        new = w._admit(list(prompts), list(news), rids=list(rids))
        self.reqs.extend(new)
        new_st, rb = self.prefill_batch(new)
        if self.defer and st is not None and active:
            self.unread.append((new, rb))
            new_active, new_st = w._drop_done(new, new_st, gone=_sure_to_finish)
        else:                   # read now: emit, release the finished ones, drop their rows
            for r, v in zip(new, _lanes(rb.wait())):
                self.take_first(r, v)
            new_active, new_st = w.retire(new, new_st)
        if not new_active:
            return active, st
        if st is None or not active:
            return new_active, new_st
        return active + new_active, st.concat(new_st)

    def read_first(self) -> list[Request]:
        """Emit the deferred first tokens (waiting for their prefills only); the requests they
        finished, which the caller releases (at once, or after the round in flight that holds
        them) and drops from the batch."""
        finished = []
        for reqs, rb in self.unread:
            for r, v in zip(reqs, _lanes(rb.wait())):
                if self.take_first(r, v):
                    finished.append(r)
        self.unread = []
        return finished


def _lanes(values: list[list]) -> list[list]:
    """Per-lane entries of read-back tensors: [[a0, b0], [a1, b1], ...] from [[a0, a1], [b0, b1]]."""
    return [list(v) for v in zip(*values)]


def _now(worker) -> float:
    if worker.kv.req_to_token.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
