"""The options of ``python -m partc.runtime OUT ...`` and ``partc run OUT ...``: one parser for both, and the
checks that need no process group, so that `partc run` refuses a bad option with one line before it starts any
process (the workers run the same checks: torchrun may start them without `partc run`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from partc.errors import PartcError
from partc.mesh_axes import MESH, MESH_AXES
from partc.runtime.optim import OPTIMIZERS, SCHEDULES

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
MAX_SEED = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (argparse would print the usage too): a `PartcError`, printed as ``error: ...``, exit 2."""
        raise PartcError(f"{message} (see python -m partc.runtime --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m partc.runtime", description="Train a partc program under torchrun.")
    p.add_argument("out_dir", help="output directory of `partc compile` (plan.json and program/)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to run in total (default 10)")
    p.add_argument("--seed", type=int, default=0, help="data and initialization seed (default 0)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="weight decay (default 0); never on norms, biases and position tables")
    p.add_argument("--beta1", type=float, default=0.9, help="AdamW's beta1 (default 0.9)")
    p.add_argument("--beta2", type=float, default=0.999, help="AdamW's beta2 (default 0.999; nanoGPT uses 0.95)")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW's eps (default 1e-8)")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                   help="learning rate after the warm-up: constant, or cosine/linear decay to --min-lr "
                        "(default constant)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    p.add_argument("--lr-decay-steps", type=int, default=None,
                   help="the step the decay reaches --min-lr (default --steps)")
    p.add_argument("--min-lr", type=float, default=0.0, help="the decay's floor (default 0)")
    p.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                   help="clip the gradients to this global norm (default: no clipping)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="token ids to train on: a .bin of uint16 (nanoGPT's) or a 1-D .npy, cut into samples of "
                        "seq_len + 1 tokens (default: the model file's dataset(), else random example_inputs)")
    p.add_argument("--data-workers", type=int, default=None,
                   help="loader processes per rank (default 2 on an accelerator, 0 on a CPU)")
    p.add_argument("--init-checkpoint", default=None,
                   help="initial weights: torch.save(model.state_dict()) or a safetensors file (whole tensors)")
    p.add_argument("--log-jsonl", default=None,
                   help="rank 0 writes a line per step: {step, loss, grad_norm, lr, clipped, tokens_per_s (or "
                        "samples_per_s), step_time_s, mfu, predicted_mfu, ranks: [{rank, "
                        f"{', '.join(a.rank_key for a in MESH)}, comm_bytes {{{', '.join(MESH_AXES)}}}, "
                        "predicted_comm_bytes, peak_memory_bytes, predicted_memory_bytes}, ...]}; under ep also "
                        "expert_imbalance (measured: the most rows an ep rank received over the mean) and "
                        "predicted_expert_imbalance (the plan's), and each rank's expert_rows")
    p.add_argument("--save-full-state-dict", default=None,
                   help="at the end, gather the model's state_dict() and torch.save it here (rank 0)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="sharded checkpoints of one run (torch.distributed.checkpoint); must be new or empty "
                        "unless --resume")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run of --checkpoint-dir from its newest checkpoint")
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S, metavar="SECONDS",
                   help="a collective waiting longer, or a rank silent longer, stops the job (default 600)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse and check the options (values only, no file system); raises `PartcError`."""
    args = parser().parse_args(argv)
    if args.steps < 0:
        raise PartcError(f"--steps must be >= 0, got {args.steps}")
    if args.checkpoint_every < 0:
        raise PartcError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if not 0 <= args.seed <= MAX_SEED - args.steps:
        raise PartcError(f"--seed must be between 0 and 2**63 - 1 - --steps, got {args.seed}")
    for flag, value in (("--lr", args.lr), ("--weight-decay", args.weight_decay), ("--min-lr", args.min_lr)):
        if not math.isfinite(value) or value < 0:
            raise PartcError(f"{flag} must be a finite number >= 0, got {value}")
    if args.min_lr > args.lr:
        raise PartcError(f"--min-lr ({args.min_lr:g}) must not exceed --lr ({args.lr:g})")
    for flag, value in (("--beta1", args.beta1), ("--beta2", args.beta2)):
        if not 0 <= value < 1:
            raise PartcError(f"{flag} must be in [0, 1), got {value}")
    if not (math.isfinite(args.eps) and args.eps > 0):
        raise PartcError(f"--eps must be a positive number, got {args.eps}")
    for flag, value in (("--warmup-steps", args.warmup_steps), ("--lr-decay-steps", args.lr_decay_steps),
                        ("--data-workers", args.data_workers)):
        if value is not None and value < 0:
            raise PartcError(f"{flag} must be >= 0, got {value}")
    if args.grad_clip is not None and not (math.isfinite(args.grad_clip) and args.grad_clip > 0):
        raise PartcError(f"--grad-clip must be a positive number, got {args.grad_clip}")
    if not math.isfinite(args.collective_timeout) or args.collective_timeout <= 0:
        raise PartcError(f"--collective-timeout must be a positive number of seconds, got {args.collective_timeout}")
    if args.resume and not args.checkpoint_dir:
        raise PartcError("--resume needs --checkpoint-dir (the directory of the run to continue)")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise PartcError("--checkpoint-every needs --checkpoint-dir")
    return args


def check_paths(args: argparse.Namespace) -> None:
    """The input files exist and the output files can be written (a missing directory would otherwise fail
    after the training, when the file is written)."""
    if args.data is not None:
        path = Path(args.data)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise PartcError(f"--data {path} {what}; pass a .bin (uint16 token ids) or a 1-D .npy file")
        if path.suffix not in (".bin", ".npy"):
            raise PartcError(f"--data {path}: expected a .bin (uint16 token ids, as nanoGPT writes) or .npy file")
    if args.init_checkpoint is not None:
        path = Path(args.init_checkpoint)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise PartcError(f"--init-checkpoint {path} {what}; pass a torch.save(model.state_dict()) or "
                             f"safetensors file")
    for flag, value in (("--log-jsonl", args.log_jsonl), ("--save-full-state-dict", args.save_full_state_dict)):
        if value is None:
            continue
        path = Path(value)
        if path.is_dir():
            raise PartcError(f"{flag} {path} is a directory; pass a file name")
        if not path.resolve().parent.is_dir():
            raise PartcError(f"{flag} {path}: directory {path.resolve().parent} does not exist")
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).exists() \
            and not Path(args.checkpoint_dir).is_dir():
        raise PartcError(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory")
