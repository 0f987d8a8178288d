"""One rank of tensor-parallel serving: a shard of the target, its KV cache, and the same declared
decode program a single process compiles.

Rank 0 is the driver (`drive`): it keeps the requests and their slots (`TPScheduler`) and, before
every call, broadcasts the raw scheduled batch (a `Step`: host tensors) to the other ranks over a
CPU (gloo) group; they `follow`. Every rank then calls its runner with identical raw inputs, so
every rank's bucket is the same pure function of the same extents (`Plan.bucket_for`), with no
device-side agreement and no host sync on the followers. `padgraph.distributed.agree` checks that
premise on every call when asked. Under EAGLE every rank runs the whole loop itself: an `Engine`
on a `TPWorker`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

import padgraph as pg
import padgraph.distributed as pgd

from .batch import Batch
from .config import SpecConfig
from .kv import FIRST, KVCache, RowAllocator, SlotAllocator, new_cache
from .models.llama_tp import LlamaTP
from .programs import programs
from .requests import Request
from .timing import to_host
from .worker import Worker


@dataclass
class Step:
    """What every rank runs next, as rank 0 scheduled it (host tensors, equal on every rank)."""
    kind: str                                   # "prefill" | "decode" | "stop"
    inputs: dict[str, Tensor] = field(default_factory=dict)   # the raw inputs of the call
    admit: dict[int, list[int]] = field(default_factory=dict)  # req_to_token row -> its slots
    release: list[int] = field(default_factory=list)           # rows of finished requests


class TPScheduler:
    """Rank 0's bookkeeping: requests, their rows and slots, and the next Step. Host only."""

    def __init__(self, setup, eos_id: int | None = None):
        self.setup, self.eos_id = setup, eos_id
        self.slots = SlotAllocator(setup.max_bs * setup.max_context + FIRST)
        self.rows = RowAllocator(setup.max_bs + FIRST)
        self.reqs: list[Request] = []
        self.active: list[Request] = []

    def admit(self, prompts, max_new_tokens) -> Step:
        """Rows and slots for every request, and the prefill of their prompts."""
        for i, (prompt, n_new) in enumerate(zip(prompts, max_new_tokens)):
            need = len(prompt) + n_new
            if need > self.setup.max_context:
                raise ValueError(f"request {i}: prompt {len(prompt)} + max_new_tokens {n_new} "
                                 f"must fit max_context {self.setup.max_context}")
            self.reqs.append(Request(i, list(prompt), n_new, row=self.rows.alloc(1)[0],
                                     slots=self.slots.alloc(need)))
        self.active = list(self.reqs)
        return Step("prefill", prefill_inputs(self.reqs), admit={r.row: r.slots for r in self.reqs})

    def advance(self, tokens: list[int], gaps: list[float]) -> Step:
        """Emit one token per active request; the decode step of those still running (or stop)."""
        for r, t, g in zip(self.active, tokens, gaps):
            r.output.append(t)
            r.gaps.append(g)
            r.done = t == self.eos_id or len(r.output) >= r.max_new_tokens
        release = [r.row for r in self.active if r.done]
        for r in (r for r in self.active if r.done):
            self.slots.free(r.slots)
            self.rows.free([r.row])
        self.active = [r for r in self.active if not r.done]
        if not self.active:
            return Step("stop", release=release)
        return Step("decode", decode_inputs(self.active), release=release)


def prefill_inputs(reqs) -> dict[str, Tensor]:
    """The prompts packed request after request, with the slots of their positions."""
    lens = [len(r.prompt) for r in reqs]
    return {
        "input_ids": torch.tensor([t for r in reqs for t in r.prompt]),          # [n_tok]
        "positions": torch.cat([torch.arange(n) for n in lens]),                 # [n_tok]
        "req_pool_indices": torch.tensor([r.row for r in reqs], dtype=torch.int32),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),                       # [bs]
        "qo_indptr": torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
        "out_cache_loc": torch.tensor([s for r in reqs for s in r.slots[:len(r.prompt)]]),
    }


def decode_inputs(active) -> dict[str, Tensor]:
    """The decode program's raw inputs: each request's last token at its position."""
    pos = [len(r.prompt) + len(r.output) - 1 for r in active]
    return {
        "input_ids": torch.tensor([r.output[-1] for r in active]),               # [bs] int64
        "positions": torch.tensor(pos),
        "seq_lens": torch.tensor([p + 1 for p in pos], dtype=torch.int32),
        "req_pool_indices": torch.tensor([r.row for r in active], dtype=torch.int32),
        "out_cache_loc": torch.tensor([r.slots[p] for r, p in zip(active, pos)]),
    }


# ------------------------------------------------------------------------------------- one rank

