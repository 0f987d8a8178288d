"""The engine: requests, admission and the overlap loop over the rounds of the `Worker` it holds.

`Engine` serves requests on a worker (`engine.worker`: runners, caches and rounds) with a
`RequestPool` (`engine.pool`: which request holds which row and slots; public `admit` /
`release`): EAGLE speculative decoding (`generate_spec`: draft → verify → draft-extend a round)
or plain decoding (`generate_greedy`: one decode step a round), each request greedy or sampled
by its own `SamplingParams` (`sampling=`; greedy and sampled requests share one batch and one
graph). The batch shrinks as requests finish (EOS, a stop token or max tokens), so raw batch
sizes are odd; a finished request's KV slots and req_to_token row go back to the pool once no
round in flight uses them. Given more requests than max_bs, the rest wait and are admitted as
rows free up (continuous admission, `Refill`: each admission is prefilled and appended to the
running batch before the next round is queued, with no host synchronisation when overlapped:
its first tokens are read back after that round is queued).

Between calls the loop keeps one row per active request in a `SpecState` (or `GreedyState`);
`select(keep)` drops the finished ones. `RunStats.phases` says where the time went (`PhaseClock`:
CUDA events on a GPU, so timing adds no host synchronisation).

One pass of the loop (`Engine._loop`): unless tail sync reads the round in flight back first,
the batch loses the requests sure to finish in that round and takes admissions
(`_next_batch`), and the next round is queued (`_queue`); then a round is read back (`_read_back`:
emit, detect finished requests) and the finished requests are retired (`_retire`).

Overlap scheduling (`Engine(..., overlap=True)`, the default): a round needs nothing from the
host, only the previous round's device-side state, so round N+1 is queued before round N's
results are read. After queuing a round the loop starts a non-blocking copy of its accept
lengths and tokens (greedy: next tokens and top-2 gaps) into pinned host memory and records an
event (`Readback`); it then queues the next round, and only then waits for the previous round's
event and processes its results. A request that finishes in round N has already been queued into
round N+1: that lane's results are discarded, its rows are dropped before round N+2 is queued,
and its KV is released once round N+1 has been read back (late release, `Flight.late`); a
request sure to finish in the round in flight (one token left) is kept out of the next round
instead. The run is the same token for token as without overlap; with at most max_bs requests
it costs at most one trailing round (`RunStats.rounds` counts it) and at most one discarded
lane-round per request (none for a finish foreseen: greedy without EOS runs none). Tail sync
(`Engine(tail_sync=True)`, the default): when every running request may finish in the round in
flight (its budget left is at most what one round can emit), the loop reads that round back
before queuing the next instead of queuing a round that may be discarded whole: at the end of a
batch it costs a host round trip (the GPU waits for the host's next launches) instead of a whole
trailing round (greedy emits one token a step: such requests are sure to finish and kept out
anyway, so its runs do not change). With more requests (continuous admission) a row freed by a finish found one
round late is handed out one round later too, so a queued request can start later and the run
can take a few more rounds than without overlap.

Why late release is safe: all rounds run on one stream, in order, so when round N+1's readback
event has completed, round N+1 and everything queued before it have finished; the rows were
dropped before round N+2, so no round queued later uses them. A released row or slot is
therefore touched by no round still in flight, and a later reuse (the pool hands them to the
next admission, which writes req_to_token from the host) cannot race with one.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .admission import Refill, RequestPool
from .config import SpecConfig, WorkerOptions
from .requests import Request, may_finish, sampling_of, sure_to_finish
from .state import GreedyState, LoopState, drop_done
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
    None), the requests finished but still in that round's batch (released at its readback),
    and those kept out of the next round as sure to finish in it (checked at its readback)."""
    pending: tuple | None = None
    late: list = field(default_factory=list)
    kept_out: list = field(default_factory=list)


