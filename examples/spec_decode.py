"""EAGLE speculative decoding (and plain greedy decoding) over padgraph's four runner programs.

Every step of the loop is a call of a compiled program (backend "cuda" on a GPU, "reference" on
the CPU): draft → verify → draft-extend for EAGLE, decode for greedy. Prefill runs eagerly. The
batch shrinks as requests finish (EOS or max tokens), so raw batch sizes are odd; a finished
request's KV slots and req_to_token row go back to the allocators at once.

Per-request KV: a request owns one req_to_token row and, from admission, the slots for its whole
budget (prompt + max_new_tokens + tree scratch), so draft and verify tokens use the slots of the
positions they occupy; verify commits the accepted path by permuting the row (no KV copies).
Draft position p holds (token p+1, target hidden p), so the draft cache is one position behind.

Model protocol (Llama-like and DeepSeek-like targets alike): `forward_decode / forward_extend /
forward_verify` return `(logits, hidden)` and read their cache from `kv` (`kv.k[i]`/`kv.v[i]`
K/V pools, or `kv.latent[i]` MLA latent rows); a target with `new_cache(n_layers, n_slots,
max_context, n_req_rows)` allocates its own cache (an object with `req_to_token` and `state()`,
the bound tensors by state name), otherwise K/V pools of its `cfg` are used. Draft heads:
`forward_extend`, `forward_draft_step`, `topk` (a `models.draft_head.DraftHead`: EagleHead,
MTPHead).

Between calls the loop keeps one row per active request in a `SpecState` (or `GreedyState`);
`select(keep)` drops the finished ones. `RunStats.phases` says where the time went (`PhaseClock`:
CUDA events on a GPU, so timing adds no host synchronisation).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace

import torch
from torch import Tensor

import padgraph as pg
from padgraph.backends.triton import eagle as ops
from padgraph.backends.triton.kv import KVCache, RowAllocator, SlotAllocator
from padgraph.runners import (decode_program, draft_extend_program, draft_program,
                              verify_program)


@dataclass(frozen=True)
class SpecConfig:
    steps: int = 4          # draft depth (steps - 1 draft forwards)
    topk: int = 4           # expansion width per step
    num_draft_tokens: int = 8   # k: tree nodes verified per request, root included

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


_CACHE_NAMES = {"k_cache": "k", "v_cache": "v", "latent_cache": "latent"}   # state -> kv.<attr>


def _kv(x):
    """The bound caches as the models read them (`kv.k`, `kv.v` or `kv.latent`)."""
    return SimpleNamespace(**{attr: getattr(x, name) for name, attr in _CACHE_NAMES.items()
                              if hasattr(x, name)})


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


def verify_body(target, spec: SpecConfig):
    k, steps = spec.num_draft_tokens, spec.steps

    def body(x):
        bs = x.bucket
        logits, hidden = target.forward_verify(
            x.input_ids, x.positions, _kv(x), x.req_to_token, x.req_pool_indices,
            x.seq_lens + k, x.tree_mask, x.out_cache_loc)           # [bs*k, V], [bs*k, H]
        predict = logits.argmax(-1).view(bs, k)
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


def draft_extend_body(head, spec: SpecConfig):
    steps, topk = spec.steps, spec.topk

    def body(x):
        h = head.forward_extend(x.input_ids, x.hidden_states, x.positions, _kv(x),
                                x.req_to_token, x.req_pool_indices, x.seq_lens, x.qo_indptr,
                                x.out_cache_loc)                     # [tokens, H]
        last = (x.qo_indptr[:-1] + x.accept_lens - 1).clamp(0, h.shape[0] - 1).long()
        h_last = h[last]                                             # [bs, H]
        p, idx = head.topk(h_last, topk)
        loc = ops.assign_cache_locs(x.req_to_token, x.req_pool_indices, x.seq_lens,
                                    steps * topk)
        return {"topk_p": p, "topk_index": idx, "next_hidden": h_last,
                "draft_out_cache_loc": loc}
    return body


# ---------------------------------------------------------------------------------- programs

def programs(cfg, spec: SpecConfig, hidden_dtype, buckets=None,
             cache_names=("k_cache", "v_cache")) -> dict[str, pg.Program]:
    """The four runner programs with this model's outputs and cache state names."""
    H, k, S, topk = cfg.hidden_size, spec.num_draft_tokens, spec.steps, spec.topk
    O = pg.Output
    state = {**{n: pg.State(sink=0) for n in cache_names}, "req_to_token": pg.State(sink=0)}
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


