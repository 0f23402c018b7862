"""`rebatch`: the traced graph at another micro-batch size equals a second torch.export at that size, or is refused."""

import textwrap
from pathlib import Path

import pytest
import torch

from helpers import EXAMPLES
from partc import compile as compile_mod
from partc.compile import compile_model
from partc.compile_traces import meta_inputs
from partc.model_file import build_on_meta, load_model_file
from partc.parallel import Pins
from partc.passes.export import export_on_meta
from partc.passes.rebatch import rebatch
from partc.passes.trace import trace
from partc.precision import compute_dtype


def _nodes(ep) -> list[str]:
    """Every node as text: name, op, arguments, and its value's shape and dtype."""
    def val(n):
        v = n.meta.get("val")
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
    return [str((n.name, n.op, n.target, n.args, n.kwargs, val(n))) for n in ep.graph.nodes]


def _both(path, b: int, precision: str = "bf16"):
    """(rebatched graph or None, graph of a fresh export) at b samples, both at the trace's `precision` (the model
    as the trace cast it, inputs as compile_model makes them); the traced graph is left as it was."""
    spec = load_model_file(str(path))
    model = build_on_meta(spec)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    traced = trace(model, args, kwargs, name=spec.name, seq_len=spec.seq_len, path=str(path), precision=precision)
    before = _nodes(traced.exported)
    args, kwargs = meta_inputs(spec, b, precision)
    got = rebatch(traced.exported, model, args, kwargs)
    assert _nodes(traced.exported) == before  # the traced graph is left as it was
    return got, export_on_meta(model, args, kwargs)


@pytest.mark.parametrize("case,b,precision", [("gpt", 1, "bf16"), ("gpt", 2, "bf16"), ("gpt", 3, "bf16"),
                                              ("llama", 2, "bf16"), ("llama", 4, "bf16"), ("gpt", 2, "fp32")])
def test_equals_a_fresh_export(case, b, precision):
    got, want = _both(EXAMPLES / f"{case}.py", b, precision)
    assert got is not None
    assert _nodes(got) == _nodes(want)
    dtypes = {n.meta["val"].dtype for n in want.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert compute_dtype(precision) in dtypes
    assert got.graph is not want.graph


def test_program_equals_the_one_from_a_second_export(tmp_path, monkeypatch):
    """partc compile writes the same files (plan, stage files, manifest) at tp 2 and micro-batch 2 either way."""
    kw = dict(gpus=4, pins=Pins(pp=2, dp=1, tp=2, micro_batch_size=2, schedule="1f1b"), global_batch_size=8)
    path = str(EXAMPLES / "gpt.py")
    compile_model(path, out_dir=tmp_path / "rebatched", **kw)
    monkeypatch.setattr(compile_mod, "rebatch", lambda *a: None)
    compile_model(path, out_dir=tmp_path / "exported", **kw)
    files = sorted(p.relative_to(tmp_path / "exported") for p in (tmp_path / "exported").rglob("*") if p.is_file())
    assert len(files) >= 4
    for f in files:
        assert (tmp_path / "rebatched" / f).read_bytes() == (tmp_path / "exported" / f).read_bytes(), f


MODEL = """
    import torch
    from torch import nn

    H = 32

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, H)
            self.lin = nn.Linear(H, H)
            self.head = nn.Linear(H, 64)

        def forward(self, ids):
            B, T = ids.shape
            x = self.emb(ids)
            {body}
            return self.head(x)

    def model():
        return M()

    def example_inputs(batch_size):
        return (torch.zeros(batch_size, 16, dtype=torch.long),)
"""


def _model_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(MODEL).replace("{body}", body))
    return path


@pytest.mark.parametrize("body", [
    "x = self.lin(x.view(B * T, H)).view(B, T, H)",              # the batch merges into the first dim and back
    "x = self.lin(x.reshape(-1, H)).reshape(B, T, 4, H // 4).flatten(2)",
    "x = x + self.lin(x).transpose(1, 2).contiguous().transpose(1, 2)",
])
def test_views_of_the_batch(tmp_path, body):
    got, want = _both(_model_file(tmp_path, body), 3)
    assert got is not None and _nodes(got) == _nodes(want)


@pytest.mark.parametrize("body", [
    "x = x + self.emb(torch.arange(B * T, device=ids.device).view(B, T) % 64)",   # a size built from the batch
    "x = self.lin(x.squeeze(0)).view(B, T, H)",                  # at one sample, squeeze drops the batch dim
    "x = x[:, :1].expand(B, T, H) + x",                          # a size of 1 next to the batch
    "x = x.view(T, B, H).transpose(0, 1).reshape(B, T, H)",      # the batch after a dim of its own
    "x = x + self.lin(x).transpose(0, 1).contiguous().transpose(0, 1)",  # at one sample, contiguous is a no-op
])
def test_unproven_batches_are_refused(tmp_path, body):
    got, want = _both(_model_file(tmp_path, body), 2)
    assert got is None, "the graph at 2 samples is not provably the traced one rescaled"
    assert want is not None


def test_batch_of_a_hugging_face_mask_is_refused():
    """transformers builds its causal mask with torch.arange(batch_size): the 1 of one sample is ambiguous."""
    pytest.importorskip("transformers")
    got, want = _both(EXAMPLES / "hf_gpt2.py", 2)
    assert got is None and want is not None


def test_same_shapes_runs_an_op_once_per_distinct_call():
    """SameShapes answers a repeated call with a fresh tensor of the same metadata; int and float scalars, views
    and in-place ops are told apart."""
    from partc.passes.same_shapes import SameShapes

    x, i = torch.empty(4, 8, device="meta"), torch.empty(4, dtype=torch.long, device="meta")
    with SameShapes() as cache:
        a, b = torch.mm(x, x.t()), torch.mm(x, x.t())
        assert a.shape == b.shape == (4, 4) and a is not b and a.untyped_storage()._cdata != b.untyped_storage()._cdata
        assert (i + 1).dtype == torch.long and (i + 1.0).dtype == torch.float32
        v = x.view(8, 4)
        assert v.untyped_storage()._cdata == x.untyped_storage()._cdata  # a view is a view
        assert x.add_(1) is x
    assert any(key[0] is torch.ops.aten.mm.default for key in cache.results)
