"""Model families a user brings (issue #14), single process: what each fix changes, checked without torchrun.
The multi-process runs against one process are in test_zoo_dist.py."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch

from partc.cluster import PRESETS
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.runtime.api import stage_tensor_names
from partc.runtime.materialize import build_model, canonical_names, init_weights, materialize
from partc.runtime.program import read_program
from partc.runtime.stage import StageModule
from partc.runtime.train import flatten_inputs, global_batch, stage_shapes
from helpers import EXAMPLES, compile_program
from user_models import CLASSES, write_model
from zoo_models import write_zoo_model

CPU = torch.device("cpu")


def _compile(tmp_path, path, *, pp=1, dp=1, zero=0, gbs=4, seq_len=None, name="out", cluster="a100-80g"):
    return compile_program(path, tmp_path / name, global_batch_size=gbs, seq_len=seq_len, cluster=cluster, tp=1,
                           pp=pp, dp=dp, zero=zero, micro_batch_size=1, schedule="1f1b", recompute="none",
                           precision="fp32")  # the families are the subject: fp32 programs equal the fp32 model


# -- 1. pipeline sends of non-contiguous tensors -----------------------------------------------------------------


def test_stage_outputs_are_contiguous_as_sent(tmp_path):
    """RoBERTa's stage 0 hands stage 1 the attention mask expanded from a row (strides 0): the stage module
    returns it dense, and the shapes the receive buffers are made from have dense strides."""
    path = write_zoo_model(tmp_path, "roberta")
    # Without the kernel-launch floor, under which the tiny model's stages balance by kernels: the cut then falls
    # between the blocks, where the mask crosses it.
    _compile(tmp_path, path, pp=2, seq_len=16, cluster=dataclasses.replace(PRESETS["a100-80g"], kernel_launch_s=0.0))
    prog = read_program(tmp_path / "out")
    spec = load_model_file(prog.model_path, seq_len=16)
    m, init = build_model(spec)
    (_, sent), (received, _) = stage_shapes(prog, m, spec)
    assert len(sent) >= 2, "stage 0 sends the mask and the hidden states"
    for t in (*sent, *received):
        assert t.is_contiguous(), (t.shape, t.stride())

    st = prog.stages[0]
    tensors = materialize(m, stage_tensor_names(st, m), CPU)
    init_weights(init, tensors, seed=0)
    args, kwargs, _ = global_batch(spec, 0, 0, 1)
    raw = st.code.forward(StageModule(st, m, canonical_names(m), CPU).tensors(),
                          *flatten_inputs(args, kwargs, prog.input_keys), device=CPU)
    assert not all(t.is_contiguous() for t in raw), "the case this test is about: a view among the outputs"
    out = StageModule(st, m, canonical_names(m), CPU)(*flatten_inputs(args, kwargs, prog.input_keys))
    assert all(t.is_contiguous() for t in out)
    assert all(torch.equal(a, b) for a, b in zip(out, raw))
    assert [t.shape for t in out] == [t.shape for t in sent]


# -- 2. Hugging Face image models in partc run -------------------------------------------------------------------


def test_runtime_keeps_an_image_models_own_inputs(tmp_path):
    """The plan's seq_len of Swin is the tokens per sample the trace saw (a window's patches); the runtime does not
    pass it back as --seq-len (which an image model refuses), while a token model's synthesized length is the
    plan's."""
    from partc.runtime.api import _load_spec

    _compile(tmp_path, write_zoo_model(tmp_path, "swin"), name="swin")
    files = read_program(tmp_path / "swin")
    assert files.plan.model["seq_len"]
    spec = _load_spec(files)
    assert spec.seq_len is None
    with torch.device("meta"):
        assert spec.inputs(2)[1]["pixel_values"].shape == (2, 3, 32, 32)

    clip = load_model_file(write_zoo_model(tmp_path, "clip"))  # the vision tower's config holds image_size
    with torch.device("meta"):
        assert clip.inputs(2)[1]["pixel_values"].shape == (2, 3, 32, 32)

    _compile(tmp_path, write_zoo_model(tmp_path, "opt"), seq_len=16, name="opt")
    assert _load_spec(read_program(tmp_path / "opt")).seq_len == 16


# -- 10. an error on a rank other than 0 reaches the user --------------------------------------------------------


@pytest.fixture
def error_store(monkeypatch):
    """torchrun's store, as the ranks of a 2-rank job find it (a fresh one, served by this process)."""
    import torch.distributed as dist
    from partc.runtime import supervise

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv(supervise.LAUNCHER_ENV, raising=False)

    def as_rank(rank: int):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(supervise, "_errors", [])  # each rank is its own process, with its own connection

    yield as_rank
    monkeypatch.setattr(supervise, "_errors", [])


