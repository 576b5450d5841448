"""Record the collectives a call issues, to compare what different ranks do.

A rank that issues a different sequence of collectives than its peers hangs
the job on real hardware; on a fake mesh the mismatch is silent. Recording
``(op, group ranks, shapes, dtypes)`` per rank makes it a plain list equality.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core._torch_internals import TorchDispatchMode, op_schema_name, resolve_process_group, tree_flatten

__all__ = ["Collective", "record_collectives"]

_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


@dataclass(frozen=True)
class Collective:
    """One collective as issued: op name (``allreduce_``, ``broadcast_``, ...),
    the global ranks of its group, and the shape and dtype of each tensor
    argument in order.

    Attributes:
        op: the c10d op name.
        group: the global ranks of its group.
        shapes: the shape of each tensor argument.
        dtypes: the dtype of each tensor argument.

    Example::

        with fsdptx.testing.record_collectives() as calls:
            fsdptx.synchronize_tp_replica_gradients([model], mesh)
        assert all(c.group == (0, 1) for c in calls)
    """

    op: str
    group: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


def _group_ranks(args: list[Any]) -> tuple[int, ...]:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue  # a ReduceOp or another script object
            return tuple(dist.get_process_group_ranks(pg))
        if isinstance(a, str):  # functional collectives name their group
            try:
                pg = resolve_process_group(a)
            except RuntimeError:
                continue  # a reduce-op name such as "sum"
            return tuple(dist.get_process_group_ranks(pg))
    return ()


class _Recorder(TorchDispatchMode):
    def __init__(self, out: list[Collective]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.out = out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES:
            flat, _ = tree_flatten((args, kwargs))
            group = _group_ranks(flat)
            if group:  # helpers such as wait_tensor name no group: not collectives
                tensors = [t for t in flat if isinstance(t, torch.Tensor)]
                self.out.append(
                    Collective(
                        op=op_schema_name(func).split("::")[-1],
                        group=group,
                        shapes=tuple(tuple(t.shape) for t in tensors),
                        dtypes=tuple(t.dtype for t in tensors),
                    )
                )
        return func(*args, **kwargs)


@contextmanager
def record_collectives() -> Iterator[list[Collective]]:
    """Collect, in issue order, every c10d collective run inside the block.

    Works for ``torch.distributed`` calls, functional collectives and the ones
    FSDP2/DTensor issue internally, on fake and real process groups alike::

        with record_collectives() as calls:
            synchronize_tp_replica_gradients([model], mesh)
        assert [c.op for c in calls] == ["allreduce_", "allreduce_"]

    Yields:
        The list the collectives are appended to, as they are issued.

    Example::

        with record_collectives() as calls:
            fsdptx.broadcast_tp_replicas([model], mesh)
        print([c.op for c in calls])
    """
    out: list[Collective] = []
    with _Recorder(out):
        yield out
