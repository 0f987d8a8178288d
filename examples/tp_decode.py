"""Greedy decode of a Llama-like target, tensor-parallel over N ranks, checked against one process.

    python examples/tp_decode.py --world 2                          # CPU: gloo, reference, tiny
    python examples/tp_decode.py --world 2 --backend cuda           # 2 GPUs: NCCL, CUDA graphs
    python examples/tp_decode.py --world 2 --backend cuda --bench   # step and capture times

Every rank holds a shard of the target (`models/llama_tp.py`: heads, MLP and vocab split, KV
cache sharded by KV heads) and compiles the same declared decode program as one process does
(`spec_decode.programs`); its body's all-reduces run eagerly under gloo on the reference backend
and are captured into each bucket's graph under NCCL on the cuda backend.

Rank 0 is the driver: it keeps the requests and their slots and, before every call, broadcasts
the raw scheduled batch (a `Step`: host tensors) to the other ranks over a CPU (gloo) group.
Every rank then calls its runner with identical raw inputs, so every rank's bucket is the same
pure function of the same extents (`Plan.bucket_for`), with no device-side agreement and no host
sync on the followers. `PADGRAPH_CHECK_RANKS=1` (or `--check-ranks`) checks that premise on every
call (`padgraph.distributed.agree`). The batch shrinks as requests finish, through odd sizes.

The last line is `greedy_match=N/N`: the TP run's tokens against the single-process run's (`Worker
.generate_greedy` of spec_decode, the full model on one device); on the CPU (fp32) exactly, on
GPUs (bf16) up to a first divergence at a top-2 near-tie (eagle.py's rule).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import padgraph as pg
import padgraph.distributed as pgd
from padgraph.backends.triton.kv import KVCache, RowAllocator, SlotAllocator
from eagle import TIE_TOL, compare, oracle_line, workload
from models.eagle_head import EagleHead
from models.llama import LlamaConfig, LlamaModel
from models.llama_tp import LlamaTP, TPGroup, shard_config
from spec_decode import (Request, SpecConfig, Worker, _kv, decode_body, new_cache, programs,
                         to_host)


@dataclass(frozen=True)
class Setup:
    """One run, the same on every rank (it travels to the spawned ranks pickled)."""
    world: int = 2
    backend: str = "reference"         # "reference" (CPU, gloo) | "cuda" (GPUs, NCCL)
    size: str = "tiny"                 # "tiny" | "1b"
    head: str = "top2"                 # "top2": distributed top-2 | "gather": all-gather logits
    n_requests: int = 6
    prompt_lens: tuple = (3, 20)
    new_tokens: tuple = (4, 24)
    max_bs: int = 8
    max_context: int = 64
    buckets: tuple = (1, 2, 4, 8)
    check_ranks: bool = False
    seed: int = 7

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "cuda" else "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.backend == "cuda" else torch.float32

    def config(self) -> LlamaConfig:
        return LlamaConfig.llama_1b() if self.size == "1b" else LlamaConfig.tiny()


CPU = Setup()
GPU = Setup(backend="cuda", size="1b", n_requests=16, prompt_lens=(4, 97),
            new_tokens=(16, 129), max_bs=16, max_context=256,
            buckets=tuple(pg.Buckets.default(16)))


def full_model(setup: Setup, device) -> LlamaModel:
    """The single-device target (seed 0), the one-process baseline; every rank shards the same
    model (`rank_target`)."""
    return LlamaModel(setup.config(), seed=0).to(device, setup.dtype).eval()


# ---------------------------------------------------------------------------- the driver's message

@dataclass
class Step:
    """What every rank runs next, as rank 0 scheduled it (host tensors, equal on every rank)."""
    kind: str                                   # "prefill" | "decode" | "stop"
    inputs: dict[str, Tensor] = field(default_factory=dict)   # the raw inputs of the call
    admit: dict[int, list[int]] = field(default_factory=dict)  # req_to_token row -> its slots
    release: list[int] = field(default_factory=list)           # rows of finished requests


class Scheduler:
    """Rank 0's bookkeeping: requests, their rows and slots, and the next Step. Host only."""

    def __init__(self, setup: Setup, eos_id: int | None = None):
        self.setup, self.eos_id = setup, eos_id
        self.slots = SlotAllocator(setup.max_bs * setup.max_context + 1)
        self.rows = RowAllocator(setup.max_bs + 1)
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
        values, ids = target.decode_top2(x.input_ids, x.positions, _kv(x), x.req_to_token,
                                         x.req_pool_indices, x.seq_lens, x.out_cache_loc)
        return {"next_token": ids[:, 0], "top2_gap": values[:, 0] - values[:, 1]}
    return body


