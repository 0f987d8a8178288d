"""Shared pytest setup: the `cuda` marker skips without a GPU; Triton runs interpreted on CPU."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported: kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# pytest-xdist workers share the machine's cores: each takes its share of intra-op threads (and
# so do the subprocesses it starts: the conformance runs). Without it every worker runs as many
# OpenMP threads as there are cores, and on a busy 2-core machine the spinning threads of two
# workers (and anything else running) make small-op tests many times slower.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_compile_caches():
    """Inductor's on-disk caches off for one test: a graph served from them carries the guards
    it was compiled under (from another test or process), so counts of compiled graphs vary."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
