"""The worker: the runner programs of one target and draft head, compiled on first use, and
the rounds they run (prefill, draft prefill, an EAGLE round, a decode step).

It owns the paged caches (`n_rows` req_to_token rows, `n_slots` KV slots); which request holds
which row and slots is the request pool's (`padgraph.llm.admission.RequestPool`), and which
requests run, and when, the engine's (`padgraph.llm.scheduler.Engine`, which holds a worker).
Every round is a few runner calls (backend "cuda" on a GPU, "reference" on the CPU) and queues
its results' `Readback` without a host synchronisation, so the engine can queue the next round
before reading this one.

Per-request KV: a request owns one req_to_token row and, from admission, the slots for its whole
budget (prompt + max_new_tokens + tree scratch), so draft and verify tokens use the slots of the
positions they occupy; verify commits the accepted path by permuting the row (no KV copies).
Draft position p holds (token p+1, target hidden p), so the draft cache is one position behind.
A hybrid target's cache also holds recurrent pools, one row per request row: a request's
recurrent state lives at its req_to_token row from admission to release
(`padgraph.llm.models.hybrid`); the draft head keeps K/V pools only.

Sampling: decode and verify take each request's sampling lanes (`SamplingLanes`, carried in the
loop state beside its rows), and `first_tokens` draws a prefill's first tokens with the same
keys, so a request samples the same tokens whichever of these paths, rows or buckets serve it.
"""
from __future__ import annotations

import padgraph as pg
from padgraph.backends.triton import eagle as ops

from .batch import RawView
from .bodies import bodies, decode_body, draft_prefill_body, draw, extend_body
from .config import SpecConfig, WorkerOptions
from .kv import FIRST, cache_state, new_cache, new_draft_cache
from .programs import draft_prefill_runner_program, extend_prefill_program, programs
from .state import GreedyState, PrefillBatch, SamplingLanes, SpecState, pack_prompts
from .timing import PhaseClock, Readback

_TARGET_RUNNERS = ("decode", "verify", "prefill")   # the rest run the draft head


