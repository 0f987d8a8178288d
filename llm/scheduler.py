"""The scheduler: requests, admission and the overlap loop over a `Worker`'s rounds.

`Engine` is a `Worker` that serves requests: EAGLE speculative decoding (`generate_spec`: draft →
verify → draft-extend a round) or plain decoding (`generate_greedy`: one decode step a round),
each request greedy or sampled by its own `SamplingParams` (`sampling=`; greedy and sampled
requests share one batch and one graph). The batch shrinks as requests finish (EOS, a stop token
or max tokens), so raw batch sizes are odd; a finished
request's KV slots and req_to_token row go back to the allocators once no round in flight uses
them. Given more requests than max_bs, the rest wait and are admitted as rows free up
(continuous admission, `Refill`: each admission is prefilled and appended to the running batch
before the next round is queued, with no host synchronisation when overlapped: its first tokens
are read back after that round is queued).

Between calls the loop keeps one row per active request in a `SpecState` (or `GreedyState`);
`select(keep)` drops the finished ones. `RunStats.phases` says where the time went (`PhaseClock`:
CUDA events on a GPU, so timing adds no host synchronisation).

Overlap scheduling (`Engine(..., overlap=True)`, the default): a round needs nothing from the
host, only the previous round's device-side state, so round N+1 is queued before round N's
results are read. After queuing a round the loop starts a non-blocking copy of its accept
lengths and tokens (greedy: next tokens and top-2 gaps) into pinned host memory and records an
event (`Readback`); it then queues the next round, and only then waits for the previous round's
event and processes its results (emit, detect finished requests). A request that finishes in
round N has already been queued into round N+1: that lane's results are discarded, its rows
are dropped before round N+2 is queued, and its KV is released once round N+1 has been read
back (`Engine._loop`); a request sure to finish in the round in flight (one token left) is kept
out of the next round instead. The run is the same token for token as without overlap; with
at most max_bs requests it costs at most one trailing round (`RunStats.rounds` counts it) and
at most one discarded lane-round per request (none for a finish foreseen: greedy without EOS
runs none). Tail sync (`Engine(tail_sync=True)`, the default): when every running request may
finish in the round in flight (its budget left is at most what one round can emit), the loop
reads that round back before queuing the next instead of queuing a round that may be discarded
whole: at the end of a batch it costs a host round trip (the GPU waits for the host's next
launches) instead of a whole trailing round. With more requests (continuous admission) a row
freed by a finish found one round late is handed out one round later too, so a queued request
can start later and the run can take a few more rounds than without overlap.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

import padgraph as pg

from .admission import Refill
from .requests import (Request, budget, may_finish, prompt_ids, request_seed, sampling_of,
                       sure_to_finish)
from .state import GreedyState, LoopState, SamplingLanes, drop_done, to_device
from .timing import PhaseClock, Readback, RunStats
from .worker import Worker


@dataclass
class Rounds:
    """What `Engine._loop` runs: `step(state) -> (next state, Readback)` queues a round;
    `consume(req, values) -> finished` takes one real lane's results; the run's stats and
    clock; whether rounds overlap; the most tokens one round emits per request."""
    step: Callable
    consume: Callable
    stats: RunStats
    clock: PhaseClock
    overlap: bool
    max_emit: int = 1


@dataclass
class Flight:
    """The loop's rounds in flight: the queued round not yet read back ((lanes, Readback) or
    None) and the requests finished but still in that round's batch (released at its readback)."""
    pending: tuple | None = None
    late: list = field(default_factory=list)