class Shard:
    """One rank: its shard of the target, its KV cache, and the compiled decode program.

    body: the decode body (`top2_decode_body`, or spec_decode's `decode_body`, which also runs
    the single-device model). The program is the one a single process declares."""

    def __init__(self, target, setup: Setup, body, cpu_group=None, **compile_options):
        self.target, self.setup = target, setup
        self.kv = new_cache(target, target.cfg.n_layers, setup.max_bs * setup.max_context + 1,
                            setup.max_context, setup.max_bs + 1)
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
        logits, _ = self.target.forward_extend(d["input_ids"], d["positions"], self.kv,
                                               self.kv.req_to_token, d["req_pool_indices"],
                                               d["seq_lens"], d["qo_indptr"], d["out_cache_loc"])
        top2 = logits.topk(2, dim=-1).values
        return pg.Outputs(next_token=logits.argmax(-1), top2_gap=top2[:, 0] - top2[:, 1])


def drive(shard: Shard, cpu_group, prompts, max_new_tokens) -> list[Request]:
    """Rank 0: schedule, broadcast each Step, run it, read the tokens; the finished requests."""
    sched = Scheduler(shard.setup)
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


# ------------------------------------------------------------------------------ process group

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, setup: Setup, port: int):
    """Join the group: (TPGroup for the model's collectives, CPU group for the driver's batch).
    CPU: one gloo group for both (None: the default group). GPUs: NCCL, a gloo group beside."""
    url = f"tcp://127.0.0.1:{port}"
    if setup.backend != "cuda":
        torch.set_num_threads(1)      # the ranks share the cores; more threads spin
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=setup.world)
        return TPGroup(rank, setup.world), None
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")       # no NVLink multicast (shared hosts)
    torch.cuda.set_device(rank)
    # device_id: the NCCL communicator is made here, eagerly, never inside a graph capture
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=setup.world,
                            device_id=torch.device("cuda", rank))
    return TPGroup(rank, setup.world), dist.new_group(backend="gloo")


def rank_target(rank: int, setup: Setup, tp: TPGroup) -> LlamaTP:
    """This rank's shard of the single-process model (built whole on the CPU, seed 0, fp32)."""
    device = torch.device("cuda", rank) if setup.backend == "cuda" else torch.device("cpu")
    with torch.no_grad():
        full = LlamaModel(setup.config(), seed=0).eval()
        return LlamaTP.shard(full, tp).to(device, setup.dtype)


def rank_shard(rank: int, setup: Setup, tp: TPGroup, cpu_group) -> Shard:
    target = rank_target(rank, setup, tp)
    body = top2_decode_body(target) if setup.head == "top2" else decode_body(target)
    opts = {"progress": False} if setup.backend == "cuda" else {}
    return Shard(target, setup, body, cpu_group, **opts)


def in_group(rank: int, setup: Setup, port: int, work):
    """work(tp, cpu_group) as one rank of the group; what it returns. Its graphs (which hold
    NCCL resources) are freed before the group is destroyed."""
    tp, cpu_group = init_rank(rank, setup, port)
    try:
        return work(tp, cpu_group)
    finally:
        gc.collect()              # runners' closures are cycles: free them while NCCL lives
        if setup.backend == "cuda":
            torch.cuda.synchronize()
        dist.destroy_process_group()


def greedy(rank: int, setup: Setup, tp: TPGroup, cpu_group, prompts, max_new_tokens) -> dict:
    """One rank's greedy run: rank 0 drives, the others follow; rank 0's tokens and gaps."""
    shard = rank_shard(rank, setup, tp, cpu_group)
    with torch.no_grad():
        if rank == 0:
            reqs = drive(shard, cpu_group, prompts, max_new_tokens)
        else:
            follow(shard, cpu_group)
    return {"outputs": [(r.output, r.gaps) for r in reqs] if rank == 0 else None,
            "calls": dict(shard.decode.stats.calls)}


def rank_main(rank: int, setup: Setup, port: int, out_dir: str, prompts, max_new_tokens):
    """One spawned rank of `run_tp`: every rank writes its result (rank 0's has the tokens)."""
    put(out_dir, rank, in_group(rank, setup, port, lambda tp, group: greedy(
        rank, setup, tp, group, prompts, max_new_tokens)))


def put(out_dir: str, rank: int, obj) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(obj, f)


def spawn(fn, setup: Setup, *args) -> dict[int, object]:
    """Run fn(rank, setup, port, out_dir, *args) on `setup.world` processes; what each `put`.
    (Files, not a queue: a rank blocked writing a full pipe would never exit to be joined.)"""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(fn, args=(setup, free_port(), out_dir, *args), nprocs=setup.world, join=True)
        out = {}
        for name in os.listdir(out_dir):
            with open(os.path.join(out_dir, name)) as f:
                out[int(name[4:-5])] = json.load(f)
    return out


