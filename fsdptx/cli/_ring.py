"""Ring attention's K/V rotation buffers on one CP rank, in closed form
(the model-reading and trace side is :mod:`fsdptx.cli._cp`, which says
what is traced and what is modelled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GRAD_BYTES", "AttentionLayer", "RingAttention"]

GRAD_BYTES = 4  # torch accumulates and rotates dK/dV in fp32 (_cp_options.convert_to_f32)


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module: its FQN, the FSDP unit it runs in (the
    innermost; ``""`` the root), and its K plus V bytes per token on this
    TP rank in the compute dtype."""

    module: str
    unit: str
    kv_bytes_per_token: int
    kv_width: int  # K + V out features on this TP rank


@dataclass(frozen=True)
class RingAttention:
    """Ring attention's modelled buffers on one CP rank (bytes; per attention
    call, one layer's at a time: the largest layer's)."""

    cp: int
    rotate_method: str
    seq: int
    batch: int
    layers: tuple[AttentionLayer, ...]

    @property
    def seq_per_rank(self) -> int:
        return self.seq // self.cp

    def kv_buffer(self, layer: AttentionLayer) -> int:
        """K and V held by the rotation while ``layer``'s attention runs."""
        tokens = self.seq if self.rotate_method == "allgather" else 2 * self.seq_per_rank
        return self.batch * tokens * layer.kv_bytes_per_token

    def grad_kv_buffer(self, layer: AttentionLayer) -> int:
        """Backward's dK and dV rotation: two fp32 chunks in flight (always all-to-all)."""
        return 2 * self.batch * self.seq_per_rank * layer.kv_width * GRAD_BYTES

    @property
    def kv_buffer_bytes(self) -> int:
        return max((self.kv_buffer(layer) for layer in self.layers), default=0)

    @property
    def grad_kv_buffer_bytes(self) -> int:
        return max((self.grad_kv_buffer(layer) for layer in self.layers), default=0)

    def note(self) -> str:
        return (
            f"context parallelism: modelled, not traced (torch's ring attention has no CPU path): the step is "
            f"traced at seq/cp = {self.seq_per_rank} tokens per CP rank (head-tail load balancing), and "
            f"ring attention's {self.rotate_method} K/V rotation adds {self.kv_buffer_bytes:,} B "
            f"(+ {self.grad_kv_buffer_bytes:,} B of fp32 dK/dV chunks in backward) to every sample of a unit "
            f"running attention, one layer's buffer live at a time"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "cp": self.cp,
            "rotate_method": self.rotate_method,
            "seq_per_rank": self.seq_per_rank,
            "attention_layers": len(self.layers),
            "kv_buffer_bytes": self.kv_buffer_bytes,
            "grad_kv_buffer_bytes": self.grad_kv_buffer_bytes,
        }
