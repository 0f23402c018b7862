"""Train a compiled program under torchrun:

    partc compile examples/gpt.py --gpus 4 -o partc_out
    torchrun --nproc-per-node 4 -m partc.runtime partc_out --steps 100 --lr 3e-4 --log-jsonl log.jsonl
    partc run partc_out --steps 100 --data train.bin --lr-schedule cosine --warmup-steps 10 --grad-clip 1

The data (`partc.runtime.data`): ``--data PATH`` (token ids), else the model file's ``dataset()``, else step k's
random batch ``torch.manual_seed(seed + k); example_inputs(G), example_targets(G)`` (see `partc.runtime.train`).
The optimizer, schedule and clipping: `partc.runtime.optim`. Rank 0 prints loss, the global gradient norm, the
learning rate, tokens/s (samples/s for a model without tokens), the measured MFU next to the plan's and the step
time each step (the time from asking for the batch to the optimizer's step: data loading included). ``--checkpoint-dir DIR --checkpoint-every K`` writes a
sharded checkpoint every K steps and at the end. DIR belongs to one run (`partc.runtime.checkpoint_dir`): it
must be new or empty, and ``--resume`` continues the run recorded in it from its newest checkpoint (written under
any plan of the same model, any dp, tp and pp), refusing a directory of another run. ``--init-checkpoint`` and
``--save-full-state-dict`` take and give whole tensors under the model's own names: each rank reads its
tensor-parallel shards out of the file, and the saved file has the shards gathered.

Failures (`partc.runtime.supervise`). Errors in the input print one line and exit with code 2; a loss or gradient
that is nan or inf stops the run before the step is applied (exit 2); any other exception prints its traceback and
exits 1. Each failing rank leaves its line in torchrun's error file, which `partc run` prints. A collective that
waits longer than ``--collective-timeout`` seconds, or a rank silent that long, stops the job and names the rank.
A worker dies with its launcher (SIGKILL), and SIGINT ends it without a traceback.

The process leaves through `exit_now` (``os._exit`` once the files are written and the process group is gone):
gloo sometimes aborts a finished process during interpreter teardown, which torchrun would report as a failure.

Fault injection (tests), each ``RANK:STEP`` (global rank, 0-based step), right after the step: ``PARTC_FAULT_EXIT``
exits with status 1 as a crashed process would, ``PARTC_FAULT_RAISE`` raises a RuntimeError, ``PARTC_FAULT_STOP``
stops the process (SIGSTOP), as a hung one would be.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from partc.errors import PartcError
from partc.runtime import options, supervise


def train(args: argparse.Namespace) -> None:
    from partc.runtime import api, checkpoint_dir
    from partc.runtime.train import NonFiniteError

    prog = api.load(args.out_dir, seed=args.seed, optimizer=args.optimizer, lr=args.lr,
                    weight_decay=args.weight_decay, beta1=args.beta1, beta2=args.beta2, eps=args.eps,
                    lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                    lr_decay_steps=args.steps if args.lr_decay_steps is None else args.lr_decay_steps,
                    min_lr=args.min_lr, grad_clip=args.grad_clip, init_checkpoint=args.init_checkpoint,
                    collective_timeout_s=args.collective_timeout)
    asked = prog.schedule
    heartbeat = supervise.Heartbeat.start(args.collective_timeout)
    rank0 = dist.get_rank() == 0
    start = 0
    if args.checkpoint_dir:
        record = checkpoint_dir.RunRecord.of(prog.plan, seed=args.seed, optimizer=args.optimizer,
                                             tensors=prog.model_tensors())
        on_rank0(lambda: checkpoint_dir.claim(args.checkpoint_dir, record, resume=args.resume))
    if args.resume:
        newest = checkpoint_dir.latest(args.checkpoint_dir)
        if newest is not None:
            start = prog.load(newest)
        if rank0:
            print(f"resumed from {newest} (step {start})" if newest else
                  f"no checkpoint in {args.checkpoint_dir} yet: starting at step 0", flush=True)
            if newest and prog.schedule != asked:
                print(f"the learning-rate schedule is the checkpoint's: {prog.schedule.to_dict()} (the options "
                      f"asked for {asked.to_dict()})", flush=True)
    loader = None
    if args.data or prog.spec.dataset is not None:
        loader = prog.data_loader(data_path=args.data, num_workers=args.data_workers)
        batches = loader.batches(start, args.steps)
    par = prog.plan.parallel
    tokens = par.global_batch_size * (prog.spec.seq_len or 1)
    unit = "tokens" if prog.spec.seq_len else "samples"
    log = open(args.log_jsonl, "a" if start else "w") if rank0 and args.log_jsonl else None
    faults = {name: _fault(name) for name in ("EXIT", "RAISE", "STOP")}
    try:
        for k in range(start, args.steps):
            if heartbeat:
                heartbeat.step = k
            t0 = time.perf_counter()
            try:
                if loader is not None:
                    loss = prog.step(next(batches))
                else:
                    inputs, targets = prog.batch(k)
                    loss = prog.step(inputs, targets)
                dt = time.perf_counter() - t0
                ranks = _gather_records(prog) if args.log_jsonl else None
                if rank0:
                    last, mfu, planned = prog.last_step, prog.measured_mfu(dt), prog.plan.predicted.get("mfu")
                    shown = f"  MFU {mfu * 100:.3g}% (plan {planned * 100:.3g}%)" if mfu is not None else ""
                    print(f"step {k + 1}/{args.steps}  loss {loss:.6f}  grad norm {last['grad_norm']:.4g}"
                          f"{' (clipped)' if last['clipped'] else ''}  lr {last['lr']:.3g}  "
                          f"{tokens / dt:,.0f} {unit}/s{shown}  {dt * 1e3:.1f} ms", flush=True)
                    if log:
                        log.write(json.dumps({"step": k, "loss": loss, "grad_norm": last["grad_norm"],
                                              "lr": last["lr"], "clipped": last["clipped"],
                                              f"{unit}_per_s": tokens / dt, "step_time_s": dt, "mfu": mfu,
                                              "predicted_mfu": planned, **expert_imbalance(ranks),
                                              "ranks": ranks}, allow_nan=False) + "\n")
                        log.flush()
                done = k + 1
                if args.checkpoint_dir and (done == args.steps or
                                            (args.checkpoint_every and done % args.checkpoint_every == 0)):
                    prog.save(args.checkpoint_dir, done)
            except NonFiniteError as e:
                raise PartcError(f"step {k + 1}: {e}; the run stops here, and no checkpoint holds nan or inf "
                                 f"(a lower --lr than {args.lr:g} may help)") from None
            me = (dist.get_rank(), k)
            if faults["EXIT"] == me:
                os._exit(1)
            if faults["RAISE"] == me:
                raise RuntimeError(f"injected fault (PARTC_FAULT_RAISE) after step {k + 1}")
            if faults["STOP"] == me:
                os.kill(os.getpid(), signal.SIGSTOP)
    finally:
        if log:
            log.close()
    if args.save_full_state_dict:
        sd = prog.full_state_dict()
        if rank0:
            bad = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad:
                raise PartcError(f"the trained model holds nan or inf ({bad[0]!r} and {len(bad) - 1} more): "
                                 f"not writing --save-full-state-dict {args.save_full_state_dict}")
            torch.save(sd, args.save_full_state_dict)
            print(f"wrote {args.save_full_state_dict}", flush=True)


def _gather_records(prog) -> list[dict] | None:
    """Every rank's `Program.step_record`, in rank order, on rank 0 (None elsewhere). Collective."""
    records = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(prog.step_record(), records, dst=0)
    return records