def _blocks(t: Tensor, bs: int, keep: Tensor) -> Tensor:
    return t.reshape(bs, -1)[keep].reshape(-1, *t.shape[1:])


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
    """The batch's prompts packed request after request (prefill runs eagerly)."""
    ids: Tensor           # [n_tok] int64
    positions: Tensor     # [n_tok] int64
    rows: Tensor          # [bs] int32 req_to_token rows
    seq_lens: Tensor      # [bs] int32 prompt lengths
    qo: Tensor            # [bs + 1] int32 request r's tokens are ids[qo[r]:qo[r+1]]
    loc: Tensor           # [n_tok] int64 KV slots


def pack_prompts(reqs, req_to_token: Tensor) -> PrefillBatch:
    """The requests' prompts with the slots their rows got at admission."""
    dev = req_to_token.device
    lens = [len(r.prompt) for r in reqs]
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    rows = torch.tensor([r.row for r in reqs], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    loc = req_to_token[rows.long().repeat_interleave(seq_lens.long()), positions].long()
    return PrefillBatch(
        ids=torch.tensor([t for r in reqs for t in r.prompt], device=dev), positions=positions,
        rows=rows, seq_lens=seq_lens, loc=loc,
        qo=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=dev))


# -------------------------------------------------------------------------------- timing

def to_host(*tensors) -> list[list]:
    """Device → host lists with one synchronisation (the loop's only one per step)."""
    if tensors[0].is_cuda:
        outs = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream().synchronize()
    else:
        outs = [t.cpu() for t in tensors]
    return [o.tolist() for o in outs]


