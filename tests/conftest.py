"""Fixtures shared by the test modules (constants and plain helpers: helpers.py; hand-built graphs: ir_fixtures.py).

Tiers: ``pytest -m "not slow"`` runs the fast tier (single process); plain ``pytest`` runs everything, including the
tests marked ``slow``: torchrun / gloo launches, GPT-3 175B, the Megatron-LM calibration, and anything else over
about 10 s. .ci/run adds ``-n 2 --dist loadfile`` (pytest-xdist: two workers, a module's tests on one of them).

Processes: each test process has a fork server (zygote.py) with torch and partc imported once. `helpers.run_jobs`
and `helpers.launch` fork their ranks from it, with torchrun's environment and store, instead of starting
torchrun; `helpers.run_in_session` forks ``python -m`` commands from it (`partc run` then starts real torchrun
ranks). Tests of a fresh interpreter (hash seeds, what an import prints) use plain subprocesses.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import EXAMPLES, HF_MODELS, CheckProcesses, compile_program, trace_file, write_hf_model
from trace_memo import memoized


HEAVY_FIRST = ("test_sequence_parallel", "test_context_parallel", "test_runtime_safety", "test_search", "test_check",
               "test_expert_parallel", "test_runtime_tp", "test_tp_rewrite", "test_user_models", "test_calibration",
               "test_runtime_dist", "test_data", "test_compile", "test_precision", "test_zoo_dist", "test_moe",
               "test_compile_safety", "test_cli", "test_zoo", "test_codegen", "test_rebatch", "test_report",
               "test_vocab_loss", "test_runtime_init")
"""The modules that take longest (torchrun launches, `partc run`, `partc check`, the search's brute force), longest
first (the sum of each module's test durations under .ci/run; the fast tier's longest, test_search, among them):
under xdist they start first, and the short modules fill in around them."""


def pytest_configure(config):
    if config.getoption("dist", "no") == "loadfile":  # the xdist controller: hand out the modules in our order
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (.ci/run: ``-n 2 --dist loadfile``) a module's tests go to one worker together, so its
    module-scoped fixtures (compiled programs, a torchrun launch of many jobs) are built once, and the modules of
    `HEAVY_FIRST` are handed out first: each worker collects in this order, and the controller keeps it
    (``loadscopereorder`` off, `pytest_configure`). Not ``--dist loadfile``: pytest 9.2 derives ``Item.nodeid``
    from the item's structured id, and pytest-xdist 3.8 groups by a suffix it writes into the old ``_nodeid``, which
    no longer reaches the controller: each module's tests were spread over both workers, building its fixtures
    twice."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: the rest as collected


@pytest.fixture(scope="session", autouse=True)
def _trace_once_per_model():
    """`compile_model` traces each distinct model once per session (per test process under xdist): most of a tiny
    model's compile is torch.export, and the tests compile the same models under many plans (`trace_memo`)."""
    import partc.compile

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(partc.compile, "trace", memoized(partc.compile.trace))
        yield


@pytest.fixture(scope="session", autouse=True)
def _check_processes_for_the_session():
    """`partc check` in the tests spawns its processes once a session, not once a check (`helpers.CheckProcesses`)."""
    import partc.runtime.check

    processes = CheckProcesses()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(partc.runtime.check, "_processes", processes)
        yield
    processes.close()


@pytest.fixture(scope="session", autouse=True)
def _fork_server_for_the_session():
    """The launches of `helpers.run_jobs` fork their ranks from one server a test process (zygote.py), started on
    the first launch; it leaves with the session."""
    import helpers

    yield
    helpers.ZYGOTE.close()


@pytest.fixture(autouse=True)
def _tiny_examples(monkeypatch):
    """examples/gpt.py and examples/llama.py at their tiny size, whatever the environment says (a test may still
    set PARTC_GPT_SIZE / PARTC_LLAMA_SIZE itself)."""
    monkeypatch.delenv("PARTC_GPT_SIZE", raising=False)
    monkeypatch.delenv("PARTC_LLAMA_SIZE", raising=False)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A directory holding every tiny Hugging Face model file of helpers.HF_MODELS, as hf_NAME.py."""
    d = tmp_path_factory.mktemp("hf_models")
    for name in HF_MODELS:
        write_hf_model(d, name)
    return d


@pytest.fixture(scope="session")
def traced_example():
    """NAME -> (spec, Traced) of examples/NAME.py at its tiny size, traced once per session as compile_model traces
    it. Tests only read the result."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            with pytest.MonkeyPatch.context() as mp:
                mp.delenv("PARTC_GPT_SIZE", raising=False)
                mp.delenv("PARTC_LLAMA_SIZE", raising=False)
                cache[name] = trace_file(EXAMPLES / f"{name}.py")
        return cache[name]

    return get


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """``compiled(model, **kwargs)``: `helpers.compile_program`'s output directory for these arguments, compiled
    once per session (per test process under xdist) and shared by every module that asks for the same program.
    Tests only read it (a test that edits a program copies it first)."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("compiled")

    def get(model, **kwargs) -> Path:
        path = str(model) if str(model).endswith(".py") else str(EXAMPLES / f"{model}.py")
        key = repr((path, sorted(kwargs.items())))  # a tp_styles function by its identity
        if key not in cache:
            out = root / f"program-{len(cache):04d}"  # no name a prefix of another (tests find processes by it)
            with pytest.MonkeyPatch.context() as mp:  # at the examples' tiny size, as every test sees them
                mp.delenv("PARTC_GPT_SIZE", raising=False)
                mp.delenv("PARTC_LLAMA_SIZE", raising=False)
                compile_program(path, out, **kwargs)
            cache[key] = out
        return cache[key]

    return get
