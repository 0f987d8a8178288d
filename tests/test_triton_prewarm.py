"""Triton's once-per-process setup in a background thread: started only where wanted, once, and
harmless where it fails (on the CPU the driver has no device: the hash is still cached)."""
import importlib

import pytest


@pytest.fixture
def prewarm(monkeypatch):
    mod = importlib.import_module("padgraph.backends.triton.prewarm")
    monkeypatch.setattr(mod, "_thread", None)
    return mod


@pytest.mark.parametrize("env", [{"PADGRAPH_TRITON_PREWARM": "0"}, {"TRITON_INTERPRET": "1"}])
def test_not_wanted_when_switched_off_or_interpreted(prewarm, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not prewarm.wanted()
    assert prewarm.start() is None


def test_runs_once_and_fills_tritons_key_cache(prewarm, monkeypatch):
    from triton.runtime.cache import triton_key
    monkeypatch.setattr(prewarm, "wanted", lambda: True)
    triton_key.cache_clear()
    t = prewarm.start()
    assert t is not None and prewarm.start() is t          # one thread a process
    t.join()                                               # no timeout: hashing Triton's sources is slow on a busy machine
    assert not t.is_alive()
    assert triton_key.cache_info().currsize == 1           # the main thread finds it computed


def test_a_failing_setup_does_not_raise(prewarm, monkeypatch):
    import triton.runtime.cache as cache

    def boom():
        raise RuntimeError("no driver")
    monkeypatch.setattr(cache, "triton_key", boom)
    prewarm._setup()  # swallowed: the first launch does the setup itself
