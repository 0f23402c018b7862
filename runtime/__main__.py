"""Train a compiled program on the synthetic batches of the model file, under torchrun:

    partc compile examples/gpt.py --gpus 4 -o partc_out
    torchrun --nproc-per-node 4 -m partc.runtime partc_out --steps 100 --lr 3e-4 --log-jsonl log.jsonl
    partc run partc_out --steps 100          # the same: starts torchrun with the plan's world size

Step k trains on ``torch.manual_seed(seed + k); example_inputs(G), example_targets(G)`` (see `partc.runtime.train`).
Rank 0 prints loss, tokens/s and step time each step. ``--checkpoint-dir DIR --checkpoint-every K`` writes a
sharded checkpoint every K steps and at the end; ``--resume`` continues from the newest one in DIR (written under
any plan of the same model, any dp, tp and pp). ``--init-checkpoint`` and ``--save-full-state-dict`` take and
give whole tensors under the model's own names: each rank reads its tensor-parallel shards out of the file, and
the saved file has the shards gathered. Errors in the input print one line and exit with code 2.

The process leaves through `exit_now` (``os._exit`` once the files are written and the process group is gone):
gloo sometimes aborts a finished process during interpreter teardown, which torchrun would report as a failure.

Fault injection (tests): ``PARTC_FAULT_EXIT=RANK:STEP`` makes global rank RANK exit with status 1 right after
step STEP (0-based), as a crashed process would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from partc.errors import PartcError
from partc.runtime.parallelize import OPTIMIZERS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line and exit code 2, like every partc error (argparse would print the usage too)."""
        sys.stderr.write(f"error: {message} (see python -m partc.runtime --help)\n")
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m partc.runtime", description="Train a partc program under torchrun.")
    p.add_argument("out_dir", help="output directory of `partc compile` (plan.json and program/)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to run in total (default 10)")
    p.add_argument("--seed", type=int, default=0, help="data and initialization seed (default 0)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    p.add_argument("--init-checkpoint", default=None,
                   help="initial weights: torch.save(model.state_dict()) or a safetensors file (whole tensors)")
    p.add_argument("--log-jsonl", default=None, help="rank 0 appends {step, loss, tokens_per_s, step_time_s} lines")
    p.add_argument("--save-full-state-dict", default=None,
                   help="at the end, gather the model's state_dict() and torch.save it here (rank 0)")
    p.add_argument("--checkpoint-dir", default=None, help="sharded checkpoints (torch.distributed.checkpoint)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    args = p.parse_args(argv)
    if args.steps < 0 or args.checkpoint_every < 0:
        p.error("--steps and --checkpoint-every must be >= 0")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    return args


def train(args: argparse.Namespace) -> None:
    from partc.runtime import api, checkpoint

    prog = api.load(args.out_dir, seed=args.seed, optimizer=args.optimizer, lr=args.lr,
                    weight_decay=args.weight_decay, init_checkpoint=args.init_checkpoint)
    rank0 = dist.get_rank() == 0
    start = 0
    if args.resume:
        newest = checkpoint.latest(args.checkpoint_dir)
        if newest is not None:
            start = prog.load(newest)
        if rank0:
            print(f"resumed from {newest} (step {start})" if newest else
                  f"no checkpoint in {args.checkpoint_dir} yet: starting at step 0", flush=True)
    par = prog.plan.parallel
    tokens = par.global_batch_size * (prog.spec.seq_len or 1)
    unit = "tokens" if prog.spec.seq_len else "samples"
    log = open(args.log_jsonl, "a" if start else "w") if rank0 and args.log_jsonl else None
    fault = _fault()
    try:
        for k in range(start, args.steps):
            inputs, targets = prog.batch(k)
            t0 = time.perf_counter()
            loss = prog.step(inputs, targets)
            dt = time.perf_counter() - t0
            if rank0:
                print(f"step {k + 1}/{args.steps}  loss {loss:.6f}  {tokens / dt:,.0f} {unit}/s  "
                      f"{dt * 1e3:.1f} ms", flush=True)
                if log:
                    log.write(json.dumps({"step": k, "loss": loss, f"{unit}_per_s": tokens / dt,
                                          "step_time_s": dt}) + "\n")
                    log.flush()
            done = k + 1
            if args.checkpoint_dir and (done == args.steps or
                                        (args.checkpoint_every and done % args.checkpoint_every == 0)):
                prog.save(args.checkpoint_dir, done)
            if fault == (dist.get_rank(), k):
                os._exit(1)
    finally:
        if log:
            log.close()
    if args.save_full_state_dict:
        sd = prog.full_state_dict()
        if rank0:
            torch.save(sd, args.save_full_state_dict)
            print(f"wrote {args.save_full_state_dict}", flush=True)


def _fault() -> tuple[int, int] | None:
    value = os.environ.get("PARTC_FAULT_EXIT")
    if not value:
        return None
    rank, step = value.split(":")
    return int(rank), int(step)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except PartcError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Leave with `code` without interpreter finalization. Gloo's worker threads, torn down there after a
    successful run, now and then abort the process ("terminate called without an active exception", SIGABRT),
    which torchrun would report as a failed rank. Everything is written and the process group destroyed by now;
    flush the standard streams and go."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:  # argparse errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    exit_now(code)