def top2_decode_body(target: LlamaTP):
    """The decode body with the distributed top-2 head ([bs, 4] gathered, not [bs, V])."""
    def body(x):
        values, ids = target.decode_top2(x.input_ids, x.positions, Batch.from_view(x))
        return {"next_token": ids[:, 0], "top2_gap": values[:, 0] - values[:, 1]}
    return body


class Shard:
    """One rank: its shard of the target, its KV cache, and the compiled decode program.

    body: the decode body (`top2_decode_body`, or `padgraph.llm.bodies.decode_body`, which
    also runs the single-device model). `setup`: the run's `tp_run.Setup`. The program is the
    one a single process declares."""

    def __init__(self, target, setup, body, cpu_group=None, **compile_options):
        self.target, self.setup = target, setup
        self.kv = new_cache(target, target.cfg.n_layers, setup.max_bs * setup.max_context + FIRST,
                            setup.max_context, setup.max_bs + FIRST)
        program = programs(target.cfg, SpecConfig(), setup.dtype,
                           pg.Buckets(list(setup.buckets)))["decode"]
        state = {"k_cache": self.kv.k, "v_cache": self.kv.v, "req_to_token": self.kv.req_to_token}
        runner = pg.compile(program, body, setup.backend, state=state, **compile_options)
        self.decode = pgd.agree(runner, cpu_group, enabled=setup.check_ranks or None)

    def execute(self, step: Step):
        """Run one Step; its outputs (next_token, top2_gap), read on rank 0 only."""
        rt = self.kv.req_to_token
        for row, slots in step.admit.items():
            rt[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
        for row in step.release:
            rt[row].zero_()
        if step.kind == "prefill":
            return self.prefill(step.inputs)
        if step.kind == "decode":
            return self.decode(**step.inputs)     # host inputs: staged in the call's one copy
        return None

    def prefill(self, raw: dict[str, Tensor]) -> pg.Outputs:
        """Eager target extend over the prompts; outputs named like the decode program's."""
        d = {k: v.to(self.kv.device) for k, v in raw.items()}
        batch = Batch(self.kv, self.kv.req_to_token, d["req_pool_indices"], d["seq_lens"],
                      d["out_cache_loc"], qo_indptr=d["qo_indptr"])
        logits, _ = self.target.forward_extend(d["input_ids"], d["positions"], batch)
        top2 = logits.topk(2, dim=-1).values
        return pg.Outputs(next_token=logits.argmax(-1), top2_gap=top2[:, 0] - top2[:, 1])


def drive(shard: Shard, cpu_group, prompts, max_new_tokens) -> list[Request]:
    """Rank 0: schedule, broadcast each Step, run it, read the tokens; the finished requests."""
    sched = TPScheduler(shard.setup)
    step = sched.admit(prompts, max_new_tokens)
    while True:
        pgd.broadcast(step, cpu_group)
        if step.kind == "stop":
            return sched.reqs
        out = shard.execute(step)
        step = sched.advance(*to_host(out.next_token, out.top2_gap))


def follow(shard: Shard, cpu_group) -> None:
    """Every other rank: run what rank 0 broadcasts until it says stop."""
    while True:
        step = pgd.broadcast(None, cpu_group)
        shard.execute(step)
        if step.kind == "stop":
            return


class TPWorker(Worker):
    """The `Worker` of one rank of an EAGLE run, served by an `Engine` (`Engine.on(worker)`):
    the target is this rank's LlamaTP shard (verify is tensor-parallel), the draft head is
    replicated (its embedding and logits go through the target's vocab-parallel collectives,
    its one layer runs whole on every rank, so its cache holds every KV head).

    Here every rank runs the whole loop itself, SGLang's way: rank 0 broadcasts the requests
    once; the loop is then deterministic, since every rank reads the same gathered logits and
    the same all-reduced hidden states, so every call's raw inputs (device tensors that one
    runner hands the next) are equal on every rank without being sent. `agree` checks it
    (check_ranks: `pgd.agree`'s enabled) on every runner."""

    def __init__(self, target: LlamaTP, head, spec: SpecConfig, cpu_group=None,
                 check_ranks: bool | None = None, **kw):
        super().__init__(target, head, spec, **kw)
        cfg, w = target.cfg, target.lm_head.weight
        self.dkv = KVCache(1, self.kv.n_slots, cfg.n_kv_heads, cfg.head_dim, 2, 2, w.dtype,
                           w.device)                     # the replicated head: every KV head
        self.cpu_group, self.check_ranks = cpu_group, check_ranks

    def runner(self, name: str):
        if name not in self._runners:
            self._runners[name] = pgd.agree(super().runner(name), self.cpu_group,
                                            enabled=self.check_ranks)
        return self._runners[name]
