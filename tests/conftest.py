"""Shared pytest setup: the `cuda` marker skips without a GPU; Triton runs interpreted on CPU."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported: kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
