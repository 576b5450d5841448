"""Module globs and the wrappers they see through.

TP plans, expert globs and block lists name modules by dotted globs in
which ``*`` matches one segment (``layers.*.attn.q_proj``), as torch's
``parallelize_module`` reads them. Wrappers that insert a segment of their
own (activation checkpointing's ``checkpoint_wrapper``, ``torch.compile``'s
``OptimizedModule``, FSDP1) are seen through: a glob matches the *logical*
FQN, with those segments removed, and resolves to the innermost module.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from ._torch_internals import WRAPPER_SEGMENTS

__all__ = ["WRAPPER_SEGMENTS", "innermost", "logical_fqn", "match_logical", "segment_match", "unwrap"]

def segment_match(pattern: str, fqn: str) -> bool:
    """``layers.*.attn.q_proj`` matches ``layers.3.attn.q_proj``: globs
    match one dotted segment each (so ``*`` never swallows a whole subtree)."""
    ps, fs = pattern.split("."), fqn.split(".")
    return len(ps) == len(fs) and all(fnmatch.fnmatchcase(f, p) for p, f in zip(ps, fs))


def logical_fqn(fqn: str) -> str:
    """``fqn`` without wrapper segments: ``layers.0._checkpoint_wrapped_module.attn``
    reads ``layers.0.attn``."""
    if "_" not in fqn:
        return fqn
    return ".".join(s for s in fqn.split(".") if s not in WRAPPER_SEGMENTS)


def unwrap(module: nn.Module) -> nn.Module:
    """The module a chain of wrappers holds (``module`` itself when unwrapped)."""
    while True:
        children = module._modules
        for segment in WRAPPER_SEGMENTS:
            inner = children.get(segment)
            if inner is not None:
                module = inner
                break
        else:
            return module


def innermost(fqns: Iterable[str]) -> dict[str, str]:
    """Logical FQN -> the innermost real FQN bearing it: a wrapper and the
    module it wraps share a logical FQN, and styles belong on the module."""
    out: dict[str, str] = {}
    for f in fqns:
        key = logical_fqn(f)
        if key not in out or len(f) > len(out[key]):
            out[key] = f
    return out


def match_logical(pattern: str, by_logical: dict[str, str]) -> list[str]:
    """The real FQNs whose logical FQN ``pattern`` matches, in the order of ``by_logical``."""
    return [real for key, real in by_logical.items() if key and segment_match(pattern, key)]