def test_every_ranks_error_line_is_printed_once(error_store, capsys):
    from partc.runtime import supervise

    error_store(1)  # a user error only the last stage sees: printed, though rank 1 is not rank 0
    assert supervise.peer_failure(wait_s=0.0) is None
    supervise.report("cannot find logits in the model's outputs (dict)", kind="user")
    error_store(0)  # rank 0's collective fails because rank 1 left: it names rank 1
    assert supervise.peer_failure(wait_s=0.0) == (1, "cannot find logits in the model's outputs (dict)")
    supervise.report("cannot find logits in the model's outputs (dict)", kind="user")  # the same line: once
    supervise.report("after rank 1 failed: RuntimeError: Connection closed by peer", kind="internal")
    assert capsys.readouterr().err.splitlines() == [
        "error: cannot find logits in the model's outputs (dict)",
        "error: rank 0: after rank 1 failed: RuntimeError: Connection closed by peer"]


# -- 7. the default global batch of a model without tokens -------------------------------------------------------

MLP = """
    import torch
    from torch import nn

    def model():
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 64),)

    def example_targets(batch_size):
        return torch.randint(0, 10, (batch_size,))
"""


def test_default_global_batch():
    from partc.compile import default_global_batch

    assert default_global_batch(8, None) == 1024 and default_global_batch(24, None) == 1032
    assert default_global_batch(4096, None) == 4096  # one sample a GPU at least
    assert default_global_batch(8, 2048) == 1024  # 2M tokens


