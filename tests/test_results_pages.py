"""Every page under results/ states the command that reproduces it from today's tree, and that
command resolves: the script or module exists and its own argument parser accepts the flags.

The parser is the benchmark's: the script runs as `python` would run it until it parses its
arguments, and stops there (argparse's `parse_args` is wrapped to raise once it has parsed), so
no benchmark runs and no GPU is needed. `python -m padgraph.spec` is checked by pytest's own
command-line parse with the suite's plugin loaded. A page also names no internal run folder,
issue number, machine path or uncommitted state: it describes the product.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "results").glob("*.md"))
# `python ...` / `python3 ...` in backticks, after optional VAR=value assignments
COMMAND = re.compile(r"`((?:[A-Z_][A-Z0-9_]*=\S* +)*python3? +[^`]+)`")
# `bash scripts/X.sh STAGE ...` in backticks: the GPU suite's stages
SUITE = re.compile(r"`(?:[A-Z_][A-Z0-9_]*=\S* +)*bash +(scripts/[\w.]+\.sh)((?: +[\w-]+)*)`")
# What a product page must not carry: internal run folders, padgraph's own issue numbers
# (upstream ones name their project first: "SGLang #25529"), machine paths, uncommitted state.
UNWANTED = (
    (re.compile(r"results/\d{4}-\d\d-\d\d/|\bs\d+[a-z]?/|/s\d+[a-z]?\b"), "an internal run folder"),
    (re.compile(r"(?<!SGLang )(?<!vLLM )(?<!PyTorch )(?<!pytorch )(?<!transformers )(?<!Triton )#\d+\b"),
     "an issue number"),
    (re.compile(r"(?<![\w.])/(?:opt|home|root|work|tmp|usr|mnt|scratch)/"), "a machine path"),
    (re.compile(r"uncommitted", re.I), "uncommitted state"),
)


class Parsed(Exception):
    """Raised by the wrapped `parse_args` once the script's parser accepted its arguments."""


def commands(text: str) -> list[str]:
    """Each command a page states (a span may hold several, joined by ';' or '&&')."""
    found = []
    for span in COMMAND.findall(text):   # split only where the next command starts (a ';' may be quoted)
        found += [c.strip() for c in re.split(r"(?:;|&&)\s*(?=(?:[A-Z_][A-Z0-9_]*=\S* +)*python3? )", span)]
    return found


