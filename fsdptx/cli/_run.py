"""Building the dry run's model and running the manager on a fake mesh."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..apply._apply import apply_plan
from ..core._meshes import KNOWN_DIMS, MOE_KNOWN_DIMS, ParallelDims, ep_size, moe_fsdp_mesh
from ..plan._plan import Plan
from ._report import ParamShard
from ..presets import PRESETS, build_preset
from ._ep import StaticDispatch
from ._memory import expert_dispatch_problems, traced
from ._trace import Trace
from ._common import APPLY_BUDGET, MAX_LAYERS, MAX_WORLD, UsageError, _DP_DIMS, _DTYPES, _one_line, param_shards


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"dp=2,tp=4"`` -> ``((2, 4), ("dp", "tp"))``, refusing meshes larger
    than :data:`MAX_WORLD` ranks before anything is built."""
    shape: list[int] = []
    names: list[str] = []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        # ASCII digits only: "²".isdigit() is True, but int("²") fails.
        if not sep or not name.isidentifier() or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise UsageError(f"malformed --mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] such as dp=2,tp=4")
        if name in names:
            raise UsageError(f"malformed --mesh {text!r}: axis {name!r} appears twice")
        if name not in KNOWN_DIMS:
            raise UsageError(f"--mesh {text!r}: unknown axis {name!r}; name each axis one of {', '.join(KNOWN_DIMS)}")
        names.append(name)
        shape.append(int(size))
    world = math.prod(shape)
    if world > MAX_WORLD:
        raise UsageError(f"--mesh {text!r} has {world:,} ranks; the dry run simulates at most {MAX_WORLD:,}")
    if not any(n in _DP_DIMS for n in names):
        raise UsageError(
            f"--mesh {text!r} has no data-parallel axis ({', '.join(_DP_DIMS)}); add dp=1 for tensor parallelism alone"
        )
    return tuple(shape), tuple(names)


def parse_moe_mesh(text: str, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``--moe-mesh "dp_shard=2,ep=2"`` -> ``((2, 2), ("dp_shard", "ep"))``:
    the experts' view of the same ``world`` ranks as ``--mesh`` (refused
    when it spans another number of ranks, or names a dim a MoE mesh
    cannot have)."""
    shape: list[int] = []
    names: list[str] = []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not name.isidentifier() or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise UsageError(f"malformed --moe-mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] such as dp_shard=2,ep=2")
        if name in names:
            raise UsageError(f"malformed --moe-mesh {text!r}: axis {name!r} appears twice")
        if name not in MOE_KNOWN_DIMS:
            raise UsageError(f"--moe-mesh {text!r}: unknown axis {name!r}; name each axis one of {', '.join(MOE_KNOWN_DIMS)}")
        names.append(name)
        shape.append(int(size))
    if math.prod(shape) != world:
        raise UsageError(
            f"--moe-mesh {text!r} spans {math.prod(shape):,} ranks but --mesh spans {world:,}; "
            "the MoE mesh is another view of the same ranks"
        )
    return tuple(shape), tuple(names)


def _parse_value(text: str) -> object:
    """``--hf-config`` values: int, then float, then true/false, else the string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    return text


def parse_hf_config(items: Sequence[str]) -> dict[str, object]:
    """``["num_hidden_layers=2,hidden_size=64"]`` -> ``{"num_hidden_layers": 2, "hidden_size": 64}``."""
    out: dict[str, object] = {}
    for text in items:
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            if not sep or not key.isidentifier() or not value:
                raise UsageError(f"malformed --hf-config {text!r}: expected KEY=VALUE[,KEY=VALUE...]")
            out[key] = _parse_value(value)
    return out


def _exited(what: str, e: SystemExit) -> UsageError:
    return UsageError(f"{what} called sys.exit({e.code!r}); it must return an nn.Module instead of exiting")


def load_factory(spec: str) -> Callable[[], nn.Module]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"malformed --factory {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:
        raise _exited(f"importing {module_name!r} for --factory", e) from None
    except Exception as e:  # any import-time failure is the user's factory failing
        raise UsageError(f"cannot import {module_name!r} for --factory: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--factory {spec!r}: {module_name} has no callable {attr!r}")
    return cast(Callable[[], nn.Module], factory)  # a user callable: what it returns is checked by the caller