def run_tp(setup: Setup, prompts, max_new_tokens) -> dict[int, dict]:
    """A greedy run over `setup.world` ranks: per rank its bucket counts ("calls"), and on
    rank 0 the (tokens, top-2 gaps) of each request ("outputs")."""
    return spawn(rank_main, setup, prompts, max_new_tokens)


def run_single(setup: Setup, prompts, max_new_tokens) -> list[Request]:
    """The same requests through spec_decode's Worker: the full model in this process."""
    target = full_model(setup, setup.device)
    w = Worker(target, None, SpecConfig(), backend=setup.backend, max_bs=setup.max_bs,
               max_context=setup.max_context + spec_margin(SpecConfig()),
               buckets=pg.Buckets(list(setup.buckets)), torch_compile=False)
    with torch.no_grad():
        reqs, _ = w.generate_greedy(prompts, max_new_tokens)
    return reqs


# ------------------------------------------------------------------------- EAGLE rounds

EAGLE_SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=4)


class TPWorker(Worker):
    """spec_decode's Worker on one rank of an EAGLE run: the target is this rank's LlamaTP
    shard (verify is tensor-parallel), the draft head is replicated (its embedding and logits go
    through the target's vocab-parallel collectives, its one layer runs whole on every rank).

    Here every rank runs the whole loop itself, SGLang's way: rank 0 broadcasts the requests
    once; the loop is then deterministic, since every rank reads the same gathered logits and
    the same all-reduced hidden states, so every call's raw inputs (device tensors that one
    runner hands the next) are equal on every rank without being sent. `agree` checks it."""

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


def eagle_rank(rank: int, setup: Setup, port: int, out_dir: str, prompts, max_new_tokens):
    """One rank of an EAGLE run (`run_eagle`); every rank writes its result."""
    put(out_dir, rank, in_group(rank, setup, port, lambda tp, group: run_eagle(
        rank_target(rank, setup, tp), setup, group, prompts, max_new_tokens)))


def run_eagle(target: LlamaTP, setup: Setup, cpu_group, prompts, max_new_tokens) -> dict:
    """EAGLE over this rank's shard with a replicated (untrained) head; rank 0's requests."""
    head = EagleHead(target).to(target.lm_head.weight.device, setup.dtype)
    prompts, max_new_tokens = pgd.broadcast((prompts, max_new_tokens), cpu_group)
    w = TPWorker(target, head, EAGLE_SPEC, cpu_group, setup.check_ranks or None,
                 backend=setup.backend, max_bs=setup.max_bs,
                 max_context=setup.max_context + spec_margin(EAGLE_SPEC),
                 buckets=pg.Buckets(list(setup.buckets)),
                 compile_options={"progress": False} if setup.backend == "cuda" else None,
                 # eager layers: the ranks' collectives have not run under torch.compile (nor
                 # on two GPUs at all); the single-process reference above stays eager too
                 torch_compile=False)
    with torch.no_grad():
        reqs, stats = w.generate_spec(prompts, max_new_tokens)
    calls = {name: dict(r.stats.calls) for name, r in w._runners.items()}
    return {"outputs": [(r.output, r.gaps) for r in reqs], "rounds": stats.rounds,
            "accept_len": stats.accept_len, "calls": calls}


def spec_margin(spec: SpecConfig) -> int:
    """What Worker reserves per request past prompt + output (verify tree and draft slots)."""
    return max(spec.num_draft_tokens, spec.steps * spec.topk) + 1


# ------------------------------------------------------------------- measurement (cuda only)

BENCH_BS = (1, 64)
BENCH_CTX = 512          # tokens already in each request's cache when a step is timed


def bench_setup(setup: Setup) -> Setup:
    return Setup(**{**setup.__dict__, "max_bs": max(BENCH_BS), "max_context": BENCH_CTX + 1,
                    "buckets": tuple(pg.Buckets.default(max(BENCH_BS)))})


def bench_inputs(shard: Shard, bs: int) -> dict[str, Tensor]:
    """A decode batch of bs requests at position BENCH_CTX (rows 1..bs own disjoint slots)."""
    rt, n = shard.kv.req_to_token, BENCH_CTX + 1
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=rt.device)
    rt[1:bs + 1, :n] = (1 + torch.arange(bs * n, device=rt.device)).view(bs, n).int()
    return {"input_ids": torch.randint(1, shard.target.cfg.vocab_size, (bs,), device=rt.device),
            "positions": torch.full((bs,), BENCH_CTX, device=rt.device),
            "seq_lens": torch.full((bs,), n, dtype=torch.int32, device=rt.device),
            "req_pool_indices": rows, "out_cache_loc": rt[1:bs + 1, BENCH_CTX].long()}


