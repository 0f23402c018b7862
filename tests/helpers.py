"""What several test modules share: paths, the tiny Hugging Face model files, Megatron's TP map, and helpers that
trace a model file, load a generated stage file and launch torchrun. The fixtures built on them are in conftest.py;
the hand-built `ModelGraph`s are in ir_fixtures.py."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from partc.model_file import build_on_meta, load_model_file
from partc.mesh_axes import AXES, MESH_AXES
from partc.passes.tp import MEGATRON_VOCAB, megatron_style  # noqa: F401 (re-exported)
from partc.passes.trace import trace
from zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"
GiB = 1024**3

# --- model files -----------------------------------------------------------------------------------------------

HF_MODELS = {
    "gpt2": """
        from transformers import GPT2Config, GPT2LMHeadModel

        def model():
            return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                                              bos_token_id=511, eos_token_id=511, resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0))
    """,
    "llama": """
        from transformers import LlamaConfig, LlamaForCausalLM

        def model():
            return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=128))
    """,
    "bert": """
        from transformers import BertConfig, BertForMaskedLM

        def model():
            return BertForMaskedLM(BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, intermediate_size=128,
                                              max_position_embeddings=128, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0))
    """,
    "vit": """
        from transformers import ViTConfig, ViTForImageClassification

        def model():
            return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       intermediate_size=128, num_labels=10,
                                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    """,
}
"""Tiny Hugging Face models in files that define only ``model()``: partc synthesizes the inputs (``input_ids``, or
``pixel_values`` for ViT). Two layers, h 64, 4 heads (LLaMA: 2 KV heads), at most 128 positions; dropout off, so a
program can be compared with one process exactly."""


HF_EXPERT_MODELS = {
    "mixtral": """
        from transformers import MixtralConfig, MixtralForCausalLM

        def model():
            return MixtralForCausalLM(MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, num_local_experts=4,
                                                    num_experts_per_tok=2, max_position_embeddings=128))
    """,
}
"""Tiny mixtures of experts, as `HF_MODELS` (4 experts, top 2, intermediate 96): kept apart, so that the tests
compiling every Hugging Face model do not compile them too."""


def write_hf_model(directory: Path, name: str) -> str:
    """HF_MODELS[name] (or HF_EXPERT_MODELS[name]) as DIRECTORY/hf_NAME.py; returns the path."""
    path = Path(directory) / f"hf_{name}.py"
    path.write_text(textwrap.dedent({**HF_MODELS, **HF_EXPERT_MODELS}[name]))
    return str(path)


def model_file(case: str, hf_dir: Path) -> str:
    """examples/CASE.py, or for ``hf_NAME`` that examples/ lacks the tiny Hugging Face model NAME in `hf_dir`."""
    path = EXAMPLES / f"{case}.py"
    if path.exists():
        return str(path)
    path = Path(hf_dir) / f"{case}.py"
    assert case.startswith("hf_") and path.exists(), f"no model file for case {case!r}"
    return str(path)


def trace_file(path, **load_kwargs):
    """(spec, Traced) of a model file, as compile_model traces it: one sample of meta inputs."""
    spec = load_model_file(str(path), **load_kwargs)
    model = build_on_meta(spec)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    return spec, trace(model, args, kwargs, name=spec.name, seq_len=spec.seq_len, path=str(path))


def load_stage(path: Path):
    """A generated stage_K.py as a module (a fresh one per call)."""
    spec = importlib.util.spec_from_file_location(f"stage_{path.stem}_{id(path)}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- compiling ---------------------------------------------------------------------------------------------------


def compile_program(model: str | Path, out: Path, *, global_batch_size: int | None = None, gpus: int | None = None,
                    seq_len: int | None = None, tp_styles=None, cluster="a100-80g", vocab_parallel_loss: bool = True,
                    **pins):
    """Compile a model file (a path, or the name of an examples/ file) into `out` with exactly the given `Pins`
    fields (``tp=2, pp=2, micro_batch_size=1, schedule="1f1b", precision="fp32"``...: what is not given is
    searched); `gpus` defaults to the product of the pinned mesh degrees. With `tp_styles` the tp map is then set
    in plan.json by hand and that file compiled again with ``--from-plan``, as a user would: a dict updates the
    solver's map, a function ``(fqn, solver's style) -> style`` rewrites every entry. Returns the last
    `CompileResult` (the program is in `out`). `cluster`: a preset name or a `Cluster`; `vocab_parallel_loss`: as
    `compile_model`'s (False: a colwise head's logits are gathered)."""
    from partc.compile import compile_model
    from partc.mesh_axes import MESH_AXES
    from partc.parallel import Pins

    path = str(model) if Path(str(model)).suffix == ".py" else str(EXAMPLES / f"{model}.py")
    out = Path(out)
    gpus = gpus or math.prod(pins.get(axis) or 1 for axis in MESH_AXES)
    result = compile_model(path, gpus=gpus, pins=Pins(**pins), global_batch_size=global_batch_size,
                           seq_len=seq_len, out_dir=out, cluster=cluster, vocab_parallel_loss=vocab_parallel_loss)
    if tp_styles is not None:
        plan = json.loads((out / "plan.json").read_text())
        if callable(tp_styles):
            plan["tp"] = {fqn: tp_styles(fqn, style) for fqn, style in plan["tp"].items()}
        else:
            plan["tp"].update(tp_styles)
        edited = out.parent / f"{out.name}.plan.json"
        edited.write_text(json.dumps(plan, indent=2))
        result = compile_model(path, gpus=gpus, from_plan=str(edited), seq_len=seq_len, out_dir=out,
                               vocab_parallel_loss=vocab_parallel_loss)
    return result


# --- tensor parallelism ----------------------------------------------------------------------------------------

# Megatron-LM's map by layer name lives with the solver (`partc.passes.tp.megatron_style`); these names stay for
# the test modules that import them from here.
VOCAB = MEGATRON_VOCAB["rowwise"]


# --- torchrun ---------------------------------------------------------------------------------------------------

LAUNCH_TIMEOUT_S = 240


ZYGOTE = Zygote()
"""This test process's fork server (zygote.py), started on the first `launch` (conftest.py closes it)."""