class Engine(Worker):
    """A `Worker` that serves requests: admission, release, and the (overlapped) loop of rounds.
    Takes `Worker`'s arguments."""

    # ---- request lifecycle -------------------------------------------------------------
    def resolve(self, prompts, max_new_tokens=None, sampling=None):
        """A call's per-request (budgets, SamplingParams): `sampling` is None (greedy), one
        `SamplingParams` for all or one per request; `max_new_tokens` a list (one per request)
        or None, which takes each request's `SamplingParams.max_new_tokens`."""
        params = sampling_of(len(prompts), sampling)
        hot = [i for i, p in enumerate(params) if not p.greedy]
        if hot and not self.sampling:
            raise pg.ContractValueError(
                f"requests {hot} sample (temperature {params[hot[0]].temperature}) but the "
                f"engine was built with sampling=False: it serves greedy requests only")
        if max_new_tokens is None:
            max_new_tokens = [p.max_new_tokens for p in params]
        return list(max_new_tokens), params

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

    def admit(self, prompts, max_new_tokens=None, rids=None, sampling=None) -> list[Request]:
        """Rows and KV slots for these requests (ids `rids`, default 0, 1, ...; `sampling` and
        `max_new_tokens` as `resolve` takes them)."""
        news, params = self.resolve(prompts, max_new_tokens, sampling)
        self.check_requests(prompts, news)
        return self._admit(prompts, news, rids, params)

    def _admit(self, prompts, max_new_tokens, rids=None, params=None) -> list[Request]:
        """`admit` for requests `check_requests` has passed (params: one SamplingParams each,
        None: greedy)."""
        if len(prompts) > self.rows.n_free:
            raise ValueError(f"{len(prompts)} requests but {self.rows.n_free} free rows "
                             f"(max_bs={self.max_bs} running at once)")
        reqs = []
        rids = range(len(prompts)) if rids is None else rids
        params = sampling_of(len(prompts), params)
        try:
            for i, prompt, n_new, p in zip(rids, prompts, max_new_tokens, params):
                need = len(prompt) + n_new + self.margin
                if self.overlap:     # room for the extra round, as far as max_context allows
                    need = min(need + self.overlap_margin, self.max_context)
                r = Request(i, [int(t) for t in prompt], int(n_new), row=self.rows.alloc(1)[0],
                            params=p, seed=request_seed(self.seed, i) if p.seed is None else p.seed)
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

    def lanes(self, reqs) -> SamplingLanes:
        """The requests' sampling lanes on the worker's device (no host sync)."""
        return SamplingLanes.of([r.params for r in reqs], [r.seed for r in reqs],
                                self.kv.req_to_token.device)

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
        """Append tokens up to EOS, one of the request's stop tokens (each emitted, as HF emits
        its EOS) or max_new_tokens; True when the request finished."""
        for t in tokens:
            req.output.append(t)
            if t == self.eos_id or req.stops_at(t) or len(req.output) >= req.max_new_tokens:
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

    _drop_done = staticmethod(drop_done)

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self, active: list[Request], st: LoopState, rounds: Rounds,
              refill: Refill | None = None) -> None:
        """Run rounds until every request has finished (and, with `refill`, every queued one
        has been admitted and finished).

        rounds.step(st) queues one round for st's batch, starts its `Readback` and returns (the state
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
        through pinned buffers; `Refill`): its first tokens are read once the next round is
        queued, beside round N's results, and a request its first token finishes (EOS) is
        retired one round late like any other.
        """
        rounds.stats.overlap = rounds.overlap
        flight = Flight()
        while active or flight.pending or (refill is not None and refill.waiting):
            self._check_progress(active, flight, refill)
            sync_first = self._sync_first(active, flight, rounds)
            kept_out = []
            if active and rounds.overlap and flight.pending is not None and not sync_first:  # N in flight
                kept_out = [r for r in active if sure_to_finish(r)]
                active, st = drop_done(active, st, gone=sure_to_finish)
            if refill is not None and refill.waiting and not sync_first:   # after kept_out
                active, st = refill(active, st)
            launched = None
            if active and not sync_first:
                st, launched = self._queue(active, st, rounds)
            if not rounds.overlap:
                flight.pending, launched = launched, None
            finished = self._read_back(flight, rounds, kept_out)
            if refill is not None and refill.unread:  # admitted before round N+1 was queued
                finished += refill.read_first()       # those their first token finished (EOS)
            if finished:
                active, st = self._retire_finished(active, st, finished, launched, flight)
            rounds.clock.mark("host")
            flight.pending = launched

    def _check_progress(self, active, flight: Flight, refill) -> None:
        if not active and flight.pending is None and self.rows.n_free == 0:
            raise RuntimeError(
                f"{len(refill.queue)} requests wait for a row but none of the "
                f"{self.rows.n - 1} is free and none is running: rows admitted outside this "
                f"call (Engine.admit) must be released first")

    def _sync_first(self, active, flight: Flight, rounds: Rounds) -> bool:
        """Round N may finish every running request: read it back before queuing N+1."""
        return (self.tail_sync and rounds.overlap and flight.pending is not None and bool(active)
                and all(may_finish(r, rounds.max_emit) for r in active))

    @staticmethod
    def _queue(active, st, rounds: Rounds):
        """Queue round N+1 from round N's state on the device: (its output state, (lanes, Readback))."""
        st, rb = rounds.step(st)
        rounds.stats.rounds += 1
        return st, (active, rb)

    def _read_back(self, flight: Flight, rounds: Rounds, kept_out) -> list[Request]:
        """Wait for round N's results (round N+1 runs meanwhile), consume its live lanes and
        release the requests whose last round it was: the requests it finished."""
        if flight.pending is None:
            return []
        lanes, rb = flight.pending
        finished = []
        for r, *values in zip(lanes, *rb.wait()):
            if r.done:          # finished in round N-1: this lane ran for nothing
                rounds.stats.discarded += 1
            elif rounds.consume(r, values):
                finished.append(r)
        for r in flight.late:   # their last round, N, is read back: release them
            self.release(r)
        flight.late = []
        for r in kept_out:      # kept out of round N+1 as sure to finish in round N
            if not r.done:
                raise RuntimeError(f"request {r.rid} was kept out of the next round as "
                                   f"sure to finish, but did not finish")
        return finished

    def _retire_finished(self, active, st, finished, launched, flight: Flight):
        """Release the finished requests no round in flight holds; the others once round N+1
        is read back (`flight.late`). Their rows leave the batch before round N+2 is queued."""
        in_flight = {id(r) for r in launched[0]} if launched is not None else set()
        for r in finished:
            if id(r) in in_flight:
                flight.late.append(r)
            else:               # no round in flight holds them (or kept out of N+1)
                self.release(r)
        return drop_done(active, st)

    # ---- prefill (eager, or the "prefill" runner) ---------------------------------------

    def generate_spec(self, prompts, max_new_tokens=None, sampling=None
                      ) -> tuple[list[Request], RunStats]:
        """EAGLE over the requests: up to max_bs run at once; past that the rest wait and are
        admitted as rows free up (continuous admission). (Requests in prompt order, stats.)
        sampling: None (greedy), a `SamplingParams` for every request or one per request; the
        emitted tokens follow the target's sampling distribution exactly (see `bodies`).
        max_new_tokens: one per request, or None for each request's params' budget."""
        stats, t0 = RunStats(), _now(self)
        clock = PhaseClock(self.kv.req_to_token.is_cuda)
        max_new_tokens, params = self.resolve(prompts, max_new_tokens, sampling)

        def prefill_batch(reqs):
            logits, hidden, b = self.prefill(reqs)
            lanes = self.lanes(reqs)
            first = self.first_tokens(logits, lanes, b)
            st = self.draft_prefill(first, hidden, b, lanes)
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
        refill = Refill(self, prompts, max_new_tokens, prefill_batch, take_first,
                        defer=overlap, params=params)                # checks them all
        with self._abandon_on_error(refill):
            active, st = refill([], None)
            rounds = Rounds(lambda s: self.spec_round(s, clock), consume, stats, clock, overlap,
                            max_emit=self.spec.steps + 1)
            self._loop(active, st, rounds, refill)
        return refill.reqs, self._finish(stats, t0, clock, refill.reqs)

    def generate_greedy(self, prompts, max_new_tokens=None, sampling=None
                        ) -> tuple[list[Request], RunStats]:
        """Plain decoding (one token a step) over the requests, admitted as `generate_spec`
        admits them; greedy unless `sampling` says otherwise (taken as `generate_spec` takes
        it)."""
        stats, t0 = RunStats(), _now(self)
        clock = PhaseClock(self.kv.req_to_token.is_cuda)
        max_new_tokens, params = self.resolve(prompts, max_new_tokens, sampling)

        def prefill_batch(reqs):
            logits, _, b = self.prefill(reqs)
            lanes = self.lanes(reqs)
            first, top2 = self.first_tokens(logits, lanes, b), logits.topk(2, dim=-1).values
            st = GreedyState(rows=b.rows, seq_lens=b.seq_lens, cur=first, sampling=lanes)
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
        refill = Refill(self, prompts, max_new_tokens, prefill_batch, take_first,
                        defer=self.overlap, params=params)            # checks them all
        with self._abandon_on_error(refill):
            active, st = refill([], None)
            rounds = Rounds(lambda s: self.decode_step(s, clock), consume, stats, clock,
                            self.overlap)
            self._loop(active, st, rounds, refill)
        return refill.reqs, self._finish(stats, t0, clock, refill.reqs)

    @contextlib.contextmanager
    def _abandon_on_error(self, refill: Refill):
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


def _now(worker) -> float:
    if worker.kv.req_to_token.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