def split(command: str) -> tuple[dict, list[str], list[str]]:
    """(environment assignments, the target: ['-m', module] or [path], its arguments)."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words and re.fullmatch(r"python3?", words[0]), f"not a python command: {command!r}"
    words = words[1:]
    target, args = (words[:2], words[2:]) if words[:1] == ["-m"] else (words[:1], words[1:])
    return env, target, args


def _source(target: list[str]) -> Path:
    if target[0] == "-m":
        base = ROOT / Path(*target[1].replace("padgraph.", "", 1).split("."))
        return base / "__main__.py" if base.is_dir() else base.with_suffix(".py")
    return ROOT / target[0]


def _check_spec(args: list[str]) -> str | None:
    """`python -m padgraph.spec ARGS`: pytest's own parse with the suite's plugin (no case runs)."""
    if any(a == "--inject" or a.startswith("--inject=") for a in args):   # the fault catalogue's parser
        from padgraph.spec import inject
        try:
            inject.parser().parse_args(args)
        except SystemExit:
            return f"--inject does not accept {args}"
        return None
    from _pytest.config import UsageError, _prepareconfig   # what pytest.main parses with
    spec_dir = str(ROOT / "spec")
    try:
        config = _prepareconfig([spec_dir, "-p", "padgraph.spec.plugin", "-p", "no:cacheprovider", *args])
    except UsageError as err:
        return next((line for line in str(err).splitlines() if "error:" in line), str(err) or "usage error")
    config._ensure_unconfigure()
    return None


@contextlib.contextmanager
def _as_main(argv: list[str], script_dir: Path | None):
    """sys.argv, sys.path[0] and the environment as `python` sets them; restored after."""
    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop
    sys.argv = argv
    sys.path[:0] = [str(script_dir or ROOT)]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def check(command: str) -> str | None:
    """None if the command resolves; else why not."""
    env, target, args = split(command)
    source = _source(target)
    if not source.is_file():
        return f"{' '.join(target)}: no such script or module ({source.relative_to(ROOT)})"
    if target == ["-m", "padgraph.spec"]:
        return _check_spec(args)
    if "ArgumentParser" not in source.read_text():
        return f"{source.relative_to(ROOT)} takes no flags, but the command passes {args}" if args else None
    stderr, module = io.StringIO(), target[1] if target[0] == "-m" else None
    imported = sys.modules.pop(module, None) if module else None   # runpy runs a fresh copy
    with _as_main([str(source), *args], None if target[0] == "-m" else source.parent), \
            contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        os.environ.update(env)
        try:
            runpy.run_module(target[1], run_name="__main__", alter_sys=True) if target[0] == "-m" \
                else runpy.run_path(str(source), run_name="__main__")
        except Parsed:
            return None
        except SystemExit as exit_:
            return f"its parser refused the flags (exit {exit_.code}): {stderr.getvalue().strip()[-500:]}"
        finally:
            if imported is not None:
                sys.modules[module] = imported
    return f"{source.relative_to(ROOT)} ran to its end without parsing its arguments"


def suite_problems(text: str) -> list[str]:
    """Each `bash scripts/X.sh STAGE` a page states whose script or stage does not exist."""
    problems = []
    for script, stages in SUITE.findall(text):
        path = ROOT / script
        if not path.is_file():
            problems.append(f"{script}: no such script")
            continue
        known = set(re.findall(r"\bwant ([\w-]+)", path.read_text()))
        problems += [f"{script}: no stage {stage!r} (it has {sorted(known)})" for stage in stages.split() if stage not in known]
    return problems


def unwanted(text: str) -> list[str]:
    """Each line that carries something a product page must not, with what it is."""
    return [f"line {n}: {what}: {line.strip()[:160]}" for n, line in enumerate(text.splitlines(), 1)
            for pattern, what in UNWANTED if pattern.search(line)]


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "README.md"], ids=lambda p: p.name)
def test_every_page_states_a_command_that_resolves(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    found = commands(page.read_text())
    assert found, f"results/{page.name} states no command (`python -m bench.X ...` or `python path.py ...`)"
    failures = [f"`{c}`: {why}" for c in found if (why := check(c))] + suite_problems(page.read_text())
    assert not failures, f"results/{page.name}: commands that do not resolve in today's tree:\n" + "\n".join(failures)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_name_no_internal_folder_issue_or_machine_path(page):
    found = unwanted(page.read_text())
    assert not found, f"results/{page.name}:\n" + "\n".join(found)


def test_the_command_check_refuses_what_does_not_resolve(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert check("python -m bench.bench_host --calls 1000") is None
    assert check("python -m bench.bench_runner --variants padgraph --sizes 1,16 --iters 30") is None
    assert check("PADGRAPH_TRITON_PREWARM=0 python -m bench.bench_attention --no-sweep --bs 1") is None
    assert check("python examples/eagle.py --model llama --steps 5") is None
    assert "no such script" in check("python examples/bench_runner.py --iters 30")
    assert "refused the flags" in check("python -m bench.bench_host --calls many")
    assert "refused the flags" in check("python -m bench.bench_runner --no-such-flag")
    assert "refused the flags" in check("python examples/eagle.py --model gpt5")
    assert "takes no flags" in check("python -m bench.bench_eagle --steps 3")


def test_gpu_suite_stages_are_checked():
    assert suite_problems("`bash scripts/gpu_suite.sh generated` and `GEN_N=5 bash scripts/gpu_suite.sh bench-eagle`") == []
    assert "no stage 'bench-nothing'" in suite_problems("`bash scripts/gpu_suite.sh bench-nothing`")[0]
    assert "no such script" in suite_problems("`bash scripts/cold_capture.sh`")[0]


def test_the_spec_command_check_uses_pytests_parser():
    good = "python -m padgraph.spec --backend cuda -k 'generated or regressions' --seed 1 -n 2 --generated 50"
    assert check(good) is None
    assert "unrecognized arguments" in check("python -m padgraph.spec --backend cuda --no-such-flag")
    assert "invalid int value" in check("python -m padgraph.spec --backend cuda --generated many")


def test_commands_are_found_and_split():
    text = "- command: `EAGLE_MODEL=deepseek python3 -m bench.bench_eagle; python examples/eagle.py --model llama`"
    assert commands(text) == ["EAGLE_MODEL=deepseek python3 -m bench.bench_eagle", "python examples/eagle.py --model llama"]
    assert split(commands(text)[0]) == ({"EAGLE_MODEL": "deepseek"}, ["-m", "bench.bench_eagle"], [])
    quoted = commands('`python -m bench.sweep_eagle --trees "3,4,8;5,4,10"`')
    assert quoted == ['python -m bench.sweep_eagle --trees "3,4,8;5,4,10"']
    assert split(quoted[0])[2] == ["--trees", "3,4,8;5,4,10"]
    assert commands("run `pytest -q` or `bench/bench_hf.py --tiny`") == []


def test_the_page_scan_finds_each_kind_and_passes_clean_text():
    bad = ["source: results/2026-12-01/s6/topk.md", "Target (#12): <= 2.0 s", "fixed in issue #7",
           "command: `/opt/torch/.venv/bin/python3 x.py`", "with an uncommitted change", "see s15f/mla.md"]
    for line in bad:
        assert unwanted(line), f"not flagged: {line!r}"
    clean = ["SGLang #25529 and vLLM #123 are upstream", "a [#](anchor) link", "bs 16: 2.32x", "ratio 0.32 (11.9 s / 37.6 s)",
             "command (repo root): `python -m bench.bench_topk`", "3.06 ms at s=16"]
    for line in clean:
        assert not unwanted(line), f"flagged: {line!r}: {unwanted(line)}"
