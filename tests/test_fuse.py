"""Fused kernels' memory with the model's own ops (`Parallel.fuse_pointwise`, `partc.passes.fuse`): what the trace
finds and prices, what the runtime's `partc.fused.pointwise` keeps and computes, and `partc check` against the plan.

The hand count, examples/llama.py's block at one sample in bf16, U = s·h·2 bytes (s 64, h 64, I 176, 4 query heads
and 2 key/value heads), as docs/sequence-parallel.md's table counts it at 405B:
- each RMSNorm keeps its input (U) instead of ``x.float()`` (2U), the normalized bf16 x (U) and 1/rms (4·s): 2U + 4·s
  less;
- SwiGLU keeps gate and up, not silu(gate): s·I·2 less;
- attention keeps the unrepeated key and value (U·kv/heads each), not the repeated ones (U each).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import EXAMPLES, compile_program, llama_variant, megatron_style, trace_file
from partc.cluster import PRESETS
from partc.model_file import build_on_meta, load_model_file
from partc.parallel import Parallel
from partc.passes import cost, memory
from partc.passes.trace import trace
from partc.fused import pointwise
from partc.runtime.check import check_program

S, H, I, HEADS, KV = 64, 64, 176, 4, 2
U = S * H * 2


@pytest.fixture(scope="module")
def llama():
    return trace_file(EXAMPLES / "llama.py")[1].graph


def _traced_fused(path):
    """The graph as a GPU preset traces it: attention counted as the fused kernel (`partc.passes.measure`)."""
    spec = load_model_file(str(path))
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    return trace(build_on_meta(spec), args, kwargs, name=spec.name, seq_len=spec.seq_len, path=str(path),
                 fused_attention=True).graph


def test_trace_finds_the_norms_swiglu_and_repeated_keys(llama):
    blocks = [u for u in llama.units if u.kind == "block"]
    assert len(blocks) == 4
    for u in blocks:
        assert u.fused_saved_bytes == 2 * (2 * U + 4 * S) + S * I * 2
        assert u.fused_saved_bytes_replicated == 2 * (2 * U + 4 * S)  # the norms: on the residual stream
        assert u.fused_input_bytes == U  # its first norm keeps the residual stream it receives
        assert u.fused_replay_bytes > 0
    # attention written out by the math kernel (this trace) keeps what it repeats inside: nothing priced
    assert all(u.fused_gqa_saved_bytes == 0 for u in blocks)
    # examples/gpt.py: LayerNorm, GeLU, dropout and residual adds save no more than their inputs: nothing to fuse
    gpt = trace_file(EXAMPLES / "gpt.py")[1].graph
    assert all(u.fused_saved_bytes == u.fused_gqa_saved_bytes == u.fused_replay_bytes == 0 for u in gpt.units)


def test_plan_activations_of_a_block_drop_by_the_hand_count():
    graph = _traced_fused(EXAMPLES / "llama.py")
    base = Parallel(dp=1, tp=1, pp=1, zero=0, micro_batch_size=2, global_batch_size=2)
    fused = dataclasses.replace(base, fuse_pointwise=True)
    before, after = memory.unit_activation_bytes(graph, base, None), memory.unit_activation_bytes(graph, fused, None)
    gqa = 2 * (U - U * KV // HEADS)
    for u, b, a in zip(graph.units, before, after):
        if u.kind == "block":
            assert u.fused_gqa_saved_bytes == gqa
            assert b - a == 2 * (2 * (2 * U + 4 * S) + S * I * 2 + gqa)  # two samples
    # the replay costs the regions' memory-bound forward again, in backward: never faster (at a batch whose work,
    # not the kernel launches, sets the time)
    cl, big = PRESETS["h100-80g"], dict(micro_batch_size=4096, global_batch_size=4096)
    t0 = [p.compute_s for p in cost.unit_time_parts(graph, cl, dataclasses.replace(base, **big), None)]
    t1 = [p.compute_s for p in cost.unit_time_parts(graph, cl, dataclasses.replace(fused, **big), None)]
    assert all(x <= y for x, y in zip(t0, t1)) and sum(t1) > sum(t0)


def test_pointwise_keeps_its_inputs_and_computes_the_same():
    """An RMSNorm written out in fp32 and a SwiGLU: the same values and gradients (bitwise), and only the inputs
    saved."""
    torch.manual_seed(0)

    def rms(x, w):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        return y.type_as(x) * w

    def swiglu(g, u):
        return torch.nn.functional.silu(g) * u

    for fn, shapes in ((rms, [(2, 8, 16), (16,)]), (swiglu, [(2, 8, 24), (2, 8, 24)])):
        xs = [torch.randn(s, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            y = pointwise(fn, *xs)
        assert {t.untyped_storage().data_ptr() for t in saved} == {x.untyped_storage().data_ptr() for x in xs}
        grad = torch.randn_like(y)
        got = torch.autograd.grad(y, xs, grad)
        ref = fn(*xs)
        want = torch.autograd.grad(ref, xs, grad)
        assert torch.equal(y, ref) and all(torch.equal(a, b) for a, b in zip(got, want))




@pytest.mark.slow  # two compiles and two `partc check` runs
def test_check_measures_the_plans_drop(tmp_path):
    """tp 2 with sequence parallelism, Megatron's map: `partc check` agrees with each plan, and the activations it
    measures drop with `fuse_pointwise` by what the plan predicts."""
    # examples/llama.py with long sequences and a small vocabulary: the blocks' activations dominate the step's
    path = llama_variant(tmp_path / "llama_long.py", "vocab_size=64, seq_len=512, hidden=64, heads=4, kv_heads=2, "
                         "layers=4, ffn_hidden=176")
    rows = {}
    for fused in (False, True):
        out = tmp_path / f"fused_{fused}"
        compile_program(path, out, tp_styles=lambda f, s: megatron_style(f, vocab=True) or
                        "replicate", tp=2, pp=1, dp=1, zero=0, micro_batch_size=1, global_batch_size=1,
                        schedule="1f1b", recompute="none", precision="bf16", sequence_parallel=True,
                        sp_regather=True, fuse_pointwise=fused)
        [r] = check_program(str(out), slack_bytes=0)
        assert all(row.agrees for row in r.rows()), r.rows()
        rows[fused] = {row.what: row for row in r.rows()}
    act = "memory activations"
    predicted = rows[False][act].predicted - rows[True][act].predicted
    measured = rows[False][act].measured - rows[True][act].measured
    assert predicted > 0.2 * rows[False][act].predicted
    assert measured == pytest.approx(predicted, rel=0.1)