class Engine:
    """Serves requests on a `Worker` (`worker`) through a `RequestPool` (`pool`): admission,
    release, and the (overlapped) loop of rounds.

    Engine(target, head, spec, backend=..., **options): a new worker of these arguments
    (`options`: `WorkerOptions`' fields); `Engine.on(worker)`: an engine on a worker already
    built (`padgraph.llm.tp.TPWorker`, say)."""

    def __init__(self, target, head, spec: SpecConfig, *, backend: str = "reference", **options):
        self.worker = Worker(target, head, spec, backend=backend, **options)
        self.pool = RequestPool(self.worker)

    @classmethod
    def on(cls, worker: Worker) -> "Engine":
        """An engine serving `worker` (with a request pool of its own)."""
        engine = cls.__new__(cls)
        engine.worker, engine.pool = worker, RequestPool(worker)
        return engine

    @property
    def opts(self) -> WorkerOptions:
        """The options the engine and its worker serve with."""
        return self.worker.opts

    @property
    def max_bs(self) -> int:
        """Requests running at once (more wait for a row)."""
        return self.worker.max_bs

    @property
    def max_context(self) -> int:
        """The most positions a request reserves: prompt + max_new_tokens + tree margin fit it."""
        return self.worker.max_context

    # ---- request lifecycle -------------------------------------------------------------
    def resolve(self, prompts, max_new_tokens=None, sampling=None):
        """A call's per-request (budgets, SamplingParams): `sampling` is None (greedy), one
        `SamplingParams` for all or one per request; `max_new_tokens` a list (one per request)
        or None, which takes each request's `SamplingParams.max_new_tokens`."""
        params = sampling_of(len(prompts), sampling)
        self.pool.check_sampling(params)
        if max_new_tokens is None:
            max_new_tokens = [p.max_new_tokens for p in params]
        return list(max_new_tokens), params

    def admit(self, prompts, max_new_tokens=None, rids=None, sampling=None) -> list[Request]:
        """Rows and KV slots for these requests outside a generate call (ids `rids`, default 0,
        1, ...; `sampling` and `max_new_tokens` as `resolve` takes them): `RequestPool.admit`.
        They hold their rows until `release`d."""
        news, params = self.resolve(prompts, max_new_tokens, sampling)
        return self.pool.admit(prompts, news, rids, params)

    def release(self, req: Request) -> None:
        """Give back an admitted request's row and slots (`RequestPool.release`)."""
        self.pool.release(req)

    def spec_overlap_fits(self, prompts, max_new_tokens) -> bool:
        """Whether every request gets the positions an EAGLE round past its end touches; where
        one does not (max_context too small), the run goes without overlap (with a warning)."""
        if not self.opts.overlap:
            return False
        spec = self.worker.spec
        short = [i for i, (p, n) in enumerate(zip(prompts, max_new_tokens))
                 if spec.reservation(len(p) + n, overlap=True) > self.max_context]
        if short:
            warnings.warn(f"overlap off for this run: requests {short} lack the "
                          f"{spec.overlap_margin} positions past prompt + max_new_tokens + tree "
                          f"margin that the round after their end needs (max_context "
                          f"{self.max_context})", stacklevel=3)
        return not short

    def emit(self, req: Request, tokens) -> bool:
        """Append tokens up to EOS, one of the request's stop tokens (each emitted, as HF emits
        its EOS) or max_new_tokens; True when the request finished."""
        for t in tokens:
            req.output.append(t)
            if t == self.opts.eos_id or req.stops_at(t) or len(req.output) >= req.max_new_tokens:
                req.done = True
                break
        return req.done

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self, active: list[Request], st: LoopState, rounds: Rounds, refill: Refill) -> None:
        """Run rounds until every request has finished and every queued one has been admitted
        and finished (the contract: the module docstring). Each pass: unless tail sync reads
        round N back first, the next batch (`_next_batch`) gets round N+1 queued (`_queue`);
        then round N (overlap; round N+1 without) and the admissions' first tokens are read
        back, and the requests they finished are retired (`_retire`)."""
        rounds.stats.overlap = rounds.overlap
        flight = Flight()
        while active or flight.pending or refill.waiting:
            self._check_progress(active, flight, refill)
            queued = None
            if not self._sync_first(active, flight, rounds):
                active, st = self._next_batch(active, st, flight, rounds, refill)
                st, queued = self._queue(active, st, rounds)
            if not rounds.overlap:                # read back the round just queued
                flight.pending, queued = queued, None
            finished = self._read_back(flight, rounds)
            if refill.unread:                     # admitted before round N+1 was queued
                finished += refill.read_first()
            if finished:
                active, st = self._retire(active, st, finished, queued, flight)
            rounds.clock.mark("host")
            flight.pending = queued

    def _check_progress(self, active, flight: Flight, refill: Refill) -> None:
        if not active and flight.pending is None and self.pool.n_free == 0:
            raise RuntimeError(
                f"{len(refill.queue)} requests wait for a row but none of the "
                f"{self.max_bs} is free and none is running: rows admitted outside this "
                f"call (Engine.admit) must be released first")

    def _sync_first(self, active, flight: Flight, rounds: Rounds) -> bool:
        """Tail sync: round N may finish every running request, so read it back before queuing
        N+1 (which could be discarded whole)."""
        return (self.opts.tail_sync and rounds.overlap and flight.pending is not None
                and bool(active) and all(may_finish(r, rounds.max_emit) for r in active))

    @staticmethod
    def _next_batch(active, st, flight: Flight, rounds: Rounds, refill: Refill):
        """The batch round N+1 runs: with round N in flight, without the requests sure to finish
        in it (`flight.kept_out`: no lane of theirs is discarded, and they are released at round
        N's readback); plus the queued requests that the free rows take (`Refill`)."""
        if active and rounds.overlap and flight.pending is not None:
            flight.kept_out = [r for r in active if sure_to_finish(r)]
            active, st = drop_done(active, st, gone=sure_to_finish)
        if refill.waiting:
            active, st = refill(active, st)
        return active, st

    @staticmethod
    def _queue(active, st, rounds: Rounds):
        """Queue round N+1 from round N's state on the device: (its output state, (lanes,
        Readback)); (st, None) for an empty batch."""
        if not active:
            return st, None
        st, rb = rounds.step(st)
        rounds.stats.rounds += 1
        return st, (active, rb)

    def _read_back(self, flight: Flight, rounds: Rounds) -> list[Request]:
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
            self.pool.release(r)
        for r in flight.kept_out:
            if not r.done:
                raise RuntimeError(f"request {r.rid} was kept out of the next round as "
                                   f"sure to finish, but did not finish")
        flight.late, flight.kept_out = [], []
        return finished

    def _retire(self, active, st, finished, queued, flight: Flight):
        """Release the finished requests no round in flight holds; the others once round N+1
        (`queued`) is read back (`flight.late`). Their rows leave the batch before round N+2
        is queued."""
        in_flight = {id(r) for r in queued[0]} if queued is not None else set()
        for r in finished:
            if id(r) in in_flight:
                flight.late.append(r)
            else:               # no round in flight holds them (or kept out of N+1)
                self.pool.release(r)
        return drop_done(active, st)

    # ---- the calls ---------------------------------------------------------------------
    def generate_spec(self, prompts, max_new_tokens=None, sampling=None
                      ) -> tuple[list[Request], RunStats]:
        """EAGLE over the requests: up to max_bs run at once; past that the rest wait and are
        admitted as rows free up (continuous admission). (Requests in prompt order, stats.)
        sampling: None (greedy), a `SamplingParams` for every request or one per request; the
        emitted tokens follow the target's sampling distribution exactly (see `bodies`).
        max_new_tokens: one per request, or None for each request's params' budget."""
        w = self.worker
        stats, t0 = RunStats(), _now(w)
        clock = PhaseClock(w.kv.req_to_token.is_cuda)
        max_new_tokens, params = self.resolve(prompts, max_new_tokens, sampling)

        def prefill_batch(reqs):
            logits, hidden, b = w.prefill(reqs)
            lanes = w.lanes(reqs)
            first = w.first_tokens(logits, lanes, b)
            st = w.draft_prefill(first, hidden, b, lanes)
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
        rounds = Rounds(lambda s: w.spec_round(s, clock), consume, stats, clock, overlap,
                        max_emit=w.spec.n_path)
        return self._serve(prompts, max_new_tokens, params, prefill_batch, take_first, rounds, t0)

    def generate_greedy(self, prompts, max_new_tokens=None, sampling=None
                        ) -> tuple[list[Request], RunStats]:
        """Plain decoding (one token a step) over the requests, admitted as `generate_spec`
        admits them; greedy unless `sampling` says otherwise (taken as `generate_spec` takes
        it)."""
        w = self.worker
        stats, t0 = RunStats(), _now(w)
        clock = PhaseClock(w.kv.req_to_token.is_cuda)
        max_new_tokens, params = self.resolve(prompts, max_new_tokens, sampling)

        def prefill_batch(reqs):
            logits, _, b = w.prefill(reqs)
            lanes = w.lanes(reqs)
            first, top2 = w.first_tokens(logits, lanes, b), logits.topk(2, dim=-1).values
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
        # reservation, so greedy overlaps whenever the engine does
        rounds = Rounds(lambda s: w.decode_step(s, clock), consume, stats, clock,
                        self.opts.overlap)
        return self._serve(prompts, max_new_tokens, params, prefill_batch, take_first, rounds, t0)

    def _serve(self, prompts, max_new_tokens, params, prefill_batch, take_first,
               rounds: Rounds, t0: float) -> tuple[list[Request], RunStats]:
        """Admit the requests (all checked first) as rows free up and run `rounds` until every
        one has finished; (requests in prompt order, stats)."""
        refill = Refill(self.pool, prompts, max_new_tokens, prefill_batch, take_first,
                        defer=rounds.overlap, params=params)            # checks them all
        with self._abandon_on_error(refill):
            active, st = refill([], None)
            self._loop(active, st, rounds, refill)
        return refill.reqs, self._finish(rounds.stats, t0, rounds.clock, refill.reqs)

    @contextlib.contextmanager
    def _abandon_on_error(self, refill: Refill):
        """A generate call that raises (a bad request past the checks, an interrupt, a failing
        kernel) gives back every row and slot it admitted before the error propagates: the
        queued device work is waited for first (no round in flight may still use them), so the
        engine's next call starts from free rows, as after a call that returned."""
        try:
            yield
        except BaseException:
            if self.worker.kv.req_to_token.is_cuda:
                try:
                    torch.cuda.synchronize()
                except Exception:       # a device error: the rows still come back
                    pass
            for r in refill.reqs:
                if r.slots:             # still held (release empties them)
                    self.pool.release(r)
            raise

    def _finish(self, stats: RunStats, t0: float, clock: PhaseClock, reqs) -> RunStats:
        stats.seconds = _now(self.worker) - t0
        stats.phases = clock.totals()
        stats.tokens = sum(len(r.output) for r in reqs)
        return stats


def _now(worker: Worker) -> float:
    if worker.kv.req_to_token.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
