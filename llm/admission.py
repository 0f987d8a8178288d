"""Admission: the request pool (which request holds which of a worker's rows and KV slots) and
continuous admission (the requests not yet admitted join the running batch as rows free up)."""
from __future__ import annotations

import padgraph as pg

from .kv import RowAllocator, SlotAllocator
from .requests import Request, budget, prompt_ids, request_seed, sampling_of, sure_to_finish
from .state import LoopState, drop_done, to_device
from .timing import Readback


class RequestPool:
    """The requests holding a worker's rows: `admit` gives each request its own req_to_token
    row and, from admission, the KV slots of its whole reservation (`SpecConfig.reservation` of
    prompt + max_new_tokens, with the overlap margin where max_context has room for it);
    `release` gives them back and zeroes the row. Host-side free lists (`rows`, `slots`); the
    only device write is the admitted rows of the worker's req_to_token.

    The pool never checks whether a round in flight still uses a row: the engine releases a
    request only once every round that used it has been read back."""

    def __init__(self, worker):
        self.worker = worker
        self.slots, self.rows = SlotAllocator(worker.n_slots), RowAllocator(worker.n_rows)

    @property
    def n_free(self) -> int:
        """Requests that can be admitted now (free rows)."""
        return self.rows.n_free

    def check(self, prompts, max_new_tokens, params=None) -> None:
        """Each request may be served: sampled only where the worker samples, a non-empty prompt
        of token ids in [0, vocab), max_new_tokens >= 1 (an int), and a reservation that fits
        max_context and the target's and draft head's max_position (their rotary tables). params: one SamplingParams per request (None entries, or None: greedy)."""
        w = self.worker
        self.check_sampling(sampling_of(len(prompts), params))
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        # positions past a model's rotary table (its max_position) would index past it: on a GPU
        # inside a graph, a device assert or another position's angles
        what, limit = "max_context", w.max_context
        for name, model in (("target", w.target), ("draft head", w.head)):
            cap = getattr(getattr(model, "cfg", None), "max_position", None)
            if cap is not None and cap < limit:
                what, limit = f"the {name}'s max_position", cap
        for i, (prompt, n_new) in enumerate(zip(prompts, max_new_tokens)):
            n_new = budget(i, n_new)
            prompt_ids(i, prompt, w.target.cfg.vocab_size)
            if w.spec.reservation(len(prompt) + n_new) > limit:
                raise ValueError(f"request {i}: prompt {len(prompt)} + max_new_tokens {n_new} + "
                                 f"tree margin {w.spec.margin} must fit {what} {limit}")

    def check_sampling(self, params) -> None:
        """Sampled requests (params: one SamplingParams each) only where the worker samples."""
        hot = [i for i, p in enumerate(params) if not p.greedy]
        if hot and not self.worker.opts.sampling:
            raise pg.ContractValueError(
                f"requests {hot} sample (temperature {params[hot[0]].temperature}) but the "
                f"engine was built with sampling=False: it serves greedy requests only")

    def admit(self, prompts, max_new_tokens, rids=None, params=None) -> list[Request]:
        """Rows and KV slots for these requests (`check`ed first; all or none are admitted).
        rids: their ids (default 0, 1, ...); params: one SamplingParams each (None: greedy); a
        request whose params give no seed draws from `request_seed(seed option, rid)`."""
        self.check(prompts, max_new_tokens, params)
        if len(prompts) > self.rows.n_free:
            raise ValueError(f"{len(prompts)} requests but {self.rows.n_free} free rows "
                             f"(max_bs={self.worker.max_bs} running at once)")
        rids = range(len(prompts)) if rids is None else rids
        reqs = []
        try:
            for i, prompt, n_new, p in zip(rids, prompts, max_new_tokens,
                                           sampling_of(len(prompts), params)):
                r = Request(i, [int(t) for t in prompt], int(n_new), row=self.rows.alloc(1)[0],
                            params=p, seed=self._seed(i, p))
                reqs.append(r)
                self._reserve(r)
        except BaseException:       # none of this batch stays held
            for r in reqs:
                if r.slots:
                    self.release(r)
                else:
                    self.rows.free([r.row])
            raise
        return reqs

    def _seed(self, rid: int, p) -> int:
        return request_seed(self.worker.opts.seed, rid) if p.seed is None else p.seed

    def _reserve(self, r: Request) -> None:
        """Slots for r's reservation (the overlap margin as far as max_context allows), written
        to its req_to_token row."""
        w = self.worker
        need = min(w.spec.reservation(len(r.prompt) + r.max_new_tokens, w.opts.overlap),
                   w.max_context)
        r.slots = self.slots.alloc(need)
        rt = w.kv.req_to_token
        rt[r.row, :need] = to_device(r.slots, rt.dtype, rt.device)

    def release(self, req: Request) -> None:
        """Give back req's row and slots (its req_to_token row zeroed: every position the sink)."""
        self.worker.kv.req_to_token[req.row].zero_()
        self.slots.free(req.slots)
        self.rows.free([req.row])
        req.slots, req.row = [], 0


class Refill:
    """Continuous admission for one generate_* call: the requests not yet admitted, in order;
    a call admits as many as the pool has free rows, prefills them and appends them to the
    running batch ((active, state) -> (active, state); state None: no batch yet).

    params: each request's SamplingParams (None: greedy).
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

    def __init__(self, pool: RequestPool, prompts, max_new_tokens, prefill_batch, take_first,
                 defer: bool = False, params=None):
        pool.check(prompts, max_new_tokens, params)      # all of them, before any is admitted
        self.pool, self.prefill_batch, self.take_first = pool, prefill_batch, take_first
        self.defer = defer
        params = [None] * len(prompts) if params is None else params   # None: greedy
        self.queue = list(zip(range(len(prompts)), prompts, max_new_tokens, params))
        self.reqs: list[Request] = []
        self.unread: list[tuple[list[Request], Readback]] = []   # deferred first tokens

    @property
    def waiting(self) -> bool:
        return bool(self.queue)

    def __call__(self, active: list[Request], st: LoopState | None):
        n = min(len(self.queue), self.pool.n_free)
        if n == 0:
            return active, st
        batch, self.queue = self.queue[:n], self.queue[n:]
        rids, prompts, news, params = zip(*batch)
        new = self.pool.admit(list(prompts), list(news), rids=list(rids), params=list(params))
        self.reqs.extend(new)
        new_st, rb = self.prefill_batch(new)
        if self.defer and st is not None and active:
            self.unread.append((new, rb))
            new_active, new_st = drop_done(new, new_st, gone=sure_to_finish)
        else:                   # read now: emit, release the finished ones, drop their rows
            for r, v in zip(new, lanes(rb.wait())):
                self.take_first(r, v)
            for r in (r for r in new if r.done):
                self.pool.release(r)
            new_active, new_st = drop_done(new, new_st)
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
            for r, v in zip(reqs, lanes(rb.wait())):
                if self.take_first(r, v):
                    finished.append(r)
        self.unread = []
        return finished


def lanes(values: list[list]) -> list[list]:
    """Per-lane entries of read-back tensors: [[a0, b0], [a1, b1], ...] from [[a0, a1], [b0, b1]]."""
    return [list(v) for v in zip(*values)]
