"""Pipeline bubble: the measured idle fraction of each schedule against (p - 1) / (m + p - 1).

    python benchmarks/pipeline_bubble.py                         # p in {2, 4}, m in {2, 4, 8, 16}, CPU
    python benchmarks/pipeline_bubble.py --pp 4 --microbatches 4 8 --forward-ms 20 --json bubble.json

Each run writes what it prints to benchmarks/results/pipeline_bubble-<date>.md as well (`record.py`).

Each pipeline rank runs stages of fixed cost: forward sleeps `forward_ms` per micro-batch and backward twice that
(the usual 1:2 ratio), so the measurement is the schedule's, not the machine's (sleeping ranks leave the CPU to
the others; gloo's point-to-point messages are 64 floats). A rank's busy time is the sum of its forward and
backward sleeps in one step; its idle fraction is 1 - busy / step time; the table shows the mean over ranks.
Measured idle also counts what the theory leaves out: each micro-batch's send/receive, the schedule's Python and
the sleep's overshoot (about 1-5 ms per micro-batch on a busy CPU), so it exceeds the formula most at large m;
a larger --forward-ms shrinks that share.

The schedules are the runtime's (`partc.runtime.train.SCHEDULES`: torch.distributed.pipelining's GPipe, 1F1B and
interleaved 1F1B with v = 2 chunks per rank, each half the cost). Theory (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", section 2.2): the bubble is (p - 1) / (m + p - 1) of the
step for GPipe and 1F1B, and (p - 1) / (v * m + p - 1) for interleaved 1F1B.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b")
HIDDEN = 64


class _Busy(torch.autograd.Function):
    """Identity whose forward and backward sleep, recording the time on `clock`."""

    @staticmethod
    def forward(ctx, x, seconds, clock):
        ctx.seconds, ctx.clock = seconds, clock
        _sleep(seconds, clock)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(2 * ctx.seconds, ctx.clock)
        return grad, None, None


def _sleep(seconds: float, clock: list[float]) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds)
    clock[0] += time.perf_counter() - t0


class FixedCostStage(nn.Module):
    def __init__(self, seconds: float, clock: list[float]):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN))
        self.seconds, self.clock = seconds, clock

    def forward(self, x):
        return _Busy.apply(x * self.scale, self.seconds, self.clock)


def theory(schedule: str, p: int, m: int, v: int = 2) -> float:
    return (p - 1) / ((v if schedule == "interleaved-1f1b" else 1) * m + p - 1)


def worker(args: argparse.Namespace) -> None:
    """One pipeline rank (under torchrun): every schedule and micro-batch count; rank 0 writes the results."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from partc.runtime.train import SCHEDULES

    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = []
    for schedule in SCHEDULE_NAMES:
        v = 2 if schedule == "interleaved-1f1b" else 1
        for m in args.microbatches:
            if (schedule == "interleaved-1f1b" and m % p) or (schedule != "gpipe" and m < p):
                continue  # torch's 1F1B schedules need m >= p (and interleaving m % p == 0)
            clock = [0.0]
            seconds = args.forward_ms / 1e3 / v
            stages = []
            for i in range(v):  # static shapes; activations require grad, the pipeline's input does not
                k = rank + i * p
                x_meta = torch.empty(1, HIDDEN, requires_grad=k > 0)
                y_meta = torch.empty(1, HIDDEN, requires_grad=True)
                stages.append(PipelineStage(FixedCostStage(seconds, clock), k, p * v, torch.device("cpu"),
                                            input_args=(x_meta,), output_args=(y_meta,)))
            loss = lambda out, target: out.sum()  # noqa: E731
            cls = SCHEDULES[schedule]
            sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss)
            x, target = torch.randn(m, HIDDEN), torch.zeros(m, HIDDEN)
            times, busy = [], []
            for step in range(args.steps + 1):  # the first step warms up
                dist.barrier()
                clock[0] = 0.0
                t0 = time.perf_counter()
                sched.step(x, target=target) if rank == 0 else sched.step(target=target)
                dist.barrier()
                if step:
                    times.append(time.perf_counter() - t0)
                    busy.append(clock[0])
            idle = torch.tensor([1 - b / t for b, t in zip(busy, times)]).mean()
            all_idle = [torch.zeros(()) for _ in range(p)]
            dist.all_gather(all_idle, idle)
            if rank == 0:
                results.append({"p": p, "m": m, "schedule": schedule, "measured": float(torch.stack(all_idle).mean()),
                                "theory": theory(schedule, p, m), "step_s": sum(times) / len(times)})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline ranks p (default 2 4)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16], help="micro-batches m")
    ap.add_argument("--forward-ms", type=float, default=10.0, help="forward cost of one rank per micro-batch")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = []
    for p in args.pp:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bubble.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(p),
                   os.path.abspath(__file__), "--worker", "--out", out, "--forward-ms", str(args.forward_ms),
                   "--steps", str(args.steps), "--microbatches", *map(str, args.microbatches)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL)
            with open(out) as f:
                results += json.load(f)
    print(f"{'p':>2} {'m':>3}  {'schedule':<17} {'idle (measured)':>15} {'bubble (theory)':>15} {'step':>9}")
    for r in results:
        print(f"{r['p']:>2} {r['m']:>3}  {r['schedule']:<17} {r['measured'] * 100:>14.1f}% {r['theory'] * 100:>14.1f}% "
              f"{r['step_s'] * 1e3:>7.0f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    from record import recorded

    sys.exit(main() if "--worker" in sys.argv else recorded("pipeline_bubble", main))
