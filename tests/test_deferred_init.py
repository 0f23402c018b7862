"""Deferred initialization (partc/deferred_init.py, runtime/materialize.py): a model built on meta starts from what
its own construction gives each tensor, computed for any part of it, on one process. The multi-process runs are in
test_runtime_init.py."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn.init import trunc_normal_ as bound_trunc_normal_

from partc._torch import TorchDispatchMode
from partc.cli.main import main as cli
from partc.deferred_init import record
from partc.init_replay import seed_of
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.runtime.materialize import build_initialized, build_model, check_initializable, init_weights, materialize

from helpers import EXAMPLES, model_file

PLAIN = Path(__file__).resolve().parent / "plain_init.py"
CPU = torch.device("cpu")
INIT_FUNCTIONS = (nn.init._no_grad_trunc_normal_, nn.init.orthogonal_)


def _replay(init, names, seed: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    init.replay(names, CPU, seed, lambda n, v: out.__setitem__(n, v.clone()))
    return out


def _plain_spec(cls):
    return SimpleNamespace(build=cls)


# -- a plain model's own values ----------------------------------------------------------------------------------


def test_plain_model_starts_from_what_its_init_gives():
    """Ones, zeros, constants, a table from arange / sin / cos and a buffer from torch.tensor are exact; scaled
    randn and nn.Linear's init have their distributions; a parameter derived from another is derived from it."""
    import plain_init

    spec = load_model_file(str(PLAIN))
    model, init = build_model(spec)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]) and not init.problems
    got = build_initialized(spec, seed=0).state_dict()
    eager = plain_init.Plain().state_dict()
    assert list(got) == list(eager)
    for k in ("pos", "gate", "temperature", "norm.weight", "blocks.0.norm.weight", "blocks.0.gate",
              "blocks.1.alpha"):
        assert torch.equal(got[k], eager[k]), k
    assert torch.equal(got["blocks.0.norm.weight"], torch.ones(32)) and got["blocks.1.alpha"].eq(0.1).all()
    assert got["tok"].std().item() == pytest.approx(0.02, rel=0.1)
    norms = got["tok"].norm(dim=1)
    assert torch.equal(got["scale"], norms / norms.mean())
    bound = 1 / math.sqrt(32)  # nn.Linear: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    w = got["blocks.0.fc1.weight"]
    assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    other = build_initialized(spec, seed=1).state_dict()
    assert not torch.equal(other["tok"], got["tok"]) and torch.equal(other["pos"], got["pos"])


def test_a_part_replays_to_the_values_of_the_whole():
    """What a pipeline stage or a tensor-parallel group replays alone equals the whole model's values."""
    _, init = record(load_model_file(str(PLAIN)).build)
    whole = _replay(init, list(init.tensors), seed=5)
    for part in (["scale"], ["blocks.1.fc2.weight", "gate"], ["tok"]):
        for k, v in _replay(init, part, seed=5).items():
            assert torch.equal(v, whole[k]), k


def test_random_fills_are_seeded_by_the_name_of_the_tensor_they_fill():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.w = nn.Parameter(torch.empty(4, 3))
            nn.init.normal_(self.w[:2])
            nn.init.normal_(self.w[2:])

    _, init = record(M)
    got = _replay(init, ["lin.weight", "w"], seed=9)
    gen = torch.Generator().manual_seed(seed_of(9, "lin.weight"))
    assert torch.equal(got["lin.weight"], torch.empty(3, 4).uniform_(-0.5, 0.5, generator=gen))
    top = torch.empty(2, 3).normal_(generator=torch.Generator().manual_seed(seed_of(9, "w")))
    rest = torch.empty(2, 3).normal_(generator=torch.Generator().manual_seed(seed_of(9, "w@6")))
    assert torch.equal(got["w"], torch.cat([top, rest]))  # a fill of part of a tensor: seeded by its offset


def test_normal_on_meta_is_recorded_without_its_meta_kernel_and_checked():
    """The record skips `normal_`'s meta kernel (a slow Python decomposition) but keeps its check and its step: the
    replay draws the same values, a negative std fails as PyTorch says, and an integer tensor gets PyTorch's own
    error."""
    class M(nn.Module):
        def __init__(self, std: float = 0.5, dtype=torch.float32):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 2, dtype=dtype), requires_grad=dtype.is_floating_point)
            with torch.no_grad():
                self.w.normal_(1.0, std)

    _, init = record(M)
    got = _replay(init, ["w"], seed=3)["w"]
    want = torch.empty(3, 2).normal_(1.0, 0.5, generator=torch.Generator().manual_seed(seed_of(3, "w")))
    assert torch.equal(got, want)
    for bad in (lambda: M(std=-1.0), lambda: M(dtype=torch.int64)):
        with torch.device("meta"), pytest.raises(RuntimeError) as plain:
            bad()
        with pytest.raises(RuntimeError) as recorded:
            record(bad)
        assert str(recorded.value) == str(plain.value)
        assert "std >= 0.0, but found std -1.0" in str(plain.value) or "floating-point" in str(plain.value)


