"""Tensor-parallel runs: a process group of ranks on one host (gloo on the CPU, NCCL on GPUs),
each serving a shard of the same Llama-like target (`padgraph.llm.tp`), and the single-process
run their tokens are checked against."""
from __future__ import annotations

import gc
import json
import os
import socket
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import padgraph as pg
import padgraph.distributed as pgd

from .bodies import decode_body
from .config import SpecConfig
from .models.eagle_head import EagleHead
from .models.llama import LlamaConfig, LlamaModel
from .models.llama_tp import LlamaTP, TPGroup
from .presets import workload
from .requests import Request
from .scheduler import Engine
from .tp import Shard, TPWorker, drive, follow, top2_decode_body


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
    """The same requests through an `Engine`: the full model in this process."""
    target = full_model(setup, setup.device)
    w = Engine(target, None, SpecConfig(), backend=setup.backend, max_bs=setup.max_bs,
               max_context=SpecConfig().reservation(setup.max_context),
               buckets=pg.Buckets(list(setup.buckets)), torch_compile=False)
    with torch.no_grad():
        reqs, _ = w.generate_greedy(prompts, max_new_tokens)
    return reqs


EAGLE_SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=4)


def eagle_rank(rank: int, setup: Setup, port: int, out_dir: str, prompts, max_new_tokens):
    """One rank of an EAGLE run (`run_eagle`); every rank writes its result."""
    put(out_dir, rank, in_group(rank, setup, port, lambda tp, group: run_eagle(
        rank_target(rank, setup, tp), setup, group, prompts, max_new_tokens)))


def run_eagle(target: LlamaTP, setup: Setup, cpu_group, prompts, max_new_tokens) -> dict:
    """EAGLE over this rank's shard with a replicated (untrained) head; rank 0's requests."""
    head = EagleHead(target).to(target.lm_head.weight.device, setup.dtype)
    prompts, max_new_tokens = pgd.broadcast((prompts, max_new_tokens), cpu_group)
    worker = TPWorker(target, head, EAGLE_SPEC, cpu_group, setup.check_ranks or None,
                      backend=setup.backend, max_bs=setup.max_bs,
                      max_context=EAGLE_SPEC.reservation(setup.max_context),
                      buckets=pg.Buckets(list(setup.buckets)),
                      compile_options={"progress": False} if setup.backend == "cuda" else None,
                      # eager layers: the ranks' collectives have not run under torch.compile
                      # (nor on two GPUs at all); the single-process reference stays eager too
                      torch_compile=False)
    with torch.no_grad():
        reqs, stats = Engine.on(worker).generate_spec(prompts, max_new_tokens)
    calls = {name: dict(r.stats.calls) for name, r in worker._runners.items()}
    return {"outputs": [(r.output, r.gaps) for r in reqs], "rounds": stats.rounds,
            "accept_len": stats.accept_len, "calls": calls}


def requests(setup: Setup):
    """The run's prompts and output budgets (the batch shrinks as they finish)."""
    vocab = setup.config().vocab_size
    return workload(vocab, setup.n_requests, setup.seed, setup.prompt_lens, setup.new_tokens)
