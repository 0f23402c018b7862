"""Fixtures shared by the test modules (constants and plain helpers: helpers.py; hand-built graphs: ir_fixtures.py).

Tiers: ``pytest -m "not slow"`` runs the fast tier (single process, a few minutes on two cores); plain ``pytest``
(what .ci/run runs) runs everything, including the tests marked ``slow``: torchrun / gloo launches, GPT-3 175B,
the Megatron-LM calibration, and anything else over about 10 s.
"""

from __future__ import annotations

import pytest

from helpers import EXAMPLES, HF_MODELS, trace_file, write_hf_model


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