def expert_imbalance(records: list[dict]) -> dict:
    """Under ep, the step's measured routing imbalance (the largest of the ep groups', `Program.expert_imbalance`)
    next to the plan's (``predicted_expert_imbalance``): what to pin as ``--expert-imbalance`` to price this routing.
    Empty without ep."""
    if not records or "predicted_expert_imbalance" not in records[0]:
        return {}
    measured = [r["expert_imbalance"] for r in records if r.get("expert_imbalance") is not None]
    return {"expert_imbalance": max(measured, default=None),
            "predicted_expert_imbalance": records[0]["predicted_expert_imbalance"]}


def on_rank0(fn) -> None:
    """Run `fn` on rank 0 and raise its `PartcError` on every rank (one verdict, the same line everywhere)."""
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except PartcError as e:
            verdict[0] = str(e)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise PartcError(verdict[0])


def _fault(name: str) -> tuple[int, int] | None:
    value = os.environ.get(f"PARTC_FAULT_{name}")
    if not value:
        return None
    rank, step = value.split(":")
    return int(rank), int(step)


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit code (0, 2 for a user error, 1 for any other). A failure is reported
    (`supervise.report`) and leaves the process group as it is: the process is about to exit, and destroying a
    group whose peers are gone can hang."""
    try:
        args = options.parse(sys.argv[1:] if argv is None else argv)
        options.check_paths(args)
        train(args)
    except PartcError as e:
        supervise.report(str(e), kind="user")
        return 2
    except Exception as e:
        heartbeat = supervise.current_heartbeat()
        stalled = heartbeat.stalled() if heartbeat else []
        if stalled:  # the cause, not the collective that gave up waiting for it
            supervise.report(f"{supervise.stall_message(stalled, heartbeat.timeout_s)}; rank {heartbeat.rank}: "
                             f"{supervise.summary_line(e)}", kind="stall", stalled=[r for r, _, _ in stalled])
            supervise.kill_siblings(stalled)
        elif (peer := supervise.peer_failure()) is not None:  # the echo of another rank's failure
            supervise.report(f"after rank {peer[0]} failed: {supervise.summary_line(e)}", kind="internal")
        else:
            traceback.print_exc()
            supervise.report(supervise.summary_line(e), kind="internal")
        return 1
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
    supervise.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a worker quietly; `partc run` says what happened
    try:
        code = main()
    except SystemExit as e:  # --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    exit_now(code)
