"""bench_runner's floor on the CPU: the weight bytes a decode step reads."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import bench_runner  # noqa: E402
from models.llama import LlamaConfig, LlamaModel  # noqa: E402


def test_step_reads_all_weights_but_the_embedding_table():
    model = LlamaModel(LlamaConfig.tiny(n_layers=2)).to(torch.bfloat16)
    cfg = model.cfg
    total = sum(p.numel() * 2 for p in model.parameters())
    table = cfg.vocab_size * cfg.hidden_size * 2
    for n in (1, 16):
        assert bench_runner.step_weight_bytes(model, n) == total - table + n * cfg.hidden_size * 2
    # counted from the layers up: every linear and norm, the lm_head, n embedding rows
    rest = sum(p.numel() * 2 for name, p in model.named_parameters() if not name.startswith("embed"))
    assert bench_runner.step_weight_bytes(model, 3) == rest + 3 * cfg.hidden_size * 2


def test_a_table_tied_to_the_lm_head_is_read_whole():
    model = LlamaModel(LlamaConfig.tiny(n_layers=1))
    model.lm_head.weight = model.embed.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())   # counted once
    assert bench_runner.step_weight_bytes(model, 4) == total