class Worker:
    """The runners and rounds of one target (and EAGLE draft head, or None for greedy only).

    backend: "cuda" | "reference"; runners are compiled on first use and kept, so repeated
    calls replay the same graphs. `options` are `WorkerOptions`' fields (max_bs, max_context,
    prefill, ...), kept as one value (`opts`); the scheduling ones (overlap, tail_sync, eos_id,
    seed) are the engine's and the request pool's to read. The H200 Llama main job's draft phase
    fell from 1.98 to 1.52 ms a round with draft_compile="whole"; it has not been run on a GPU for
    the DeepSeek MTP head, hence not the default.
    """

    def __init__(self, target, head, spec: SpecConfig, *, backend: str = "reference", **options):
        o = self.opts = WorkerOptions(**options)
        self.target, self.head, self.spec, self.backend = target, head, spec, backend
        self.n_slots = o.max_bs * o.max_context + FIRST   # each request reserves at most max_context
        self.n_rows = o.max_bs + FIRST
        tree_nodes = spec.num_draft_tokens if head is not None else 0   # a verify's, per request
        self.kv = new_cache(target, target.cfg.n_layers, self.n_slots, o.max_context, self.n_rows,
                            tree_nodes)
        self.dkv = new_draft_cache(target, self.n_slots)   # the head's layer; rows: self.kv's
        self.prefill_mode = o.prefill
        if o.prefill == "runner" and not getattr(target, "extend_in_graph", True):
            raise pg.ContractValueError(
                f"WorkerOptions.prefill: 'runner' needs a target whose forward_extend can be captured; "
                f"{type(target).__name__}.extend_in_graph is False (its extend reads the prompts' width "
                f"on the host): use prefill='eager'")
        self.draft_prefill_mode = o.draft_prefill if head is not None else "eager"
        self.programs, self.bodies = self._declare(o)
        self.torch_compile = backend == "cuda" if o.torch_compile is None else o.torch_compile
        self._runners: dict = {}

    @property
    def max_bs(self) -> int:
        """Requests running at once: the most rows a round runs."""
        return self.opts.max_bs

    @property
    def max_context(self) -> int:
        """Positions per request row (prompt + output + the reservation's margins)."""
        return self.opts.max_context

    def _declare(self, o: WorkerOptions) -> tuple[dict, dict]:
        """The runner programs and their bodies: decode (and the EAGLE three with a head), plus
        the prefill programs asked for (a batch holds at most max_bs * max_context tokens)."""
        target, head, spec = self.target, self.head, self.spec
        dtype, max_tokens = target.lm_head.weight.dtype, o.prefill_tokens or o.max_bs * o.max_context
        names, draft_names = tuple(cache_state(self.kv)), tuple(cache_state(self.dkv))
        progs = programs(target.cfg, spec, dtype, o.buckets or pg.Buckets.default(o.max_bs),
                         cache_names=names, sampling=o.sampling, draft_cache_names=draft_names)
        fns = (bodies(target, head, spec, o.spec_sampling) if head is not None
               else {"decode": decode_body(target)})
        if self.prefill_mode == "runner":
            progs["prefill"] = extend_prefill_program(target.cfg, dtype, max_tokens, names)
            fns["prefill"] = extend_body(target)
        if self.draft_prefill_mode == "runner":   # the head's prefill on the same ladder
            progs["draft_prefill"] = draft_prefill_runner_program(target.cfg, spec, dtype,
                                                                  max_tokens, draft_names)
            fns["draft_prefill"] = draft_prefill_body(head, spec)
        return progs, fns

    def state(self, name: str) -> dict:
        """Runner `name`'s bound state: its caches (the target's or the head's) and the rows."""
        kv = self.kv if name in _TARGET_RUNNERS else self.dkv
        return {**cache_state(kv), "req_to_token": self.kv.req_to_token}

    def options(self, name: str) -> dict:
        """pg.compile options of runner `name`: `compile_options`, plus (torch_compile) the
        decoder layers compiled regionally — the target's for decode / verify, the head's one
        layer for draft / draft-extend — so each layer kind compiles once for the whole ladder
        and inductor's fused kernels (norms, RoPE, activations) replace eager's small ones;
        draft_compile="whole": the draft and draft-extend bodies compiled whole."""
        opts = dict(self.opts.compile_options or {})
        if self.torch_compile and "torch_compile" not in opts:
            if name in ("draft", "draft_extend") and self.opts.draft_compile == "whole":
                opts["torch_compile"] = {"fullgraph": True}
            else:
                layers = self.target.layers if name in _TARGET_RUNNERS else [self.head.layer]
                opts["torch_compile"] = {"regions": layers, "fullgraph": True}
        return opts

    def runner(self, name: str):
        """Runner `name`, compiled on first use and kept."""
        if name not in self._runners:
            self._runners[name] = pg.compile(self.programs[name], self.bodies[name],
                                             self.backend, state=self.state(name),
                                             **self.options(name))
        return self._runners[name]

    # ---- prefill (eager, or the "prefill" runner) ---------------------------------------
    def prefill(self, reqs):
        """Target extend over the prompts; (last logits [bs, V], hidden, PrefillBatch)."""
        b = pack_prompts(reqs, self.kv.req_to_token)
        if self.prefill_mode == "runner":
            out = self.runner("prefill")(input_ids=b.ids, positions=b.positions,
                                         out_cache_loc=b.loc, seq_lens=b.seq_lens,
                                         req_pool_indices=b.rows, qo_indptr=b.qo)
            return self.target.logits(out.last_hidden), out.hidden, b
        logits, hidden = self.target.forward_extend(b.ids, b.positions, b.batch(self.kv))
        return logits, hidden, b

    @staticmethod
    def first_tokens(logits, lanes: SamplingLanes, b: PrefillBatch):
        """Each request's first token [bs] from its prefill's last logits [bs, V]: drawn with its
        lanes at position prompt length (decode's keys for that position), argmax at
        temperature 0."""
        return draw(logits, lanes.inputs(), b.seq_lens.long())

    def draft_prefill(self, first, hidden, b: PrefillBatch,
                      lanes: SamplingLanes | None = None) -> SpecState:
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
                RawView(**raw, **self.state("draft_prefill")))
        return SpecState(rows=b.rows, seq_lens=b.seq_lens, verified_id=first,
                         topk_p=o["topk_p"], topk_index=o["topk_index"],
                         hidden=o["next_hidden"], draft_loc=o["draft_out_cache_loc"],
                         sampling=lanes)

    # ---- rounds ------------------------------------------------------------------------
    def lanes(self, reqs) -> SamplingLanes:
        """The requests' sampling lanes on the worker's device (no host sync)."""
        return SamplingLanes.of([r.params for r in reqs], [r.seed for r in reqs],
                                self.kv.req_to_token.device)

    def lane_inputs(self, lanes: SamplingLanes) -> dict:
        """The sampling inputs of decode and verify (none where the worker does not sample)."""
        return lanes.inputs() if self.opts.sampling else {}

    def spec_round(self, st: SpecState, clock: PhaseClock):
        """Queue draft → verify → draft-extend for the batch in `st` and start the readback of
        its accept lengths and tokens; (next state, Readback of (accept lengths [bs], tokens
        [bs, steps + 1] of which each request's first accept-length are its output)). No host
        synchronisation, and no eager work between the replays: the draft emits verify's
        inputs, verify draft-extend's."""
        d = self.runner("draft")(
            topk_p=st.topk_p, topk_index=st.topk_index, hidden_states=st.hidden,
            positions=st.seq_lens.long(), seq_lens=st.seq_lens, req_pool_indices=st.rows,
            out_cache_loc=st.draft_loc, verified_id=st.verified_id)
        clock.mark("draft")
        lanes = st.lanes()
        v = self.runner("verify")(input_ids=d.verify_input_ids, positions=d.verify_positions,
                                  out_cache_loc=d.verify_out_cache_loc, seq_lens=st.seq_lens,
                                  req_pool_indices=st.rows, tree_mask=d.tree_mask,
                                  **self.lane_inputs(lanes))
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
                        draft_loc=e.draft_out_cache_loc, sampling=lanes)
        return nxt, rb

    def decode_step(self, st: GreedyState, clock: PhaseClock):
        """Queue one decode step for the batch in `st` and start the readback of its tokens and
        top-2 gaps; (next state, Readback). No host synchronisation."""
        s1, lanes = st.seq_lens + 1, st.lanes()
        out = self.runner("decode")(
            input_ids=st.cur, positions=st.seq_lens.long(), seq_lens=s1, req_pool_indices=st.rows,
            out_cache_loc=ops.assign_cache_locs(self.kv.req_to_token, st.rows, st.seq_lens, 1),
            **self.lane_inputs(lanes))
        clock.mark("decode")
        rb = Readback(out.next_token, out.top2_gap)
        return GreedyState(st.rows, s1, out.next_token, sampling=lanes), rb