def test_model_without_tokens_plans_a_realistic_batch_in_samples(tmp_path):
    from click.testing import CliRunner
    from partc.cli.main import main as cli

    path = tmp_path / "mlp.py"
    path.write_text(textwrap.dedent(MLP))
    res = CliRunner().invoke(cli, ["compile", str(path), "--gpus", "8", "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["parallel"]["global_batch_size"] == 1024 and plan["model"]["throughput_unit"] == "samples"
    pred = plan["predicted"]
    assert pred["samples_per_s"] == pytest.approx(1024 / pred["step_time_s"])
    assert f"{pred['samples_per_s']:,.0f} samples/s" in res.output and "tokens/s" not in res.output

    gpt = compile_model(str(EXAMPLES / "gpt.py"), gpus=2)
    assert gpt.plan.model["throughput_unit"] == "tokens"


# -- 3. tensor constants created in forward ----------------------------------------------------------------------


@pytest.mark.parametrize("family,literal", [
    ("falcon", "torch.tensor([-2], dtype=torch.int64, device=device)"),  # made on meta: recomputed on the CPU
    ("deberta", "torch.tensor(16.0, dtype=torch.float32, device=device)"),  # sqrt of the head size, traced
])
def test_tensor_constants_are_carried_as_literals(tmp_path, family, literal):
    """The stage file creates the constant again, and computes what the model computes."""
    from helpers import load_stage

    path = write_zoo_model(tmp_path, family)
    _compile(tmp_path, path, gbs=2, seq_len=16)
    stage = tmp_path / "out" / "program" / "stage_0.py"
    assert literal in stage.read_text()
    spec = load_model_file(path, seq_len=16)
    torch.manual_seed(0)
    model = spec.build().eval()
    args, kwargs, _ = global_batch(spec, 0, 0, 1)
    prog = read_program(tmp_path / "out")
    p = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    with torch.no_grad():
        (got,) = load_stage(stage).forward(p, *flatten_inputs(args, kwargs, prog.input_keys), device=CPU)
        want = model(*args, **kwargs).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_large_constant_is_refused(tmp_path):
    path = write_model(tmp_path / "big_constant.py", """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                return self.lin(x) + torch.tensor([0.5] * 5000).sum()
    """)
    with pytest.raises(PartcError, match=r"creates a tensor constant of 5,000 elements .* register it as a buffer"):
        _compile(tmp_path, str(path), gbs=2)


# -- 6. unit order follows data flow; the search offers only cuts codegen can make -------------------------------

SHARED = """
    class Net(nn.Module):  # b runs twice, the second time on c's output: no stage boundary between b and c
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 256)
            self.b = nn.Linear(256, 256)
            self.c = nn.Linear(256, 256)
            self.d = nn.Linear(256, 8)

        def forward(self, x):
            return self.d(self.b(self.c(self.b(self.a(x)))))
"""


def test_units_follow_data_flow(tmp_path):
    """Whisper's encoder permutes the conv output (glue, which goes with layers.0) before it adds
    embed_positions: embed_positions still comes first, and every pipeline split compiles."""
    from helpers import trace_file

    path = write_zoo_model(tmp_path, "whisper")
    _, traced = trace_file(path)
    units = [u.fqn for u in traced.graph.units]
    assert units.index("model.encoder.embed_positions") < units.index("model.encoder.layers.0")
    assert all(traced.graph.cut_ok)
    for pp in (2, 4):
        _compile(tmp_path, path, pp=pp, name=f"pp{pp}")


def test_search_offers_only_cuts_the_program_can_make(tmp_path):
    from helpers import trace_file

    path = write_model(tmp_path / "shared.py", SHARED, targets=CLASSES)
    _, traced = trace_file(path)
    assert [u.fqn for u in traced.graph.units] == ["a", "b", "c", "d"]
    assert traced.graph.cut_ok == [True, False, True]
    for pp in (2, 3):  # the balanced split of pp 2 would cut between b and c
        result = _compile(tmp_path, str(path), pp=pp, name=f"pp{pp}")
        assert all(traced.graph.cut_ok[hi - 1] for _, hi in result.best.bounds[:-1])
    plan = json.loads((tmp_path / "pp2" / "plan.json").read_text())
    plan["stages"][0]["modules"], plan["stages"][1]["modules"] = ["a", "b"], ["c", "d"]
    (tmp_path / "edited.json").write_text(json.dumps(plan))
    with pytest.raises(PartcError, match=r"^stage 0 cannot end at b: an op before that boundary reads one after "
                                         r"it; move the boundary$"):
        compile_model(str(path), gpus=2, from_plan=str(tmp_path / "edited.json"))


# -- 9. BatchNorm ------------------------------------------------------------------------------------------------


def test_batch_norm_traces_one_sample_and_trains_on_two_or_more(tmp_path):
    """ResNet on 8 x 8 images: its last BatchNorms see one value per channel in a sample. The trace (one sample on
    meta) works; plans keep micro-batches of two samples or more; the statistics' scope is stated."""
    path = write_zoo_model(tmp_path, "resnet")
    with pytest.raises(PartcError, match=r"^BatchNorm resnet\.encoder\.stages\.1\..*normalization sees one value "
                                         r"per channel in a sample: it cannot train on micro-batches of 1 sample"):
        _compile(tmp_path, path, dp=2, gbs=8, name="mb1")  # _compile pins micro-batches of 1
    result = compile_model(path, gpus=2, pins=Pins(dp=2), global_batch_size=8, out_dir=tmp_path / "dp2")
    par = result.plan.parallel
    assert par.dp == 2 and par.micro_batch_size >= 2
    bn = [w for w in result.warnings if w.startswith("BatchNorm statistics")]
    assert bn == [f"BatchNorm statistics (6 layers, resnet.embedder.embedder.normalization first) are computed "
                  f"over each micro-batch of {par.micro_batch_size} samples on each of 2 data-parallel ranks, not "
                  f"over the global batch of 8: the loss differs from one process's on the whole batch (partc does "
                  f"not offer SyncBatchNorm)"]
    plan = json.loads((tmp_path / "dp2" / "plan.json").read_text())
    assert plan["model"]["batch_norm"] == {"layers": 6, "statistics_over_samples": par.micro_batch_size}

    whole = compile_model(path, gpus=1, pins=Pins(micro_batch_size=8), global_batch_size=8)
    assert not [w for w in whole.warnings if w.startswith("BatchNorm")], "one micro-batch of the whole batch"


def test_batch_norm_of_one_value_moves_the_search_off_one_sample(tmp_path, monkeypatch):
    """Nothing pinned, and the search's best plan has micro-batches of 1 sample (made so here: the tiny ResNet
    prefers large ones): compile searches again at 2."""
    import dataclasses

    import partc.compile as compile_module

    real, seen = compile_module.search, []

    def search(graph, cluster, gpus, *, global_batch_size, pins=None):
        seen.append(pins)
        first = len(seen) == 1
        return real(graph, cluster, gpus, global_batch_size=global_batch_size,
                    pins=dataclasses.replace(pins or Pins(), micro_batch_size=1) if first else pins)

    monkeypatch.setattr(compile_module, "search", search)
    result = compile_model(write_zoo_model(tmp_path, "resnet"), gpus=2, global_batch_size=8)
    assert seen[0].micro_batch_size is None and seen[1].micro_batch_size == 2
    assert result.plan.parallel.micro_batch_size == 2
