"""Training on data (`partc.runtime.data`), the optimizer side of a step (`partc.runtime.optim`) and a model file
with ``dataset()`` and no ``example_inputs`` (`partc.model_file`).

The multi-process test runs `examples/byte_lm.py` (a byte-level GPT on a corpus `examples/make_corpus.py` builds
from the standard library) in one torchrun launch of 4 ranks: 30 steps under (pp 2, dp 2, ZeRO-1) with warm-up,
cosine decay, weight decay and clipping, against one process (`reference_run`: ``clip_grad_norm_``); 15 steps
under that plan, then resumed under (pp 1, dp 4, ZeRO-3) from its checkpoint; and what each rank read.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import EXAMPLES, assert_close_losses, launch, run_jobs
from partc.compile import compile_model
from partc.environ import environ
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.runtime import options
from partc.runtime.data import GlobalOrder, Loader, TokenFile, check_resumable, data_state
from partc.runtime.materialize import build_initialized
from partc.runtime.optim import LRSchedule, no_decay
from partc.runtime.testing import reference_run

BYTE_LM = str(EXAMPLES / "byte_lm.py")


# --- single process -------------------------------------------------------------------------------------------


class Numbers(torch.utils.data.Dataset):
    """Sample i: inputs [i, i], target i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([i, i]), torch.tensor(i)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(1000):
            yield torch.tensor([i, i]), torch.tensor(i)


def _loader(ds, *, dp: int, rank: int, inputs: bool = True, targets: bool = True, start: int = 0,
            seed: int = 3) -> Loader:
    return Loader(ds, input_keys=[0], global_batch_size=8, dp=dp, dp_rank=rank, inputs=inputs, targets=targets,
                  seed=seed, start=start)


