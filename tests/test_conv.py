"""Convolutions and kernel launches in the cost model (issue 30): a convolution is priced as the implicit GEMM
cuDNN runs (`partc.passes.measure.conv_gemm`), its activations are saved, every unit's time is at least the host's
time to launch its kernels, and a TP degree that splits nothing is not chosen unless pinned."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from helpers import ROOT, trace_file
from partc.cluster import PRESETS, Cluster
from partc.errors import PartcError
from partc.parallel import Parallel, Pins
from partc.passes import cost, hw
from partc.passes.measure import conv_gemm
from partc.passes.search import idle_tp_degree, search
from partc.passes.trace import trace

A100 = PRESETS["a100-80g"]
aten = torch.ops.aten


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Conv1d(6, 10, 5, stride=2, padding=2), (1, 6, 33)),
    (lambda: nn.Conv2d(8, 12, 3, stride=2, padding=1, groups=4), (1, 8, 15, 17)),
    (lambda: nn.Conv3d(4, 8, (3, 1, 3), padding=1), (1, 4, 5, 6, 7)),
    (lambda: nn.ConvTranspose2d(12, 6, 2, stride=2, groups=3), (1, 12, 7, 9)),
    (lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16), (1, 16, 9, 9)),  # depthwise
])
def test_conv_gemm_counts_the_flops_and_bytes_of_the_convolution(make, shape):
    """The implicit GEMM's 2 batch m n k are the FLOPs torch's flop counter gives the op, and its HBM traffic is
    the input and output once (not the m x k im2col operand)."""
    conv = make().to("meta")
    x = torch.empty(shape, device="meta")
    transposed = isinstance(conv, nn.ConvTranspose2d)
    args = (x, conv.weight, conv.bias, list(conv.stride), list(conv.padding), list(conv.dilation), transposed,
            list(conv.output_padding), conv.groups)
    out = aten.convolution.default(*args)
    gemm = conv_gemm(args, out)
    assert gemm is not None and gemm.batch == conv.groups and not gemm.batch_scales
    assert gemm.flops == flop_registry[aten.convolution](*args, out_val=out)
    assert gemm.io_bytes == (x.numel() + out.numel()) * 4
    assert gemm.k * gemm.n * gemm.batch == conv.weight.numel()


def _conv_net():
    return nn.Sequential(nn.Conv2d(16, 64, 3, padding=1, bias=False), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1, bias=False))


def _trace(net: nn.Module, shape: tuple[int, ...]):
    with torch.device("meta"):
        net = net.to("meta")
        x = torch.empty(shape)
    return trace(net, (x,), {}, name="convs").graph


def test_conv_only_units_cost_their_gemm_time_and_save_their_inputs():
    """Units of convolutions alone have the compute time of their implicit GEMMs (forward and the two backward
    products), at least their FLOPs at peak, and their activations in the memory model."""
    graph = _trace(_conv_net(), (1, 16, 32, 32))
    par = Parallel(dp=1, tp=1, pp=1, zero=0, micro_batch_size=64, global_batch_size=64)
    parts = cost.unit_time_parts(graph, A100, par, None)
    assert len(parts) == 2
    for unit, part in zip(graph.units, parts):
        (gemm,) = [g for f in unit.layers for g in graph.layers[f].gemms]
        assert gemm.io_bytes and unit.fwd_flops == pytest.approx(gemm.flops)
        assert part.compute_s > 3 * 64 * gemm.flops / A100.peak_flops
        mem = 64 * (sum(graph.layers[f].memory_bytes for f in unit.layers) + unit.memory_bytes)
        assert part.compute_s == pytest.approx(3 * (hw.gemm_time(A100, gemm, micro_batch_size=64)
                                                    + hw.memory_time(A100, mem)))
    # Saved for backward (bf16): each convolution's input, the second one's being the ReLU's output (saved once for
    # both); the weights are not activations.
    assert sum(u.saved_bytes for u in graph.units) == 2 * (16 + 64) * 32 * 32


def test_a_memory_bound_convolution_moves_its_tensors_not_the_im2col_matrix():
    """A depthwise 3x3 convolution runs at memory speed: input, output and weight through HBM once each."""
    conv = nn.Conv2d(256, 256, 3, padding=1, groups=256, bias=False).to("meta")
    x = torch.empty(1, 256, 56, 56, device="meta", dtype=torch.bfloat16)
    args = (x, conv.weight.to(torch.bfloat16), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 256)
    gemm = conv_gemm(args, aten.convolution.default(*args))
    b = 32
    nbytes = 2 * (b * 2 * 256 * 56 * 56 + 256 * 9)
    assert hw.gemm_time(A100, gemm, micro_batch_size=b) == pytest.approx(hw.memory_time(A100, nbytes))


def test_fp32_convolutions_run_at_the_tf32_rate_and_fp32_matmuls_do_not():
    """PyTorch's defaults: cuDNN runs fp32 convolutions in TF32 (``torch.backends.cudnn.allow_tf32``), cuBLAS runs
    fp32 matmuls in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is False)."""
    conv = nn.Conv2d(256, 256, 3, padding=1, bias=False).to("meta")
    x = torch.empty(1, 256, 56, 56, device="meta")
    args = (x, conv.weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    gemm = conv_gemm(args, aten.convolution.default(*args))
    assert gemm.dtype_bytes == 4
    b = 64
    eff = hw.gemm_efficiency(A100, gemm.m * b, gemm.n, gemm.k, gemm.batch)
    assert hw.gemm_time(A100, gemm, micro_batch_size=b) == pytest.approx(
        b * gemm.flops / (A100.peak_flops_tf32 * A100.tf32_conv_efficiency * eff))
    matmul = dataclasses.replace(gemm, io_bytes=0)  # the same product as a matmul: no TF32, no TF32 efficiency
    for cluster in (A100, dataclasses.replace(A100, tf32_conv_efficiency=0.1)):
        assert hw.gemm_time(cluster, matmul, micro_batch_size=b) == pytest.approx(
            b * gemm.flops / (A100.peak_flops_fp32 * eff))
    assert A100.peak_flops_fp32 < A100.peak_flops_tf32 < A100.peak_flops


def test_a_tf32_convolution_unit_costs_what_tf32_conv_efficiency_says():
    """Per unit, a TF32 step over a bf16 one: everything partc prices scales with the element size (half the
    tensor-core rate, twice the bytes), so at ``tf32_conv_efficiency`` 1 a TF32 unit takes exactly twice its bf16
    time, compute-bound or memory-bound; the calibrated fraction (fitted on a published ResNet-50 run,
    benchmarks/convnets.py) slows a compute-bound convolution by 1 / fraction more and leaves a memory-bound one
    alone."""
    net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False),  # 288 FLOPs a bf16 byte: compute-bound
                        nn.Conv2d(64, 16, 1, bias=False))  # 13 FLOPs a bf16 byte: memory-bound
    graphs = {p: trace(net.to("meta"), (torch.empty(1, 64, 32, 32, device="meta"),), {}, name="convs",
                       precision=p).graph for p in ("bf16", "fp32")}
    par = Parallel(dp=1, tp=1, pp=1, zero=0, micro_batch_size=64, global_batch_size=64)
    no_floor = dataclasses.replace(A100, kernel_launch_s=0.0)
    assert A100.tf32_conv_efficiency < 1

    def seconds(cluster, precision):
        return [p.compute_s for p in cost.unit_time_parts(graphs[precision], cluster, par, None)]

    (dense16, thin16), (dense32, thin32) = seconds(no_floor, "bf16"), seconds(no_floor, "fp32")
    (dense_at_1, thin_at_1) = seconds(dataclasses.replace(no_floor, tf32_conv_efficiency=1.0), "fp32")
    assert dense_at_1 / dense16 == pytest.approx(2) and thin_at_1 / thin16 == pytest.approx(2)
    assert dense32 / dense16 == pytest.approx(2 / A100.tf32_conv_efficiency)
    assert thin32 == pytest.approx(thin_at_1)
    (gemm,) = graphs["fp32"].layers["1"].gemms  # the 1x1 convolution: its input, output and weight through HBM
    assert thin32 == pytest.approx(3 * hw.memory_time(A100, 64 * gemm.io_bytes + 4 * 64 * 16))
    with pytest.raises(PartcError, match="tf32_conv_efficiency"):
        Cluster.from_dict({"tf32_conv_efficiency": 1.5})


def test_kernel_launches_floor_a_units_time():
    """A unit of tiny kernels costs the host's time to launch them (forward, twice as many in backward, and the
    forward again under full recomputation); kernel_launch_s 0 turns the floor off."""
    graph = _trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), (1, 8))
    assert sum(u.kernels for u in graph.units) >= 3  # two GEMMs and the ReLU, at least
    par = Parallel(dp=1, tp=1, pp=1, zero=0, micro_batch_size=1, global_batch_size=1)
    parts = cost.unit_time_parts(graph, A100, par, None)
    full = cost.unit_time_parts(graph, A100, dataclasses.replace(par, recompute="full"), None)
    bare = cost.unit_time_parts(graph, dataclasses.replace(A100, kernel_launch_s=0.0), par, None)
    for unit, part, again, free in zip(graph.units, parts, full, bare):
        assert part.compute_s == pytest.approx(3 * unit.kernels * A100.kernel_launch_s)
        assert 0 < free.compute_s < part.compute_s / 10
        if unit.kind == "block":  # full recomputation replays a block's forward, and launches it again
            assert again.compute_s == pytest.approx(4 * unit.kernels * A100.kernel_launch_s)
    assert cost.unit_time_floor(graph, A100, par) == [pytest.approx(p.compute_s) for p in parts]
    with pytest.raises(PartcError, match="kernel_launch_s"):
        Cluster.from_dict({"kernel_launch_s": -1e-6})


@pytest.mark.parametrize("name, path, env", [
    ("unet", ROOT / "benchmarks" / "models" / "unet.py", {"PARTC_UNET_SIZE": "tiny"}),
    ("vit", ROOT / "examples" / "vit.py", {"PARTC_VIT_SIZE": "tiny"}),
])
def test_tiny_models_get_no_tp_that_splits_nothing(name, path, env, monkeypatch):
    """On 4 GPUs a tiny U-Net or ViT is launch-bound: a TP degree whose every layer is replicated (each rank
    computing the same micro-batches whole) would look as fast as data parallelism and skip its all-reduce. The
    search leaves it out unless TP is pinned."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _, traced = trace_file(path)
    graph = traced.graph
    best = search(graph, A100, 4, global_batch_size=64).best
    assert not idle_tp_degree(best.parallel, best.tp), best.parallel
    pinned = search(graph, A100, 4, global_batch_size=64, pins=Pins(tp=4)).best
    assert pinned.parallel.tp == 4


def test_a_tiny_mlp_gets_no_tp_that_splits_nothing():
    graph = _trace(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), (1, 16))
    best = search(graph, A100, 4, global_batch_size=64).best
    assert not idle_tp_degree(best.parallel, best.tp), best.parallel
    # The joint search may still take tp > 1 with a layer split (a memory choice of its style maps) when the cost
    # model prices its collectives below dp's gradient all-reduce; what it never takes is t copies of one GPU.
    assert math.isfinite(best.step_time_s)