def time_step(shard: Shard, bs: int, cpu_group=None, iters: int = 200) -> float:
    """Mean ms per decode call at bs (graph replays back to back: the GPU's time per step)."""
    raw = bench_inputs(shard, bs)
    for _ in range(10):
        shard.decode(**raw)
    torch.cuda.synchronize()
    if cpu_group is not None:
        dist.barrier(group=cpu_group)       # ranks start together: no wait charged to a step
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        shard.decode(**raw)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure(shard: Shard, cpu_group=None) -> dict:
    """Capture seconds of the ladder and ms per step at each BENCH_BS."""
    capture = sum(c["seconds"] for c in shard.decode.stats.capture.values())
    with torch.no_grad():
        steps = {bs: time_step(shard, bs, cpu_group) for bs in BENCH_BS}
    return {"capture_s": capture, "step_ms": steps}


def bench_rank(rank: int, setup: Setup, port: int, out_dir: str):
    put(out_dir, rank, in_group(rank, setup, port, lambda tp, group: measure(
        rank_shard(rank, setup, tp, group), group)))


def bench(setup: Setup) -> None:
    """TP=world against one GPU (the plain model, spec_decode's decode body): step ms at
    bs=1 and 64, capture seconds of the decode ladder per rank."""
    setup = bench_setup(setup)
    ranks = spawn(bench_rank, setup)
    target = full_model(setup, "cuda")
    one = measure(Shard(target, setup, decode_body(target), progress=False))
    print(f"1B-shaped decode, {len(setup.buckets)} buckets up to {max(BENCH_BS)}, context "
          f"{BENCH_CTX}, bf16; TP={setup.world} (NCCL in the graphs, head={setup.head}) vs 1 GPU")
    for bs in BENCH_BS:
        tp_ms = max(r["step_ms"][str(bs)] for r in ranks.values())
        print(f"bs={bs}: step ms 1 GPU {one['step_ms'][bs]:.3f}, TP={setup.world} {tp_ms:.3f} "
              f"({tp_ms / one['step_ms'][bs]:.2f}x)")
    caps = [round(ranks[r]["capture_s"], 2) for r in sorted(ranks)]
    print(f"capture s: 1 GPU {one['capture_s']:.2f}, per rank {caps} "
          f"({max(caps) / one['capture_s']:.2f}x)")


# ------------------------------------------------------------------------------------ main

def requests(setup: Setup):
    vocab = setup.config().vocab_size
    return workload(vocab, setup.n_requests, setup.seed, setup.prompt_lens, setup.new_tokens)


def parse_setup(argv=None) -> tuple[Setup, bool]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", choices=("reference", "cuda"), default="reference")
    ap.add_argument("--head", choices=("top2", "gather"), default="top2",
                    help="top2: distributed top-2 ([bs, 4] gathered); gather: full logits")
    ap.add_argument("--check-ranks", action="store_true",
                    help=f"check bucket agreement before every call (also {pgd.ENV}=1)")
    ap.add_argument("--eagle", action="store_true",
                    help="EAGLE rounds (draft, TP verify, draft-extend) instead of greedy steps")
    ap.add_argument("--bench", action="store_true", help="cuda: step and capture times")
    args = ap.parse_args(argv)
    base = GPU if args.backend == "cuda" else CPU
    setup = Setup(**{**base.__dict__, "world": args.world, "head": args.head,
                     "check_ranks": args.check_ranks})
    shard_config(setup.config(), setup.world)      # a size that does not split fails here
    return setup, args


def main(argv=None):
    setup, args = parse_setup(argv)
    if args.bench:
        return bench(setup)
    prompts, news = requests(setup)
    what = f"EAGLE {EAGLE_SPEC} (untrained head)" if args.eagle else f"greedy, head={setup.head}"
    print(f"{setup.size} Llama-like target, TP={setup.world} over "
          f"{'NCCL' if setup.backend == 'cuda' else 'gloo'}, backend {setup.backend!r}, "
          f"{len(prompts)} requests (the batch shrinks), {what}")
    if args.eagle:
        res = spawn(eagle_rank, setup, prompts, news)[0]
        tp = res["outputs"]
        print(f"EAGLE: {res['rounds']} rounds, accept length {res['accept_len']:.2f}")
    else:
        tp = run_tp(setup, prompts, news)[0]["outputs"]
    single = run_single(setup, prompts, news)
    tp_reqs = [Request(r.rid, r.prompt, r.max_new_tokens, output=o, gaps=g)
               for r, (o, g) in zip(single, tp)]
    tol = TIE_TOL if setup.backend == "cuda" else 0.0          # fp32 on the CPU: exact
    match, ties, real = compare(single, tp_reqs, tie_tol=tol)
    print(f"tokens: TP {sum(len(r.output) for r in tp_reqs)}, one process "
          f"{sum(len(r.output) for r in single)}; tie tolerance {tol}")
    print(oracle_line(match, ties, real))


if __name__ == "__main__":
    main()
