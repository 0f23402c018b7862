"""The optimizer side of a step: the optimizers over each stage's sharded fp32 weights, their parameter groups, the
learning-rate schedule and gradient clipping by the global norm.

Parameter groups. Weight decay (AdamW's decoupled decay, SGD's L2 penalty) applies to the matrices only: no
parameter with fewer than two dimensions (norm weights, biases) and no table of learned positions (an
``nn.Embedding`` whose name says positions: ``pos``, ``wpe``, ``position_embeddings``) is decayed, as nanoGPT and
torchtitan do. The groups are decided on the model built on meta (its module types), so they do not depend on the
plan.

Schedule. The learning rate of step k (0-based) is a function of k alone (`LRSchedule.lr_at`): linear warm-up
``lr·(k+1)/warmup`` for the first ``warmup`` steps, then ``constant``, ``cosine`` or ``linear`` decay from ``lr`` to
``min_lr`` over the remaining ``total - warmup`` steps (held at ``min_lr`` after them). Being a function of the
step, its state in a checkpoint is its settings and the step; `--resume` restores both.

Clipping. The global gradient norm is the norm over every parameter of the model once, whatever the plan: each
rank sums the squares of the gradient elements it holds, weighting each tensor by one over the number of ranks
and stages holding an identical copy of it (a parameter kept whole over tp is on every tp rank; ZeRO 0 keeps the
reduced gradient replicated over dp; a tied weight has a copy on each stage that holds it, summed by `GradSync`
before this), and the sums are added over the world in the all-reduce that already reports the loss
(`partc.runtime.train`). The gradients are then scaled by ``min(1, max_norm / (norm + 1e-6))``: what
``torch.nn.utils.clip_grad_norm_`` does on one process.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from partc.errors import PartcError

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear")

_POSITIONS = re.compile(r"(^|_)(pos|wpe|position|positions|pos_emb|pos_embed|position_embeddings)$")
"""Names of position tables (the last component of an ``nn.Embedding``'s FQN)."""


def _one_of(option: str, value: str, choices: tuple[str, ...]) -> None:
    """The one-line error of a command-line choice (`OPTIMIZERS`, `SCHEDULES`) that is none of them."""
    if value not in choices:
        raise PartcError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    name: str = "adamw"
    """``adamw`` (torch.optim.AdamW) or ``sgd`` (torch.optim.SGD, no momentum)."""
    lr: float = 3e-4
    """Peak learning rate (the schedule's)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD), on the decayed group only (module docstring)."""
    beta1: float = 0.9
    beta2: float = 0.999
    """AdamW's betas (torch's defaults; nanoGPT trains with 0.9, 0.95)."""
    eps: float = 1e-8
    """AdamW's eps."""

    def __post_init__(self) -> None:
        _one_of("--optimizer", self.name, OPTIMIZERS)
        if self.lr < 0 or self.weight_decay < 0:
            raise PartcError("--lr and --weight-decay must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise PartcError(f"--beta1 and --beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.eps > 0:
            raise PartcError(f"--eps must be > 0, got {self.eps}")

    def optimizer_class(self) -> tuple[type[torch.optim.Optimizer], dict]:
        if self.name == "sgd":
            return torch.optim.SGD, {"lr": self.lr, "weight_decay": self.weight_decay}
        return torch.optim.AdamW, {"lr": self.lr, "weight_decay": self.weight_decay,
                                   "betas": (self.beta1, self.beta2), "eps": self.eps}


@dataclass(kw_only=True, slots=True)
class LRSchedule:
    """The learning rate as a function of the step (module docstring)."""

    kind: str = "constant"
    lr: float = 3e-4
    warmup: int = 0
    """Warm-up steps."""
    total: int = 0
    """The step the decay reaches `min_lr` (0: no decay, whatever `kind`)."""
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        _one_of("--lr-schedule", self.kind, SCHEDULES)
        if self.warmup < 0 or self.total < 0:
            raise PartcError(f"--warmup-steps and --lr-decay-steps must be >= 0, got {self.warmup}, {self.total}")
        if not 0 <= self.min_lr <= self.lr:
            raise PartcError(f"--min-lr must be between 0 and --lr ({self.lr:g}), got {self.min_lr:g}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.kind == "constant" or self.total <= self.warmup:
            return self.lr
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr - (self.lr - self.min_lr) * progress

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LRSchedule:
        return cls(**{k: d[k] for k in ("kind", "lr", "warmup", "total", "min_lr")})


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def no_decay(model: nn.Module) -> set[str]:
    """The parameter FQNs (every alias) weight decay does not apply to: fewer than two dimensions, or an
    ``nn.Embedding`` of positions."""
    out = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        positions = isinstance(mod, nn.Embedding) and bool(_POSITIONS.search(mod_name.rpartition(".")[2]))
        for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if p.dim() < 2 or positions:
                out.add(prefix + name)
    return out


def param_groups(module: nn.Module, skip: set[str], weight_decay: float) -> list[dict]:
    """`module`'s trainable parameters in two groups: decayed, and not (`skip`, by FQN); an empty group is left
    out. Names under `SyncEveryStep` (``stage.``) are the stage's own."""
    decay, plain = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (plain if name.removeprefix("stage.") in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    # FSDP's sharded parameters (DTensors) apart from plain ones (packed experts under ZeRO-0 ep, which FSDP
    # leaves alone), and by mesh (packed experts under ZeRO 1-3 ep are sharded over their own): the optimizers'
    # fused updates take one kind a call.
    def mesh_of(p):
        return p.device_mesh if isinstance(p, DTensor) else None
    meshes = list(dict.fromkeys(mesh_of(p) for g in groups for p in g["params"]))
    groups = [{**g, "params": [p for p in g["params"] if mesh_of(p) == mesh]} for g in groups for mesh in meshes]
    return [g for g in groups if g["params"]]


def build_optimizers(modules: list[nn.Module], config: OptimizerConfig,
                     skip_decay: set[str] | None = None) -> list[torch.optim.Optimizer]:
    """One optimizer per stage module (torchtitan's per-model-part optimizers) over its sharded fp32 parameters
    (the master weights): its state dict is keyed by that module's FQNs. `skip_decay`: `no_decay` of the model."""
    cls, kwargs = config.optimizer_class()
    return [cls(param_groups(m, skip_decay or set(), config.weight_decay), **kwargs) for m in modules]


def grad_copies(stages: list[nn.Module], *, tp: int, dp: int, split: set[str], holders: dict[str, int],
                canon: dict[str, str], experts: frozenset[str] = frozenset(),
                ep: int = 1) -> list[tuple[nn.Parameter, float]]:
    """(parameter, weight) for every trainable parameter of this rank's `stages`: the weight is one over the number
    of identical copies of its gradient in the job (module docstring). `split`: the parameters the program splits
    over tp; `holders`: canonical FQN -> how many stages hold a copy."""
    out = []
    for st in stages:
        for name, p in st.named_parameters():
            if not p.requires_grad:
                continue
            c = canon.get(name, name)
            copies = holders.get(c, 1) * (1 if c in split or name in split else tp)
            if isinstance(p, DTensor):  # (packed experts under ZeRO 1-3 ep: sharded over the dp / ep > 1 holders)
                dp_split = any(isinstance(pl, Shard) and p.device_mesh.size(i) > 1 for i, pl in enumerate(p.placements))
                copies *= 1 if dp_split else dp
            else:  # packed experts FSDP leaves alone (ZeRO-0, or one holder): held by the dp / ep ranks holding them
                # (`dp` is dp x cp here: dp / ep x cp)
                copies *= dp // ep if name in experts else dp
            out.append((p, 1.0 / copies))
    return out


def local_sq_norm(copies: list[tuple[nn.Parameter, float]], device: torch.device) -> Tensor:
    """This rank's weighted sum of squared gradient elements (float64; summed over the world it is the global
    norm squared)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p, w in copies:
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if isinstance(g, DTensor) else g
        if g.numel():
            total += g.detach().double().pow(2).sum() * w
    return total


@torch.no_grad()
def clip_(params: list[nn.Parameter], norm: float, max_norm: float) -> bool:
    """Scale the gradients so that their global `norm` becomes at most `max_norm` (``clip_grad_norm_``'s
    arithmetic); returns whether they were scaled."""
    coef = max_norm / (norm + 1e-6)
    if coef >= 1.0:
        return False
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef)
    return True