def _build_hf(args: argparse.Namespace) -> nn.Module:
    from ..hf import build_hf_model

    overrides = parse_hf_config(args.hf_config)
    layers = overrides.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise UsageError(f"--hf-config num_hidden_layers must be at most {MAX_LAYERS:,}, got {layers:,}")
    dtype = _DTYPES[args.dtype or "bf16"]
    try:
        return build_hf_model(args.hf, overrides, dtype=dtype, device="meta")
    except ImportError as e:
        raise UsageError(str(e)) from None
    except SystemExit as e:
        raise _exited(f"building --hf {args.hf!r}", e) from None
    except Exception as e:  # unknown type, bad override: the config's own message says which
        raise UsageError(f"cannot build --hf {args.hf!r}: {type(e).__name__}: {_one_line(e)}") from None


def build_model(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """Construct on the meta device (shapes and dtypes without memory);
    returns the model and the name the report shows."""
    if args.hf is None and args.hf_config:
        raise UsageError("--hf-config needs --hf MODEL_TYPE (or --hf path/to/config.json)")
    if args.hf is None and args.dtype is not None:
        raise UsageError("--dtype applies to --hf models; presets and factories choose their own dtypes")
    if args.layers is not None and (args.hf or args.factory):
        raise UsageError("--layers applies to presets; for --hf use --hf-config num_hidden_layers=N")
    if args.hf is not None:
        model = _build_hf(args)
        return model, f"{args.hf} ({type(model).__name__}, {args.dtype or 'bf16'})"
    with torch.device("meta"):
        if args.factory:
            factory = load_factory(args.factory)
            try:
                model = factory()
            except SystemExit as e:
                raise _exited(f"--factory {args.factory!r}", e) from None
            except Exception as e:
                raise UsageError(f"--factory {args.factory!r} raised {type(e).__name__}: {_one_line(e)}") from None
            if not isinstance(model, nn.Module):
                raise UsageError(f"--factory {args.factory!r} returned {type(model).__name__}, not an nn.Module")
            return model, args.factory
        preset = args.preset or "mixed"
        layers = 16 if args.layers is None else args.layers
        if preset not in PRESETS:
            raise UsageError(f"unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
        if not 1 <= layers <= MAX_LAYERS:
            raise UsageError(f"--layers must be between 1 and {MAX_LAYERS:,}, got {layers:,}")
        batch_seq = _batch_seq(args)  # a traced step sizes the preset's position tables, if it has any
        model = build_preset(preset, layers, seq=None if batch_seq is None else batch_seq[1])
        return model, f"{preset} (preset, {layers} layers)"


@dataclass(frozen=True)
class MoeDims:
    """The dry run's MoE mesh: its dims, the ``ep`` size experts are split
    across, and the FSDP shard count of expert units (the MoE mesh's
    data-parallel shard dims; its replicate dims hold copies)."""

    mesh: dict[str, int]
    ep: int
    shard: int


@dataclass(frozen=True)
class DryRun:
    """What the dry run produced: the Plan, each parameter's rank-0 shard,
    and how it got them (``applied``: ``"full"`` when ``parallelize`` ran,
    ``"tp"`` when only TP was applied and FSDP shards were computed from
    shapes, ``"none"`` when nothing needed applying); ``moe`` with
    ``--moe-mesh``."""

    plan: Plan
    dims: ParallelDims
    shards: dict[str, ParamShard]
    applied: str
    params: int
    trace: Trace | None = None
    moe: MoeDims | None = None


@contextlib.contextmanager
def _plan_warnings_not_logged() -> Iterator[None]:
    """``parallelize`` logs the Plan's warnings; the report prints them
    itself (first lines, ``"warnings"`` in JSON), so the dry run keeps them
    off stderr, where a refusal must be the one line."""
    manager_logger = logging.getLogger("fsdptx.manager")
    was = manager_logger.disabled
    manager_logger.disabled = True
    try:
        yield
    finally:
        manager_logger.disabled = was


def _not_dispatched(module: nn.Module, mesh: object) -> None:
    """The dry run's stand-in for telling expert modules their ep mesh: it
    places the expert weights and never runs a forward through them, so
    the model's token dispatch is not needed (nor checked) here."""
    del module, mesh


def dry_run(
    model: nn.Module,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    config: Any,
    *,
    batch_seq: tuple[int, int] | None = None,
    moe: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
    cp_rotate: str = "allgather",
    routing_skew: float = 1.0,
) -> DryRun:
    """Plan with the manager and apply on a fake mesh (within :data:`APPLY_BUDGET`);
    with ``batch_seq``, also trace one training step (:func:`trace_step`;
    with a ``cp`` dim > 1 at ``seq / cp``, ring attention's ``cp_rotate``
    buffers modelled);
    with ``moe`` (shape and dim names), expert modules shard over that MoE
    mesh, split by expert across its ``ep`` dim when it has one (a traced
    step then runs their token dispatch at sizes fixed by ``routing_skew``,
    :mod:`fsdptx.cli._ep`)."""
    with fake_world(shape, names, moe) as (mesh, moe_mesh):
        return dry_run_on(model, mesh, moe_mesh, config, batch_seq=batch_seq, cp_rotate=cp_rotate, routing_skew=routing_skew)


@contextlib.contextmanager
def fake_world(
    shape: tuple[int, ...], names: tuple[str, ...], moe: tuple[tuple[int, ...], tuple[str, ...]] | None = None
) -> Iterator[tuple[DeviceMesh, DeviceMesh | None]]:
    """A fake world of ``shape`` ranks: its mesh, and the MoE mesh ``moe``
    (shape and dim names) over the same ranks when given. Dry runs that
    share one world share DTensor's sharding decisions, which a world
    forgets when it closes (:func:`fsdptx.testing.fake_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..testing import fake_mesh  # the fake backend is only needed here

    with fake_mesh(shape, names) as mesh:
        yield mesh, None if moe is None else init_device_mesh("cpu", moe[0], mesh_dim_names=moe[1])


def dry_run_on(
    model: nn.Module,
    mesh: DeviceMesh,
    moe_mesh: DeviceMesh | None,
    config: Any,
    *,
    batch_seq: tuple[int, int] | None = None,
    cp_rotate: str = "allgather",
    routing_skew: float = 1.0,
) -> DryRun:
    """:func:`dry_run` in an open :func:`fake_world` (its ``mesh`` and ``moe_mesh``)."""
    from ..manager import FSDP2Manager

    n_params = sum(1 for _ in model.parameters())
    manager = FSDP2Manager(config, mesh, moe_mesh)
    dims = manager.dims
    p = manager.plan(model)
    ep = ep_size(moe_mesh)
    dispatch = None
    if ep > 1 and batch_seq is not None:
        problems = expert_dispatch_problems(model, p)
        if problems:
            raise UsageError(problems[0])
        dispatch = StaticDispatch(routing_skew)
    moe_dims = None
    if moe_mesh is not None:
        flat = moe_fsdp_mesh(moe_mesh, mesh)
        moe_dims = MoeDims(mesh=dict(zip(moe_mesh.mesh_dim_names or (), moe_mesh.shape)), ep=ep, shard=flat.size(flat.ndim - 1))
    tp_cost = n_params * (dims.tp if dims.tp > 1 else 0)
    fsdp_cost = n_params * (dims.dp_shard if p.units else 0)
    if tp_cost + fsdp_cost <= APPLY_BUDGET:
        if ep > 1:
            apply_plan(p, model, mesh, moe_mesh=moe_mesh, hand_ep_mesh=_not_dispatched if dispatch is None else dispatch)
        else:
            with _plan_warnings_not_logged():
                manager.parallelize(model)
        applied = "full" if (p.units or p.tensor_parallel) else "none"
    elif tp_cost <= APPLY_BUDGET:
        # TP alone (and checkpointing, marks): the FSDP split is computed from shapes.
        bare = p.replace(units=(), prefetch=(), reduce_unused_params=False, expert_parallel=None)
        apply_plan(bare, model, mesh)
        applied = "tp" if p.tensor_parallel else "computed"
    else:
        raise UsageError(
            f"tp={dims.tp} over {n_params:,} parameters is more than the dry run simulates "
            f"({APPLY_BUDGET:,} parameter shards); use a smaller tp"
        )
    shards = param_shards(
        model, p, dims, fsdp_applied=applied == "full", moe=None if moe_dims is None else (moe_dims.shard, moe_dims.ep)
    )
    trace = (
        None
        if batch_seq is None
        else traced(
            model, p, applied, batch_seq, mesh, cp=dims.cp, tp=dims.tp, cp_rotate=cp_rotate, dispatch=dispatch
        )
    )
    return DryRun(plan=p, dims=dims, shards=shards, applied=applied, params=n_params, trace=trace, moe=moe_dims)


def _batch_seq(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--batch``/``--seq`` (defaults 1 and 2048), or None when nothing asks for a trace."""
    if args.batch is None and args.seq is None and args.html is None and args.fit is None:
        return None
    batch = 1 if args.batch is None else args.batch
    seq = 2048 if args.seq is None else args.seq
    if batch < 1 or seq < 1:
        raise UsageError(f"--batch and --seq must be >= 1, got --batch {batch} --seq {seq}")
    return batch, seq
