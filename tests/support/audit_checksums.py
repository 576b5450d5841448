"""``per_tensor(tensors)``: the TP-replica audit's row checksums, split back
per tensor. The audit returns every tensor's rows in one flat tensor (small
tensors are stacked in batches); its tests compare tensors one at a time."""

from __future__ import annotations

import torch

from fsdptx.tp._audit import _checksums

CPU = torch.device("cpu")


def per_tensor(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's row checksums."""
    rows, counts = _checksums(tensors, CPU)
    return list(rows.split(counts))
