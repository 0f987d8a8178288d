"""Continuous admission: the requests not yet admitted join the running batch as rows free up."""
from __future__ import annotations

from .requests import Request, sure_to_finish
from .state import LoopState, drop_done
from .timing import Readback


class Refill:
    """Continuous admission for one generate_* call: the requests not yet admitted, in order;
    a call admits as many as there are free rows, prefills them and appends them to the running
    batch ((active, state) -> (active, state); state None: no batch yet).

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

    def __init__(self, worker, prompts, max_new_tokens, prefill_batch, take_first,
                 defer: bool = False, params=None):
        worker.check_requests(prompts, max_new_tokens)      # all of them, before any is admitted
        self.worker, self.prefill_batch, self.take_first = worker, prefill_batch, take_first
        self.defer = defer
        params = [None] * len(prompts) if params is None else params   # None: greedy
        self.queue = list(zip(range(len(prompts)), prompts, max_new_tokens, params))
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
        rids, prompts, news, params = zip(*batch)
        w = self.worker
        new = w.admit(list(prompts), list(news), rids=list(rids), sampling=list(params))
        self.reqs.extend(new)
        new_st, rb = self.prefill_batch(new)
        if self.defer and st is not None and active:
            self.unread.append((new, rb))
            new_active, new_st = drop_done(new, new_st, gone=sure_to_finish)
        else:                   # read now: emit, release the finished ones, drop their rows
            for r, v in zip(new, lanes(rb.wait())):
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
            for r, v in zip(reqs, lanes(rb.wait())):
                if self.take_first(r, v):
                    finished.append(r)
        self.unread = []
        return finished


def lanes(values: list[list]) -> list[list]:
    """Per-lane entries of read-back tensors: [[a0, b0], [a1, b1], ...] from [[a0, a1], [b0, b1]]."""
    return [list(v) for v in zip(*values)]
