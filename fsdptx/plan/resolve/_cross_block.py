"""Cross-block units: the units ``shard_across_blocks``'s requests ask for.

:func:`plan_cross_block_units` makes one fp32 unit per block-relative name,
spanning every block's instance of it (attention sinks and other holders
whose forward ignores its input), splitting a holder's children of other
dtypes into units of their own first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...core._tree import get_module_from_path
from ...model._index import PlanningError, unwrap_checkpoint
from .._types import preview
from ._claim import claim
from ._resolver import _Resolver
from ._target import _non_fp32, _split_children


def plan_cross_block_units(
    r: _Resolver, blocks: Sequence[str], names: Sequence[str], reshard: bool | int | None
) -> None:
    """One unit per dotted name, spanning every block's instance of it.

    Holders whose forward ignores its input never trigger FSDP2's per-unit
    post-backward hook, so each would be reduce-scattered alone after the whole
    backward; one unit across blocks makes that one collective, and keeping it
    unsharded after forward (a few KiB) avoids a re-gather per block and per
    checkpoint recompute.

    A name may also point at a module that holds fp32 parameters directly
    beside children of other dtypes (GPT-OSS ``self_attn.sinks`` beside the
    bf16 projections): each instance's children get their dtype units first
    (``reshard`` as the dtype request's), so the cross-block unit owns only
    the direct fp32 parameters.
    """
    index = r.index
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise PlanningError(f"shard_across_blocks: module names {repeated} are listed more than once")
    policy = r.policy(torch.float32, True)
    block_modules = [unwrap_checkpoint(index.module(b, "shard_across_blocks block")) for b in blocks]
    prefixes = [f + "." if f else "" for f in map(index.fqn_of, block_modules)]
    for name in names:
        found: list[nn.Module] = []
        for prefix, block in zip(prefixes, block_modules):
            # The index names every module by its path on a tree; a module
            # it lists under another path (shared) is followed by hand.
            held = index.modules.get(prefix + name)
            if held is None:
                try:
                    held = get_module_from_path(block, name)
                except AttributeError:
                    continue
            found.append(held)
        if not found:
            raise PlanningError(
                f"shard_across_blocks: no block has a submodule {name!r} "
                f"(searched {len(blocks)} blocks: {preview(blocks)}); fix the name in "
                "_fsdp_shard_across_blocks or module_names="
            )
        below: list[str] = []
        reached = claim(index, found, r.sharded)
        claimed: list[tuple[str, nn.Parameter]] | None = reached
        bad = _non_fp32(r, reached)
        if bad:
            direct = [
                (index.param_fqn[id(p)], p)
                for m in found
                for p in m._parameters.values()
                if p is not None and id(p) not in r.excluded
            ]
            bad_direct = _non_fp32(r, direct)
            if bad_direct or not direct:
                where = "directly" if bad_direct else "in its subtree, and none directly"
                raise PlanningError(
                    f"shard_across_blocks: {name!r} must hold fp32 parameters (its unit computes and "
                    f"reduces in fp32), but holds {where} "
                    + ", ".join(f"{f} is {str(p.dtype).removeprefix('torch.')}" for f, p in bad_direct or bad)
                    + "; store them in fp32, name the module that holds the fp32 parameters "
                    "directly, or drop the name from the cross-block list"
                )
            below = [f for holder in found for f in _split_children(r, holder, reshard)]
            claimed = None  # the children are units now: claim again
        unit = r.add(found, "cross-block", policy, False, claimed, below)
        if not unit.params:
            raise PlanningError(
                f"shard_across_blocks: {name!r} matched {len(found)} modules but they hold no "
                "parameter not already owned by another unit"
            )