def test_values_from_data_and_outside_tensors():
    """torch.tensor / as_tensor / new_tensor of Python or NumPy data, from_numpy and legacy constructors keep
    their values, also copied into a parameter; a real tensor the build changes later is copied first."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
            self.b = nn.Parameter(torch.as_tensor(np.arange(3, dtype=np.float32)) * 2)
            self.c = nn.Parameter(self.a.new_tensor([[0.5], [0.25]]))
            self.d = nn.Parameter(torch.FloatTensor([7.0, 8.0]))
            t = torch.from_numpy(np.ones(2, dtype=np.float32))
            self.e = nn.Parameter(t * 1)
            t.mul_(3)  # after e was made from it
            self.f = nn.Parameter(t + 0)
            self.register_buffer("ids", torch.tensor([3, 1, 2]))
            self.g = nn.Parameter(torch.zeros(3, 2))
            self.g.data[self.ids - 1, 0] = torch.tensor([1.0, 2.0, 3.0])
            self.h = nn.Parameter(torch.empty(2))
            self.h.data.copy_(torch.from_numpy(np.array([4.0, 5.0], dtype=np.float32)))

    got = build_initialized(_plain_spec(M), seed=0).state_dict()
    want = M().state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype, k


def test_init_functions_that_skip_meta_are_recorded():
    """nn.init.trunc_normal_ / orthogonal_ / dirac_ return early on meta: partc runs them whole on replay."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Parameter(torch.empty(64, 8))
            nn.init.trunc_normal_(self.t, std=1.0, a=-0.5, b=0.5)
            self.o = nn.Parameter(torch.empty(4, 6))
            nn.init.orthogonal_(self.o)
            self.conv = nn.Conv1d(3, 3, 3)
            nn.init.dirac_(self.conv.weight)
            self.bound = nn.Parameter(torch.zeros(4, 4))
            bound_trunc_normal_(self.bound, std=0.02)  # imported before the build

    _, init = record(M)
    got = _replay(init, ["t", "o", "conv.weight", "bound"], seed=2)
    assert got["bound"].std().item() == pytest.approx(0.02, rel=0.5)
    assert got["t"].abs().max() <= 0.5 and got["t"].std() > 0.2
    gen = torch.Generator().manual_seed(seed_of(2, "t"))
    assert torch.equal(got["t"], nn.init.trunc_normal_(torch.empty(64, 8), std=1.0, a=-0.5, b=0.5, generator=gen))
    assert torch.allclose(got["o"] @ got["o"].T, torch.eye(4), atol=1e-5)
    assert torch.equal(got["conv.weight"], nn.init.dirac_(torch.empty(3, 3, 3)))
    assert (nn.init._no_grad_trunc_normal_, nn.init.orthogonal_) == INIT_FUNCTIONS  # restored after the build


# -- what cannot be reproduced -------------------------------------------------------------------------------------

OUTSIDE = torch.ones(3, device="meta")  # made before the build: partc never saw its values


def test_problems_are_named_and_stop_a_run_without_a_checkpoint():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.unset = nn.Parameter(torch.empty(3))
            self.outside = nn.Parameter(OUTSIDE * 2)
            self.register_buffer("scratch", torch.empty(4))
            self.zero = nn.Parameter(torch.empty(0))
            self.overwritten = nn.Parameter(OUTSIDE.clone())
            nn.init.zeros_(self.overwritten)  # its earlier values do not matter

    model, init = record(M)
    assert list(init.problems) == ["unset", "outside", "scratch"]
    assert init.problems["unset"].startswith("never set") and "outside" in init.problems["outside"]
    with pytest.raises(PartcError, match=r"parameter unset and 1 more \(never set.*pass --init-checkpoint"):
        check_initializable(init, ["lin.weight", "unset", "outside"])
    check_initializable(init, ["lin.weight", "scratch", "zero"])  # a buffer may start uninitialized


def test_reset_parameters_sets_what_nothing_else_does():
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))  # set by reset_parameters(), which __init__ does not call

        def reset_parameters(self):
            nn.init.ones_(self.weight)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Norm()
            self.lin = nn.Linear(3, 3)
            nn.init.zeros_(self.lin.weight)  # a zero-initialized projection: reset_parameters() must not undo it

    _, init = record(M)
    assert not init.problems
    got = _replay(init, ["norm.weight", "lin.weight"])
    assert torch.equal(got["norm.weight"], torch.ones(3)) and torch.equal(got["lin.weight"], torch.zeros(3, 3))


