"""padgraph's LLM serving layer: runner programs with their bodies, the batch value models take,
the paged KV cache, the worker (runners and rounds), the scheduler (requests, admission, the
overlap loop), and reference models with EAGLE / MTP draft heads.

    from padgraph.llm import Engine, SpecConfig
    from padgraph.llm.models import LlamaConfig, LlamaModel, EagleHead

    target = LlamaModel(LlamaConfig.tiny())
    engine = Engine(target, EagleHead(target), SpecConfig(), backend="reference")
    reqs, stats = engine.generate_spec([[1, 2, 3]], [16])
"""
from .batch import Batch
from .config import SpecConfig, WorkerOptions
from .kv import KVCache, RowAllocator, SlotAllocator
from .programs import (RunnerAxes, decode_program, draft_extend_program, draft_prefill_program,
                       draft_program, extend_program, programs, verify_program)
from .protocol import DraftModel, TargetModel
from .requests import Request
from .scheduler import Engine
from .state import GreedyState, SpecState
from .timing import RunStats
from .worker import Worker

__all__ = [
    "Batch", "DraftModel", "Engine", "GreedyState", "KVCache", "Request", "RowAllocator",
    "RunStats", "RunnerAxes", "SlotAllocator", "SpecConfig", "SpecState", "TargetModel", "Worker",
    "WorkerOptions", "decode_program", "draft_extend_program", "draft_prefill_program",
    "draft_program", "extend_program", "programs", "verify_program",
]