@pytest.mark.parametrize("make", [lambda: Numbers(20), Stream], ids=["map", "iterable"])
def test_each_dp_rank_reads_its_share_in_a_plan_independent_order(make):
    """The global batches are the same under dp 1, 2 and 4; each dp rank reads exactly its slice (counted)."""
    whole = [b.targets.tolist() for b in _loader(make(), dp=1, rank=0).batches(0, 6)]
    assert all(len(b) == 8 for b in whole)
    if isinstance(make(), Numbers):  # shuffled, and every sample once per epoch of 20
        assert sorted(sum(whole, [])[:20]) == list(range(20)) and sum(whole, [])[:20] != list(range(20))
    for dp in (2, 4):
        loaders = [_loader(make(), dp=dp, rank=r) for r in range(dp)]
        parts = [[b for b in ld.batches(0, 6)] for ld in loaders]
        for k in range(6):
            assert sum((p[k].targets.tolist() for p in parts), []) == whole[k]
            for p in parts:
                assert torch.equal(p[k].inputs[0][:, 0], p[k].targets)
        per_rank = [ld.read for ld in loaders]
        assert all(len(r) == 6 * 8 // dp for r in per_rank), "each rank reads its share, nothing more"
        if isinstance(make(), Numbers):
            order = GlobalOrder(20, 3)
            for r, read in enumerate(per_rank):
                assert read == [order(k * 8 + j) for k in range(6) for j in range(r * 8 // dp, (r + 1) * 8 // dp)]


def test_only_the_stages_that_need_data_read_it():
    first = list(_loader(Numbers(20), dp=1, rank=0, targets=False).batches(0, 2))
    last = list(_loader(Numbers(20), dp=1, rank=0, inputs=False).batches(0, 2))
    middle = _loader(Numbers(20), dp=1, rank=0, inputs=False, targets=False)
    assert all(b.targets is None and b.inputs is not None for b in first)
    assert all(b.inputs is None and b.targets is not None for b in last)
    assert all(b.inputs is None and b.targets is None for b in middle.batches(0, 2)) and middle.read == []


def test_a_resumed_loader_continues_the_sequence():
    """Position p = start + step·G: a loader built at step 3 (its start from the checkpoint's position) gives the
    batches an uninterrupted one gives."""
    whole = [b.targets.tolist() for b in _loader(Numbers(20), dp=1, rank=0).batches(0, 6)]
    again = [b.targets.tolist() for b in _loader(Numbers(20), dp=2, rank=0).batches(3, 6)]
    assert again == [w[:4] for w in whole[3:]]
    # another global batch size after the checkpoint: the position carries over, not the step
    moved = Loader(Numbers(20), input_keys=[0], global_batch_size=4, dp=1, dp_rank=0, inputs=True, targets=True,
                   seed=3, start=24 - 3 * 4)
    assert [b.targets.tolist() for b in moved.batches(3, 5)] == [whole[3][:4], whole[3][4:]]


def test_a_checkpoint_position_continues_only_the_same_data():
    recorded = data_state(_loader(Numbers(20), dp=1, rank=0), 3)
    assert recorded == {"position": 24, "seed": 3, "shuffle": True, "samples": 20}
    check_resumable(recorded, Numbers(20), 3)
    with pytest.raises(PartcError, match="20 samples, this one has 21"):
        check_resumable(recorded, Numbers(21), 3)
    with pytest.raises(PartcError, match="seed 3"):
        check_resumable(recorded, Numbers(20), 4)


def test_token_files(tmp_path):
    ids = np.arange(41, dtype=np.uint16)
    ids.tofile(tmp_path / "a.bin")
    np.save(tmp_path / "a.npy", ids.astype(np.int32))
    for name in ("a.bin", "a.npy"):
        ds = TokenFile(tmp_path / name, 10)
        assert len(ds) == 4
        x, y = ds[3]
        assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41)) and x.dtype == torch.int64
    (tmp_path / "odd.bin").write_bytes(b"abc")
    np.save(tmp_path / "two.npy", np.zeros((2, 3), np.int64))
    for name, msg in (("odd.bin", "whole number"), ("two.npy", "1-D"), ("none.bin", "does not exist")):
        with pytest.raises(PartcError, match=msg):
            TokenFile(tmp_path / name, 4)
    with pytest.raises(PartcError, match="fewer than one sample"):
        TokenFile(tmp_path / "a.bin", 64)


def test_lr_schedule():
    cos = LRSchedule(kind="cosine", lr=1.0, warmup=4, total=14, min_lr=0.1)
    assert [cos.lr_at(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.lr_at(4) == 1.0 and abs(cos.lr_at(9) - 0.55) < 1e-12 and abs(cos.lr_at(14) - 0.1) < 1e-12
    assert cos.lr_at(100) == pytest.approx(0.1)
    lin = LRSchedule(kind="linear", lr=1.0, warmup=0, total=10, min_lr=0.0)
    assert lin.lr_at(5) == 0.5 and lin.lr_at(10) == 0.0
    assert LRSchedule(kind="constant", lr=0.3, warmup=2, total=10).lr_at(7) == 0.3
    with pytest.raises(PartcError, match="--min-lr"):
        LRSchedule(kind="cosine", lr=0.1, min_lr=0.2)


def test_no_weight_decay_on_norms_biases_and_positions():
    m = load_model_file(str(EXAMPLES / "gpt.py")).build()
    skip = no_decay(m)
    assert {"pos.weight", "ln_f.weight", "blocks.0.ln_1.bias", "blocks.0.attn.qkv.bias"} <= skip
    assert not {"tok.weight", "blocks.0.attn.qkv.weight", "lm_head.weight"} & skip


def test_options_refuse_bad_values():
    for argv, msg in ((["--grad-clip", "0"], "--grad-clip"), (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
                      (["--beta2", "1"], "--beta2"), (["--warmup-steps", "-1"], "--warmup-steps"),
                      (["--lr-schedule", "step"], "invalid choice")):
        with pytest.raises(PartcError, match=msg):
            options.parse(["out", *argv])


def test_dataset_without_example_inputs_compiles_and_trains(tmp_path, monkeypatch):
    """A model file with dataset() and neither example_inputs nor example_targets: the shapes come from a sample,
    the plan is made, and the program trains on the data (one process)."""
    path = tmp_path / "pairs.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Pairs(torch.utils.data.Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                x = torch.randn(6, generator=g)
                return {"x": x}, (x.sum() > 0).long()

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(6, 16)
                self.b = nn.Linear(16, 2)
            def forward(self, x):
                return self.b(torch.relu(self.a(x)))

        def model():
            return Net()

        def dataset():
            return Pairs()
    """))
    spec = load_model_file(str(path))
    with torch.device("meta"):
        args, kwargs = spec.inputs(4)
    assert args == () and kwargs["x"].shape == (4, 6) and spec.targets(4).shape == (4,)
    out = tmp_path / "out"
    compile_model(str(path), gpus=1, pins=Pins(precision="fp32"), global_batch_size=8, out_dir=out)
    torch.manual_seed(0)
    init = build_initialized(spec, seed=0).state_dict()
    losses, _ = reference_run(str(path), init, steps=12, seed=0, global_batch_size=8, optimizer="adamw", lr=0.05,
                              precision="fp32", data=True)
    assert losses[-1] < losses[0]


# --- torchrun ---------------------------------------------------------------------------------------------------

STEPS = 30
TRAIN = {"lr_schedule": "cosine", "warmup_steps": 5, "lr_decay_steps": STEPS, "min_lr": 3e-4, "grad_clip": 1.0,
         "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
OPT = {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1}
GBS = 8
TP_STEPS = 8


@pytest.fixture(scope="module")
def byte_lm(tmp_path_factory):
    """The corpus, the environment of examples/byte_lm.py (its test size), the init state and two plans."""
    import importlib.util

    tmp = tmp_path_factory.mktemp("data")
    spec = importlib.util.spec_from_file_location("make_corpus", EXAMPLES / "make_corpus.py")
    make_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_corpus)
    corpus = tmp / "corpus.bin"
    assert make_corpus.main(["-o", str(corpus), "--max-mb", "0.05", "--val-fraction", "0"]) == 0
    with environ({"PARTC_CORPUS": str(corpus), "PARTC_BYTE_LM_SIZE": "test"}):
        torch.manual_seed(1234)
        init = load_model_file(BYTE_LM).build().state_dict()
        torch.save(init, tmp / "init.pt")
        plans = {}
        for name, pins in (("a", Pins(tp=1, pp=2, dp=2, zero=1, micro_batch_size=2, schedule="1f1b",
                                      precision="fp32")),
                           ("b", Pins(tp=1, pp=1, dp=4, zero=3, micro_batch_size=1, schedule="gpipe",
                                      precision="fp32")),
                           ("c", Pins(tp=2, pp=1, dp=2, zero=0, micro_batch_size=2, schedule="gpipe",
                                      precision="fp32")),
                           ("d", Pins(tp=1, pp=1, dp=1, zero=0, micro_batch_size=2, precision="fp32"))):
            result = compile_model(BYTE_LM, gpus=pins.tp * pins.pp * pins.dp, pins=pins, global_batch_size=GBS,
                                   out_dir=tmp / name)
            par = result.plan.parallel
            assert (par.tp, par.pp, par.dp, par.zero) == (pins.tp, pins.pp, pins.dp, pins.zero)
            plans[name] = tmp / name
        yield tmp, corpus, init, plans, reference(init)


def reference(init: dict) -> tuple[list[float], dict]:
    """One process's 30 steps (`reference_run`: ``clip_grad_norm_``) on the runtime's order of the data: the
    losses, and the gradient norms and learning rates per step."""
    stats: dict = {}
    losses, _ = reference_run(BYTE_LM, init, steps=STEPS, seed=0, global_batch_size=GBS, precision="fp32",
                              micro_batch_size=2, train=TRAIN, data=True, stats=stats, **OPT)
    return losses, stats


@pytest.fixture(scope="module")
def runs(byte_lm):
    tmp, corpus, init, plans, (losses, stats) = byte_lm
    common = {"init": str(tmp / "init.pt"), "data": True, "train": TRAIN, **OPT}
    ck = tmp / "ckpt"
    # the whole run writes at step 15 the checkpoint the resumed one starts from
    run_jobs(4, [{"out": str(plans["a"]), "steps": STEPS, "save": str(ck), "save_at": 15,
                  "result": str(tmp / "whole.pt"), **common},
                 # the schedule is the checkpoint's: the decay horizon asked for here does not apply
                 {"out": str(plans["b"]), "steps": STEPS, "load": str(ck), "result": str(tmp / "resumed.pt"),
                  "data": True, "train": {**TRAIN, "lr_decay_steps": 1000}, **OPT},
                 # tensor parallelism and ZeRO-0's replicated gradients in the global norm
                 {"out": str(plans["c"]), "steps": TP_STEPS, "result": str(tmp / "tp.pt"), **common}], tmp)
    got = {name: torch.load(tmp / f"{name}.pt", weights_only=True) for name in ("whole", "resumed", "tp")}
    return got, losses, stats, corpus


@pytest.mark.slow
def test_pp2_dp2_zero1_matches_one_process_with_schedule_and_clipping(runs):
    got, losses, stats, _ = runs
    whole = got["whole"]
    assert_close_losses(whole["losses"], losses)
    assert whole["lrs"] == pytest.approx(stats["lrs"], rel=1e-12)
    assert whole["lrs"][0] < whole["lrs"][4] == OPT["lr"] > whole["lrs"][-1] > TRAIN["min_lr"], "warm-up, decay"
    assert whole["grad_norms"] == pytest.approx(stats["grad_norms"], rel=1e-4)
    clipped = [n > TRAIN["grad_clip"] for n in stats["grad_norms"]]
    assert any(clipped) and not all(clipped), "clipping must be active in some steps, not all"
    assert whole["clipped"] == clipped
    assert losses[-1] < losses[0] - 0.5, "the model learns"


@pytest.mark.slow
def test_tp2_dp2_zero0_gradient_norm_is_the_global_one(runs):
    """Split and whole parameters over tp, gradients replicated over dp (ZeRO-0): each counted once."""
    got, losses, stats, _ = runs
    tp = got["tp"]
    assert_close_losses(tp["losses"], losses[:TP_STEPS])
    assert tp["grad_norms"] == pytest.approx(stats["grad_norms"][:TP_STEPS], rel=1e-4)
    assert tp["clipped"] == [n > TRAIN["grad_clip"] for n in stats["grad_norms"][:TP_STEPS]]


@pytest.mark.slow
def test_resumed_under_another_plan_continues_the_same_losses(runs):
    got, losses, _, _ = runs
    assert got["resumed"]["start"] == 15
    assert_close_losses(got["whole"]["losses"][:15] + got["resumed"]["losses"], losses)
    assert got["resumed"]["lrs"] == pytest.approx(got["whole"]["lrs"][15:], rel=1e-12), "the schedule is restored"


@pytest.mark.slow
def test_each_dp_rank_reads_only_its_share(runs):
    """Counted in the runtime: every rank that needs data read its dp slice of each global batch and nothing else;
    the dp ranks of a pipeline rank together read every sample of every batch once."""
    got, _, _, corpus = runs
    samples = (corpus.stat().st_size // 2 - 1) // 16  # uint16 tokens, samples of seq_len (16) + 1
    for name, first, steps, dp in (("whole", 0, STEPS, 2), ("resumed", 15, STEPS, 4)):
        ranks = got[name]["read"]
        order = GlobalOrder(samples, 0)
        per = GBS // dp
        for r in ranks:
            want = [order(k * GBS + j) for k in range(first, steps)
                    for j in range(r["dp_rank"] * per, (r["dp_rank"] + 1) * per)]
            assert r["read"] == want, (name, r["pp_rank"], r["dp_rank"])
        for pp_rank in {r["pp_rank"] for r in ranks}:
            mine = sorted(i for r in ranks if r["pp_rank"] == pp_rank for i in r["read"])
            assert mine == sorted(order(p) for p in range(first * GBS, steps * GBS))



@pytest.mark.slow
def test_cli_trains_on_a_token_file_logs_and_resumes(byte_lm):
    """python -m partc.runtime --data: the runtime's token-file reader gives dataset()'s samples; 3 steps, then
    --resume to 6 (the schedule and the data position from the checkpoint) log the one-process losses, gradient
    norms and learning rates, with the MFU next to the plan's."""
    tmp, corpus, _, plans, (losses, stats) = byte_lm
    log, ck = tmp / "cli.jsonl", tmp / "cli_ck"
    args = ["-m", "partc.runtime", str(plans["d"]), "--data", str(corpus), "--init-checkpoint", str(tmp / "init.pt"),
            "--lr", str(OPT["lr"]), "--weight-decay", str(OPT["weight_decay"]), "--lr-schedule", "cosine",
            "--warmup-steps", "5", "--lr-decay-steps", str(STEPS), "--min-lr", str(TRAIN["min_lr"]),
            "--grad-clip", "1.0", "--beta2", "0.95", "--checkpoint-dir", str(ck), "--log-jsonl", str(log)]
    launch(1, [*args, "--steps", "3"])
    out = launch(1, [*args, "--steps", "6", "--resume"]).stdout
    assert "resumed from" in out and "grad norm" in out and "MFU" in out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert_close_losses([r["loss"] for r in rows], losses[:6])
    assert [r["grad_norm"] for r in rows] == pytest.approx(stats["grad_norms"][:6], rel=1e-4)
    assert [r["lr"] for r in rows] == pytest.approx(stats["lrs"][:6], rel=1e-12)
    assert all(r["mfu"] > 0 and r["predicted_mfu"] > 0 and r["tokens_per_s"] > 0 for r in rows)