def test_an_initializer_that_fails_on_meta_is_noted():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.v = nn.Parameter(torch.ones(3))

        def init_weights(self):
            nn.init.zeros_(self.w)
            if self.v.sum() > 0:  # reads a value: impossible on meta
                nn.init.zeros_(self.v)

    _, init = record(M)
    assert len(init.notes) == 1 and "failed on the meta device (test_deferred_init.py:" in init.notes[0]
    assert "keeps the value __init__ gives it" in init.notes[0]
    got = _replay(init, ["w", "v"])
    assert torch.equal(got["w"], torch.zeros(3)) and torch.equal(got["v"], torch.ones(3))


def test_compile_warns_by_name(tmp_path):
    path = tmp_path / "unset.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
                self.bias = nn.Parameter(torch.empty(8))

            def forward(self, x):
                return self.lin(x) + self.bias

        def model():
            return M()

        def example_inputs(b):
            return (torch.randn(b, 8),)

        def example_targets(b):
            return torch.randint(0, 8, (b,))
    """))
    res = CliRunner().invoke(cli, ["compile", str(path), "--gpus", "1", "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert ("warning: partc cannot reproduce the initial value of parameter bias (never set: its memory comes "
            "from torch.empty and nothing in the model's construction or initializers writes it); a run without "
            "--init-checkpoint FILE stops") in res.output
    ok = CliRunner().invoke(cli, ["compile", str(EXAMPLES / "gpt.py"), "--gpus", "1", "-o", str(tmp_path / "g")])
    assert ok.exit_code == 0 and "warning" not in ok.output


# -- the bundled examples and Hugging Face models keep their initialization -------------------------------------


class _SeedFills(TorchDispatchMode):
    """partc's initialization before it recorded the build (materialize.SeedPerTensor): every in-place random
    fill of a named tensor with a generator seeded by ``seed_of(seed, name)``."""

    def __init__(self, tensors: dict[str, torch.Tensor], seed: int):
        super().__init__()
        self.seed = seed
        self.names = {t.untyped_storage().data_ptr(): n for n, t in tensors.items() if t.numel()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.overloadpacket.__name__.endswith("_") and "generator" in [a.name for a in func._schema.arguments]:
            t = args[0]
            name = self.names.get(t.untyped_storage().data_ptr())
            if name is not None:
                key = name if t.storage_offset() == 0 else f"{name}@{t.storage_offset()}"
                kwargs["generator"] = torch.Generator().manual_seed(seed_of(self.seed, key))
        return func(*args, **kwargs)


def _initialized_as_before(spec, seed: int) -> dict[str, torch.Tensor]:
    """Allocate the model, then run its model-wide initializer alone, as partc did before deferred init."""
    import transformers

    with torch.device("meta"):
        model = spec.build()
    model.to_empty(device="cpu")
    hf = isinstance(model, transformers.PreTrainedModel)
    if hf:
        model.tie_weights()
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    with torch.no_grad(), _SeedFills(tensors, seed):
        if hf:
            def visit(module, init):
                for child in module.children():
                    visit(child, child._init_weights if isinstance(child, transformers.PreTrainedModel) else init)
                init(module)
            visit(model, model._init_weights)
        else:
            model.init_weights()
    return model.state_dict()


@pytest.mark.parametrize("name", ["gpt", "llama", "hf_gpt2", "hf_llama", "hf_bert", "hf_vit"])
def test_examples_and_hf_models_keep_their_initialization(name, hf_dir):
    spec = load_model_file(model_file(name, hf_dir))
    got = build_initialized(spec, seed=3).state_dict()
    want = _initialized_as_before(spec, seed=3)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


# -- the runtime's pieces ----------------------------------------------------------------------------------------


def test_init_checkpoint_buffers_the_file_lacks_are_replayed():
    from partc.runtime.materialize import load_weights

    spec = load_model_file(str(PLAIN))
    model, init = build_model(spec)
    tensors = materialize(model, [n for n, _ in [*model.named_parameters(), *model.named_buffers()]], CPU)
    state = {k: torch.full_like(v, 3.0) for k, v in build_initialized(spec, seed=0).state_dict().items()}
    del state["temperature"]
    unset = load_weights(tensors, {}, state, where="x.pt", buffers={"temperature"})
    assert unset == ["temperature"]
    init_weights(init, {n: tensors[n] for n in unset}, seed=0)
    assert model.temperature.item() == 2.0 and model.tok.eq(3.0).all()