class PhaseClock:
    """Time per phase of a loop: `mark(phase)` ends the interval since the previous mark and
    charges it to `phase`.

    On a GPU a mark records a CUDA event on the current stream and nothing waits for it: the
    intervals are the stream's timeline, so a phase includes any wait for the host to launch it
    and the phases of a run add up to its wall time. `totals()` reads them once the run has
    synchronised. On the CPU a mark reads perf_counter (the work is synchronous).
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
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0            # verify rounds (EAGLE) or decode steps (greedy)
    accepted: int = 0          # tokens emitted by verify rounds (accept lengths summed)
    request_rounds: int = 0    # request-rounds, for the mean accept length
    phases: dict[str, float] = field(default_factory=dict)   # seconds: prefill, draft, verify,
    #                            draft_extend, host (EAGLE) or prefill, decode, host (greedy)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept_len(self) -> float:
        return self.accepted / self.request_rounds if self.request_rounds else 0.0

    @property
    def round_seconds(self) -> float:
        """Mean time of one round (EAGLE) or step (greedy): the phases after prefill."""
        loop = sum(t for name, t in self.phases.items() if name != "prefill")
        return loop / self.rounds if self.rounds else 0.0


# ------------------------------------------------------------------------------------ worker

class Worker:
    """Serves one batch of requests with EAGLE (`generate_spec`) or greedy (`generate_greedy`).

    backend: "cuda" | "reference"; runners are compiled on first use and kept, so repeated
    calls replay the same graphs.
    """

    def __init__(self, target, head, spec: SpecConfig, *, backend: str = "reference",
                 max_bs: int = 16, max_context: int = 512, eos_id: int | None = None,
                 buckets=None, compile_options: dict | None = None):
        p = target.lm_head.weight
        self.target, self.head, self.spec, self.eos_id = target, head, spec, eos_id
        self.backend, self.max_bs, self.max_context = backend, max_bs, max_context
        self.margin = max(spec.num_draft_tokens, spec.steps * spec.topk) + 1
        n_slots = max_bs * max_context + 1
        self.kv = new_cache(target, target.cfg.n_layers, n_slots, max_context, max_bs + 1)
        self.dkv = new_cache(target, 1, n_slots, 2, 2)   # the head's layer; rows: self.kv's
        self.slots, self.rows = SlotAllocator(n_slots), RowAllocator(max_bs + 1)
        self.programs = programs(target.cfg, spec, p.dtype, buckets or pg.Buckets.default(max_bs),
                                 cache_names=tuple(cache_state(self.kv)))
        self.bodies = bodies(target, head, spec) if head is not None else {
            "decode": decode_body(target)}
        self.compile_options = compile_options or {}
        self._runners: dict = {}

    def state(self, name: str) -> dict:
        kv = self.kv if name in ("decode", "verify") else self.dkv
        return {**cache_state(kv), "req_to_token": self.kv.req_to_token}

    def runner(self, name: str):
        if name not in self._runners:
            self._runners[name] = pg.compile(self.programs[name], self.bodies[name],
                                             self.backend, state=self.state(name),
                                             **self.compile_options)
        return self._runners[name]

    # ---- request lifecycle -------------------------------------------------------------
    def admit(self, prompts, max_new_tokens) -> list[Request]:
        if len(prompts) > self.max_bs:
            raise ValueError(f"at most max_bs={self.max_bs} requests per batch; got {len(prompts)}")
        reqs = []
        for i, (prompt, n_new) in enumerate(zip(prompts, max_new_tokens)):
            need = len(prompt) + n_new + self.margin
            if need > self.max_context:
                raise ValueError(f"request {i}: prompt {len(prompt)} + max_new_tokens {n_new} + "
                                 f"tree margin {self.margin} must fit max_context "
                                 f"{self.max_context}")
            r = Request(i, list(prompt), n_new, row=self.rows.alloc(1)[0],
                        slots=self.slots.alloc(need))
            self.kv.req_to_token[r.row, :need] = torch.tensor(r.slots, dtype=torch.int32)
            reqs.append(r)
        return reqs

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

    def retire(self, active: list[Request], st: LoopState, new_tokens):
        """Emit each request's tokens; release the finished ones and drop their rows of `st`."""
        done = [self.emit(r, t) for r, t in zip(active, new_tokens)]
        if not any(done):
            return active, st
        for r in (r for r, d in zip(active, done) if d):
            self.release(r)
        keep = [i for i, d in enumerate(done) if not d]
        idx = torch.tensor(keep, dtype=torch.long, pin_memory=st.rows.is_cuda).to(st.rows.device, non_blocking=True)
        return [active[i] for i in keep], st.select(idx)

    # ---- prefill (eager) ---------------------------------------------------------------
    def prefill(self, reqs):
        """Target extend over the prompts; (last logits [bs, V], hidden, PrefillBatch)."""
        b = pack_prompts(reqs, self.kv.req_to_token)
        logits, hidden = self.target.forward_extend(b.ids, b.positions, self.kv,
                                                    self.kv.req_to_token, b.rows, b.seq_lens,
                                                    b.qo, b.loc)
        return logits, hidden, b

    def draft_prefill(self, first, hidden, b: PrefillBatch) -> SpecState:
        """The head over (prompt[1:] + first token, target hidden): the first draft inputs."""
        last = (b.qo[1:] - 1).long()
        shifted = torch.cat([b.ids[1:], b.ids[:1]])
        shifted[last] = first
        h = self.head.forward_extend(shifted, hidden, b.positions, self.dkv,
                                     self.kv.req_to_token, b.rows, b.seq_lens, b.qo, b.loc)
        p, idx = self.head.topk(h[last], self.spec.topk)
        loc = ops.assign_cache_locs(self.kv.req_to_token, b.rows, b.seq_lens,
                                    self.spec.steps * self.spec.topk)
        return SpecState(rows=b.rows, seq_lens=b.seq_lens, verified_id=first, topk_p=p,
                         topk_index=idx, hidden=h[last], draft_loc=loc)

    # ---- EAGLE -------------------------------------------------------------------------
    def spec_round(self, st: SpecState, clock: PhaseClock):
        """draft → verify → draft-extend for the batch in `st`; (next state, accept lengths,
        tokens [bs, steps + 1] of which each request's first accept-length are its output)."""
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
        acc, toks = to_host(v.accept_len, v.out_tokens)   # the round's one readback, after it is queued
        clock.mark("host")
        nxt = SpecState(rows=st.rows, seq_lens=v.de_seq_lens, verified_id=v.bonus,
                        topk_p=e.topk_p, topk_index=e.topk_index, hidden=e.next_hidden,
                        draft_loc=e.draft_out_cache_loc)
        return nxt, acc, toks

    def generate_spec(self, prompts, max_new_tokens) -> tuple[list[Request], RunStats]:
        stats, t0 = RunStats(), _now(self)
        clock = PhaseClock(self.kv.req_to_token.is_cuda)
        reqs = self.admit(prompts, max_new_tokens)
        logits, hidden, b = self.prefill(reqs)
        first = logits.argmax(-1)
        st = self.draft_prefill(first, hidden, b)
        active, st = self.retire(reqs, st, [[t] for t in to_host(first)[0]])
        clock.mark("prefill")
        while active:
            st, acc, toks = self.spec_round(st, clock)
            stats.rounds += 1
            stats.accepted += sum(acc)
            stats.request_rounds += len(acc)
            active, st = self.retire(active, st, [t[:a] for t, a in zip(toks, acc)])
            clock.mark("host")
        return reqs, self._finish(stats, t0, clock, reqs)

    # ---- greedy ------------------------------------------------------------------------
    def generate_greedy(self, prompts, max_new_tokens) -> tuple[list[Request], RunStats]:
        stats, t0 = RunStats(), _now(self)
        clock = PhaseClock(self.kv.req_to_token.is_cuda)
        reqs = self.admit(prompts, max_new_tokens)
        logits, _, b = self.prefill(reqs)
        first, top2 = logits.argmax(-1), logits.topk(2, dim=-1).values
        st = GreedyState(rows=b.rows, seq_lens=b.seq_lens, cur=first)
        toks, gaps = to_host(first, top2[:, 0] - top2[:, 1])
        for r, g in zip(reqs, gaps):
            r.gaps = [g]
        active, st = self.retire(reqs, st, [[t] for t in toks])
        clock.mark("prefill")
        decode, rt = self.runner("decode"), self.kv.req_to_token
        while active:
            s1 = st.seq_lens + 1
            out = decode(input_ids=st.cur, positions=st.seq_lens.long(), seq_lens=s1,
                         req_pool_indices=st.rows,
                         out_cache_loc=ops.assign_cache_locs(rt, st.rows, st.seq_lens, 1))
            clock.mark("decode")
            toks, gaps = to_host(out.next_token, out.top2_gap)
            for r, g in zip(active, gaps):
                r.gaps.append(g)
            stats.rounds += 1
            active, st = self.retire(active, GreedyState(st.rows, s1, out.next_token),
                                     [[t] for t in toks])
            clock.mark("host")
        return reqs, self._finish(stats, t0, clock, reqs)

    def _finish(self, stats: RunStats, t0: float, clock: PhaseClock, reqs) -> RunStats:
        stats.seconds = _now(self) - t0
        stats.phases = clock.totals()
        stats.tokens = sum(len(r.output) for r in reqs)
        return stats


def _now(worker) -> float:
    if worker.kv.req_to_token.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
