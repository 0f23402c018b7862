"""The parallel configuration of a plan: degrees, batching, ZeRO, recomputation and schedule."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
RECOMPUTE = ("none", "selective", "full")
TP_STYLES = ("colwise", "rowwise", "replicate")


@dataclass(kw_only=True, slots=True, frozen=True)
class Parallel:
    dp: int
    """Data-parallel degree (mesh axis ``dp``)."""
    tp: int
    """Tensor-parallel degree (mesh axis ``tp``), inside a node."""
    pp: int
    """Pipeline-parallel degree: number of pipeline ranks (mesh axis ``pp``)."""
    zero: int
    """ZeRO stage 0-3 over the ``dp`` axis: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    micro_batch_size: int
    """Samples per micro-batch on one pipeline."""
    global_batch_size: int
    """Samples per optimizer step over all data-parallel replicas."""
    schedule: str = "1f1b"
    """``1f1b``, ``interleaved-1f1b`` or ``gpipe``."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (``interleaved-1f1b`` only; 1 otherwise)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (attention core) or ``full`` (block inputs only)."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per step: m = B / (dp * b)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        """Pipeline stages (model chunks): pp * virtual_stages."""
        return self.pp * self.virtual_stages