def run_in_session(what: str, cmd: list[str], *, env: dict | None, timeout: float, stderr_apart: bool = False,
                   cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`cmd` (`what`, for the failure) in its own session, so a hang kills every process it started (not only the
    first), with one thread a process; the test fails after `timeout` seconds. stderr joins stdout unless
    `stderr_apart`; in `cwd` (default: the current directory). A ``python -m MODULE`` command is forked from the
    fork server (zygote.py), which has torch and partc imported: the process then starts what it starts
    (torchrun's agent, its ranks) as it would from a fresh interpreter."""
    if cmd[0] == sys.executable and cmd[1] == "-m" and os.environ.get("PARTC_TEST_LAUNCHER") != "torchrun":
        res = ZYGOTE.run(cmd[1:], env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout,
                         join=not stderr_apart, cwd=cwd)
        if res["timed_out"]:
            tail = f"{res['stdout'][-3000:]}\n{res['stderr'][-3000:]}" if stderr_apart else res["stdout"][-5000:]
            pytest.fail(f"{what} timed out after {timeout}s:\n{tail}")
        return subprocess.CompletedProcess(cmd, res["returncode"], res["stdout"], res["stderr"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = f"{out[-3000:]}\n{err[-3000:]}" if stderr_apart else out[-5000:]
        pytest.fail(f"{what} timed out after {timeout}s:\n{tail}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")


def torchrun(nproc: int, args: list[str], *, env: dict | None = None, check: bool = True,
             timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """torchrun in its own session, so a hang kills every rank (not only the launcher)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    res = run_in_session("torchrun", cmd, env=env, timeout=timeout)
    if check and res.returncode != 0:
        pytest.fail(f"torchrun exited with {res.returncode}:\n{res.stdout[-8000:]}")
    return res


def launch(nproc: int, args: list[str], *, env: dict | None = None, check: bool = True,
           timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`nproc` ranks of ``python ARGS`` forked from this process's fork server (zygote.py) with torchrun's
    environment and store, as `torchrun` would run them, without a launcher process or an interpreter start and
    torch import per rank: for tests of what the ranks compute. A test of torchrun's own behaviour (its error
    file, its summary) uses `torchrun`. With ``PARTC_TEST_LAUNCHER=torchrun`` in the environment, this is
    `torchrun` (the same ranks, the same assertions: to compare)."""
    if os.environ.get("PARTC_TEST_LAUNCHER") == "torchrun":
        return torchrun(nproc, args, env=env, check=check, timeout=timeout)
    res = ZYGOTE.launch(nproc, args, env=env, timeout=timeout)
    if res["timed_out"]:
        pytest.fail(f"launch of {nproc} ranks timed out after {timeout}s:\n{res['output'][-5000:]}")
    if check and res["returncode"] != 0:
        pytest.fail(f"launch of {nproc} ranks failed (exit codes by rank {res['exits']}):\n{res['output'][-8000:]}")
    return subprocess.CompletedProcess(["launch", str(nproc), *args], res["returncode"], res["output"], "")


def llama_variant(path: Path, config: str, *, targets: bool = False) -> Path:
    """Write at `path` a model file of examples/llama.py at another size: `config` is its `LlamaConfig`'s keyword
    arguments as text; `targets` adds `example_targets`."""
    text = f"""
import importlib.util
import sys

import torch

_spec = importlib.util.spec_from_file_location("partc_example_llama_{path.stem}", {str(EXAMPLES / "llama.py")!r})
llama = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = llama
_spec.loader.exec_module(llama)
C = llama.LlamaConfig({config})


def model():
    return llama.Llama(C)


def example_inputs(batch_size):
    return (torch.randint(0, C.vocab_size, (batch_size, C.seq_len)),)
"""
    if targets:
        text += """

def example_targets(batch_size):
    return torch.randint(0, C.vocab_size, (batch_size, C.seq_len))
"""
    path.write_text(text + "\n\nloss_fn = llama.loss_fn\n")
    return path


def run_jobs(nproc: int, jobs: list[dict], tmp: Path) -> None:
    """Run `partc.runtime.testing` jobs in one launch of `nproc` ranks (`launch`)."""
    path = tmp / f"jobs_{nproc}.json"
    path.write_text(json.dumps(jobs))
    launch(nproc, ["-m", "partc.runtime.testing", str(path)])


class CheckProcesses:
    """Processes for `partc.runtime.check.check_program` kept for the session (conftest.py swaps them in
    for ``partc.runtime.check._processes``): a check process imports torch and partc's runtime (about 4 CPU
    seconds) before it checks a tiny program's ranks in about as long. A process checks one rank after another
    whatever the test, as it does within one `check_program` call; each submitted check runs under the caller's
    PARTC_* environment (the model files read their size from it)."""

    def __init__(self):
        self.pools: dict[int, object] = {}

    def __call__(self, workers: int):
        import concurrent.futures
        import multiprocessing

        pool = self.pools.get(workers)
        if pool is None or getattr(pool, "_broken", False):  # a process died: start them again
            # Forked from multiprocessing's fork server, which imports partc's check once (it runs no torch
            # operation itself): fresh processes, as check_program's spawned ones, without an import each.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["partc.runtime.check", "helpers"])
            pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
            self.pools[workers] = pool
        env = {n: v for n, v in os.environ.items() if n.startswith("PARTC_")}

        class Shared:  # check_program's `with ... as pool: pool.submit(...)`, leaving the processes running
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def submit(self, fn, *args):
                return pool.submit(_under_environment, env, fn, *args)

        return Shared()

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        if self.pools:  # and the fork server, waited for (so its CPU time counts in this process's children's)
            import multiprocessing.forkserver

            multiprocessing.forkserver._forkserver._stop()
        self.pools.clear()


def _under_environment(env: dict, fn, *args):
    """fn(*args) with exactly the PARTC_* variables of `env` (in a `CheckProcesses` process)."""
    saved = {n: v for n, v in os.environ.items() if n.startswith("PARTC_")}
    for n in saved:
        del os.environ[n]
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for n in [n for n in os.environ if n.startswith("PARTC_")]:
            del os.environ[n]
        os.environ.update(saved)


_REFERENCES: list = []


def reference_once(model_path, init: dict, **kwargs):
    """`partc.runtime.testing.reference_run` of `model_path` from the state dict `init` with `kwargs`, run once a
    test process for equal arguments: configurations that build the model under one seed start from one state, and
    their one-process reference is the same. Callers only read the result."""
    from partc.runtime.testing import reference_run

    key = (str(model_path), repr(sorted(kwargs.items())))
    for (k, i), result in _REFERENCES:
        if k == key and list(i) == list(init) and all(torch.equal(i[n], init[n]) for n in init):
            return result
    result = reference_run(str(model_path), init, **kwargs)
    _REFERENCES.append(((key, init), result))
    return result


def assert_close_states(got: dict, want: dict, *, rtol: float = 1e-5, atol: float = 0.0) -> None:
    assert list(got) == list(want), "the gathered state dict must have the model's keys, in order"
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape and g.dtype == w.dtype, k
        err = (g.double() - w.double()).norm().item()
        assert err <= rtol * w.double().norm().item() + atol * w.numel() ** 0.5, f"{k}: |diff| {err:.3g}"


def assert_close_losses(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rtol * abs(w), (got, want)


def assert_comm_matches_plan(out: Path, comm: list[list[dict]], rtol: float = 0.02,
                             axes: tuple[str, ...] | None = None) -> int:
    """Every rank's measured collective payload of every step (`partc.runtime.testing`'s ``comm``) equals the
    plan's ``predicted.ranks[pp_rank].comm_bytes`` within `rtol`, axis by axis (`axes`: every axis the plan has, a
    sub-axis in use too, `partc.mesh_axes.AXES`); returns how many bytes were checked (so a caller can assert there
    was traffic)."""
    plan = json.loads((Path(out) / "plan.json").read_text())
    par, ranks = plan["parallel"], plan["predicted"]["ranks"]
    checked = 0
    for step in comm:
        for rank, measured in enumerate(step):
            want = ranks[rank // (math.prod(par.get(a, 1) for a in MESH_AXES) // par["pp"])]["comm_bytes"]
            assert set(measured) <= set(want), (rank, measured)
            for axis in axes or [a.name for a in AXES if a.name in want]:
                got = measured.get(axis, 0)
                assert abs(got - want[axis]) <= rtol * want[axis], (out, rank, axis, got, want[axis])
                checked += got
    return checked


# One line of the branchy model below: `if y.sum() > 0:` on a tensor (data-dependent control flow).
BRANCHY = """
    import torch
    from torch import nn

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:
                return 2 * y
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.gate = Gate()
            self.head = nn.Linear(8, 16)

        def forward(self, ids):
            return self.head(self.gate(self.emb(ids)))

    def model():
        return Net()

    def example_inputs(batch_size):
        return (torch.randint(0, 16, (batch_size, 4)),)
"""
