"""padgraph's LLM serving layer: runner programs with their bodies, the batch value models take,
the paged KV cache, the worker (runners, caches and rounds), the engine that holds a worker (a
request pool with public admit / release, and the overlap loop), and reference models with
EAGLE / MTP draft heads.

    from padgraph.llm import Engine, SpecConfig
    from padgraph.llm.models import LlamaConfig, LlamaModel, EagleHead

    target = LlamaModel(LlamaConfig.tiny())
    engine = Engine(target, EagleHead(target), SpecConfig(), backend="reference")
    reqs, stats = engine.generate_spec([[1, 2, 3]], [16])                  # greedy
    reqs, stats = engine.generate_spec([[1, 2, 3]], sampling=SamplingParams(
        temperature=0.7, top_p=0.9, seed=1, max_new_tokens=16))           # sampled, exactly
    engine.worker.runner("verify").stats                                  # the worker's runners
"""
from .admission import RequestPool
from .batch import Batch
from .config import SpecConfig, WorkerOptions
from .kv import KVCache, RowAllocator, SlotAllocator
from .programs import (RunnerAxes, decode_program, draft_extend_program, draft_prefill_program,
                       draft_program, extend_program, programs, verify_program)
from .protocol import DraftModel, TargetModel
from .requests import Request
from .sampling import SamplingParams
from .scheduler import Engine
from .state import GreedyState, SamplingLanes, SpecState
from .timing import RunStats
from .worker import Worker

__all__ = [
    "Batch", "DraftModel", "Engine", "GreedyState", "KVCache", "Request", "RequestPool", "RowAllocator",
    "RunStats", "RunnerAxes", "SamplingLanes", "SamplingParams", "SlotAllocator", "SpecConfig",
    "SpecState", "TargetModel", "Worker",
    "WorkerOptions", "decode_program", "draft_extend_program", "draft_prefill_program",
    "draft_program", "extend_program", "programs", "verify_program",
]
