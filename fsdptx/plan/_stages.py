"""Pipeline stages as data: the configuration, the records a Plan keeps,
and the pure split of a model into stages.

A pipelined Plan holds a :class:`Pipeline`: the schedule, the micro-batch
count and one :class:`Stage` per stage, each with the pipeline rank that
runs it, the parts it holds (module FQNs, as in the whole model) and the
stage's own Plan, made by the same transforms as a whole model's (dtype and
cross-block units, TP and the sequence layout, checkpointing, prefetch).
Splitting reads the model and changes nothing: :func:`plan_pipeline` plans
every stage on a stage module built by
:func:`fsdptx.model._stages.build_stage_module`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ..core._args import require_module, require_mp_policy, require_offload_policy
from ..core._names import name_tokens
from ..model._index import ModelIndex, PlanningError, discover_blocks, resolve_blocks
from ..model._stages import PipelineParts, build_stage_module, pipeline_parts, stage_of

from ._compose import Transform, plan_indexed
from ._plan import Pipeline, Placement, Plan, Stage

__all__ = [
    "MULTI_STAGE_SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "PipelineParallelConfig",
    "bubble_fraction",
    "in_flight_microbatches",
    "interleaved_1f1b_actions",
    "microbatch_problem",
    "plan_pipeline",
    "split_stages",
    "stage_ranks",
]

# torch.distributed.pipelining's schedules by the names its get_schedule_class
# takes: one stage per rank, or several.
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
_ALL_SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES


def _canonical_schedule(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"PipelineParallelConfig.schedule must be a schedule name (str), got {name!r}")
    found = {s.lower(): s for s in _ALL_SCHEDULES}.get(name.lower())
    if found is None:
        raise ValueError(f"PipelineParallelConfig.schedule: unknown schedule {name!r}; use one of {', '.join(_ALL_SCHEDULES)}")
    return found


def _optional_positive(value: object, name: str) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"PipelineParallelConfig.{name} must be None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class PipelineParallelConfig:
    """How to split a model into pipeline stages and run them.

    The model's blocks (the same blocks FSDP units are made of) are split
    over ``pp x stages_per_rank`` stages; the modules before the blocks
    (the embedding) join the first stage, those after them (norm, head) the
    last. Stages are either given (``stages``: one tuple of part FQNs per
    stage, in forward order) or split by ``layers_per_stage`` (every middle
    stage that many blocks; the first and last stages, which also hold the
    embedding and the head, may take fewer) or, by default, as evenly as
    the blocks allow (extra blocks go to the middle stages first).

    Attributes:
        schedule: a torch schedule name: ``"1F1B"`` or ``"GPipe"`` (one
            stage per rank), ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``
            (several).
        microbatches: micro-batches per optimizer step; ``None``: one per
            stage, the fewest that fill the pipeline.
        layers_per_stage: blocks per middle stage; ``None``: an even split.
        stages_per_rank: stages each pipeline rank runs (virtual stages).
        placement: ``"loop"`` (stage ``s`` on rank ``s % pp``) or ``"v"``
            (two stages per rank, the second in reverse order); ``None``:
            ``"v"`` for the V schedules, ``"loop"`` otherwise.
        stages: explicit part FQNs per stage.

    Example::

        pp = fsdptx.PipelineParallelConfig(schedule="1F1B", microbatches=8)
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(pipeline_parallel=pp), mesh)  # mesh has a "pp" dim
    """

    schedule: str = "1F1B"
    microbatches: int | None = None
    layers_per_stage: int | None = None
    stages_per_rank: int = 1
    placement: Placement | None = None
    stages: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        schedule = _canonical_schedule(self.schedule)
        object.__setattr__(self, "schedule", schedule)
        _optional_positive(self.microbatches, "microbatches")
        _optional_positive(self.layers_per_stage, "layers_per_stage")
        if type(self.stages_per_rank) is not int or self.stages_per_rank < 1:
            raise ValueError(f"PipelineParallelConfig.stages_per_rank must be an int >= 1, got {self.stages_per_rank!r}")
        if self.placement not in (None, "loop", "v"):
            raise ValueError(f"PipelineParallelConfig.placement must be None, 'loop' or 'v', got {self.placement!r}")
        multi = schedule in MULTI_STAGE_SCHEDULES
        if multi and self.stages_per_rank == 1:
            raise ValueError(
                f"PipelineParallelConfig: schedule {schedule!r} runs several stages per rank; give "
                f"stages_per_rank >= 2, or use {' or '.join(SINGLE_STAGE_SCHEDULES)} for one stage per rank"
            )
        if not multi and self.stages_per_rank > 1:
            raise ValueError(
                f"PipelineParallelConfig: schedule {schedule!r} runs one stage per rank, but stages_per_rank="
                f"{self.stages_per_rank}; use one of {', '.join(MULTI_STAGE_SCHEDULES)}, or stages_per_rank=1"
            )
        if self.resolved_placement == "v" and self.stages_per_rank != 2:
            raise ValueError(
                f"PipelineParallelConfig: the 'v' placement puts exactly two stages on each rank, got stages_per_rank={self.stages_per_rank}"
            )
        if schedule in _V_SCHEDULES and self.resolved_placement != "v":
            raise ValueError(f"PipelineParallelConfig: schedule {schedule!r} needs placement='v'")
        if self.stages is not None:
            if isinstance(self.stages, (str, bytes)) or not isinstance(self.stages, Sequence):
                raise TypeError(f"PipelineParallelConfig.stages must be a sequence of FQN sequences, got {self.stages!r}")
            object.__setattr__(
                self, "stages", tuple(name_tokens(s, f"PipelineParallelConfig.stages[{i}]") for i, s in enumerate(self.stages))
            )
            if self.layers_per_stage is not None:
                raise ValueError("PipelineParallelConfig: give stages or layers_per_stage, not both")

    @property
    def resolved_placement(self) -> Placement:
        """The placement in force: the given one, else the schedule's."""
        if self.placement is not None:
            return self.placement
        return "v" if self.schedule in _V_SCHEDULES else "loop"


def stage_ranks(num_stages: int, pp: int, placement: Placement) -> tuple[int, ...]:
    """The pipeline rank of each stage: ``loop`` puts stage ``s`` on rank
    ``s % pp``; ``v`` runs down the ranks and back up (rank 0 holds the
    first and the last stage)."""
    if placement == "loop":
        return tuple(s % pp for s in range(num_stages))
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(num_stages))


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a step in a synchronous pipeline schedule:
    ``(pp - 1) / (v * m + pp - 1)`` for ``v`` stages per rank and ``m``
    micro-batches (Narayanan et al., 2021)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """How many micro-batches' activations stage ``stage`` holds at most:
    GPipe runs every forward before any backward (all of them); 1F1B starts
    backward once the last stage has its first micro-batch, so stage ``s``
    holds at most ``num_stages - s``. Schedules with several stages per rank
    are counted like 1F1B over the stages, an upper bound per stage; what a
    rank of Interleaved1F1B holds at once follows from its order
    (:func:`interleaved_1f1b_actions`)."""
    if schedule == "GPipe":
        return microbatches
    return min(microbatches, num_stages - stage)


def interleaved_1f1b_actions(
    rank: int, pp: int, stages_per_rank: int, microbatches: int
) -> tuple[tuple[str, int, int], ...]:
    """The forwards (``"F"``) and backwards (``"B"``) pipeline rank ``rank``
    runs in one step of torch's ``ScheduleInterleaved1F1B``, as
    ``(kind, stage, micro-batch)`` in its order (its ``pipeline_order``
    without the idle slots; a test holds them equal).

    Why its own order and not a bound: a rank's stages reach their most
    micro-batches in flight at different times, and the last stage's
    micro-batches carry the logits; the sum of the stages' maxima
    overstates what the rank holds at once. The schedule: the micro-batches
    go in rounds of ``microbatches // pp`` (at least one); each rank first
    runs ``(stages_per_rank - 1)`` rounds of forwards plus two more per hop
    from the last rank (at most all of them), then one forward and one
    backward in turn, then the remaining backwards; forwards take the
    rank's stages in order a round at a time, backwards in reverse.

    Raises:
        ValueError: not a step torch's schedule runs (see :func:`microbatch_problem`).
    """
    if not 0 <= rank < pp or stages_per_rank < 1 or microbatches < 1 or not _interleaved_fits(microbatches, pp):
        raise ValueError(
            f"interleaved_1f1b_actions: rank {rank} of {pp} with {stages_per_rank} stages and "
            f"{microbatches} micro-batches is not an Interleaved1F1B step"
        )
    per_round = microbatches // max(1, microbatches // pp)
    total = stages_per_rank * microbatches
    warmup = min((stages_per_rank - 1) * per_round + 2 * (pp - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % stages_per_rank * pp + rank

    def backward_stage(op: int) -> int:
        return (stages_per_rank - 1 - (op - warmup) // per_round % stages_per_rank) * pp + rank

    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    out: list[tuple[str, int, int]] = []

    def run(kind: str, stage: int, done: dict[int, int]) -> None:
        out.append((kind, stage, done.get(stage, 0)))
        done[stage] = done.get(stage, 0) + 1

    for op in range(total + warmup):  # warmup forwards, total - warmup pairs, warmup backwards
        if op < total:
            run("F", forward_stage(op), forwards)
        if op >= warmup:
            run("B", backward_stage(op), backwards)
    return tuple(out)


def _interleaved_fits(microbatches: int, pp: int) -> bool:
    """torch's interleaved schedules split the micro-batches into
    ``microbatches // pp`` rounds (at least one) of equal size."""
    return microbatches % max(1, microbatches // pp) == 0


def microbatch_problem(schedule: str, microbatches: int, num_stages: int, pp: int) -> str | None:
    """Why torch's ``schedule`` would refuse ``microbatches`` for
    ``num_stages`` stages on ``pp`` ranks (``None`` when it runs them).

    torch checks this only when the schedule is built, after every stage
    has been sharded; the planner asks first, so the refusal comes before
    anything changes. 1F1B and DualPipeV need a micro-batch per stage;
    Interleaved1F1B and InterleavedZeroBubble split the micro-batches into
    ``microbatches // pp`` rounds of equal size.
    """
    if schedule in ("1F1B", "DualPipeV") and microbatches < num_stages:
        return (
            f"pipeline parallelism: schedule {schedule!r} needs at least one micro-batch per stage, got "
            f"microbatches={microbatches} for {num_stages} stages; use microbatches >= {num_stages}"
            + (" or schedule='GPipe'" if schedule == "1F1B" else "")
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and not _interleaved_fits(microbatches, pp):
        below = next(m for m in range(microbatches - 1, 0, -1) if _interleaved_fits(m, pp))
        above = next(m for m in range(microbatches + 1, 2 * microbatches + pp) if _interleaved_fits(m, pp))
        return (
            f"pipeline parallelism: schedule {schedule!r} splits the micro-batches into microbatches // pp = "
            f"{microbatches // pp} equal rounds on pp={pp}, which microbatches={microbatches} does not divide into; "
            f"use microbatches={below} or {above} (a multiple of pp always fits)"
        )
    return None


def _even_counts(n: int, stages: int) -> list[int]:
    base, extra = divmod(n, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def _counts_by_layers(n: int, stages: int, per: int) -> list[int]:
    """Middle stages ``per`` blocks each; the first and last take the rest,
    each between 1 and ``per`` (the last the smaller share: the head and
    loss are the costlier end)."""
    if stages == 1:
        if n > per:
            raise PlanningError(f"pipeline parallelism: layers_per_stage={per} on one stage holds at most {per} of the {n} blocks")
        return [n]
    rest = n - (stages - 2) * per
    if not 2 <= rest <= 2 * per:
        fits = [p for p in range(1, n + 1) if 2 <= n - (stages - 2) * p <= 2 * p]
        hint = f"; with {stages} stages use layers_per_stage in {fits[0]}..{fits[-1]}" if fits else ""
        raise PlanningError(
            f"pipeline parallelism: layers_per_stage={per} over {stages} stages does not fit {n} blocks "
            f"(the first and last stages would hold {rest} between them, each needs 1..{per}){hint}"
        )
    last = rest // 2
    return [rest - last] + [per] * (stages - 2) + [last]


def split_stages(parts: PipelineParts, config: PipelineParallelConfig, pp: int) -> tuple[tuple[str, ...], ...]:
    """The parts of each of ``pp x stages_per_rank`` stages, in forward order.

    Raises:
        PlanningError: fewer blocks than stages; ``layers_per_stage`` that
            does not fit; explicit stages that are not a contiguous split of
            every part, each once (the offending FQNs named).
    """
    num = pp * config.stages_per_rank
    ordered = parts.ordered
    if config.stages is not None:
        return _explicit_stages(parts, config.stages, num)
    n = len(parts.blocks)
    if n < num:
        raise PlanningError(
            f"pipeline parallelism: {n} blocks cannot fill {num} stages (pp={pp} x stages_per_rank="
            f"{config.stages_per_rank}); use fewer stages"
        )
    counts = _even_counts(n, num) if config.layers_per_stage is None else _counts_by_layers(n, num, config.layers_per_stage)
    out: list[tuple[str, ...]] = []
    start = 0
    for s, c in enumerate(counts):
        held = parts.blocks[start : start + c]
        start += c
        if s == 0:
            held = parts.before + held
        if s == num - 1:
            held = held + parts.after
        out.append(held)
    assert sum(len(h) for h in out) == len(ordered)
    return tuple(out)


def _explicit_stages(parts: PipelineParts, stages: tuple[tuple[str, ...], ...], num: int) -> tuple[tuple[str, ...], ...]:
    if len(stages) != num:
        raise PlanningError(f"pipeline parallelism: {len(stages)} explicit stages given for {num} stages (pp x stages_per_rank)")
    ordered = parts.ordered
    known = set(ordered)
    unknown = [f for s in stages for f in s if f not in known]
    if unknown:
        raise PlanningError(
            f"pipeline parallelism: stages name {unknown}, which are not parts of the model; its parts are "
            f"{list(ordered)}"
        )
    flat = [f for s in stages for f in s]
    twice = sorted({f for f in flat if flat.count(f) > 1})
    missing = [f for f in ordered if f not in flat]
    if twice or missing:
        raise PlanningError(
            f"pipeline parallelism: every part must be on exactly one stage; on several: {twice}, on none: {missing}"
        )
    if tuple(flat) != ordered:
        raise PlanningError(
            "pipeline parallelism: explicit stages must split the parts in forward order, each stage a contiguous "
            f"run; forward order is {list(ordered)}"
        )
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        raise PlanningError(f"pipeline parallelism: stages {empty} hold nothing")
    return stages


def _tied_across_stages(index: ModelIndex, stages: tuple[tuple[str, ...], ...]) -> list[str]:
    problems = []
    for pid, others in index.aliases.items():
        names = [index.param_fqn[pid], *others]
        where = {n: stage_of(n, stages) for n in names}
        if len(set(where.values())) > 1:
            problems.append(", ".join(f"{n} (stage {s})" for n, s in where.items()))
    return problems


def _stage_size(index: ModelIndex, held: tuple[str, ...]) -> tuple[int, int]:
    numel = nbytes = 0
    for fqn, p in index.params.items():
        if any(fqn == h or fqn.startswith(h + ".") for h in held):
            numel += p.numel()
            nbytes += p.numel() * p.element_size()
    return numel, nbytes


def plan_pipeline(
    model: nn.Module,
    transform: Transform,
    config: PipelineParallelConfig,
    *,
    pp: int,
    blocks: Sequence[str] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    index: ModelIndex | None = None,
) -> Plan:
    """Split ``model`` into stages and plan each one with ``transform``.

    Pure: every stage is planned on its own stage module (a new spine over
    ``model``'s parts), so the stage's units, TP styles and checkpointing
    are exactly what applying it will do, named by the whole model's FQNs.

    Args:
        model: the whole model; only read (a meta-device model works).
        transform: the transform each stage is planned with.
        config: how to split and schedule.
        pp: pipeline ranks (the mesh's ``pp`` size).
        blocks: the blocks to split (FQNs, class names or globs); the
            model's own when ``None``.
        mp_policy: the default policy units start from.
        offload_policy: the default offload policy.
        reshard_after_forward: the default reshard setting.
        index: the model's index, when the caller has one.

    Returns:
        A Plan whose ``pipeline`` holds every stage and its Plan.

    Raises:
        PlanningError: the model cannot be split as asked, tied
            parameters would land on different stages, or the schedule
            cannot run the micro-batch count; nothing is changed.

    Example::

        pipe = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.reshard_policy)
        p = fsdptx.plan_pipeline(model, pipe, fsdptx.PipelineParallelConfig(microbatches=4), pp=2)
        print(p)
    """
    require_module(model, "model", "plan_pipeline")
    if not isinstance(config, PipelineParallelConfig):
        raise TypeError(f"plan_pipeline: config must be a PipelineParallelConfig, got {type(config).__name__}")
    if type(pp) is not int or pp < 1:
        raise ValueError(f"plan_pipeline: pp must be an int >= 1, got {pp!r}")
    if not callable(transform):
        raise TypeError(f"plan_pipeline: transform must be callable (model, Plan) -> Plan, got {type(transform).__name__}")
    if blocks is not None:
        blocks = name_tokens(blocks, "blocks", "plan_pipeline")
    require_mp_policy(mp_policy, "mp_policy", "plan_pipeline")
    require_offload_policy(offload_policy, "offload_policy", "plan_pipeline")
    r = reshard_after_forward
    if not (r is None or isinstance(r, bool) or (type(r) is int and r >= 1)):
        raise TypeError(f"plan_pipeline: reshard_after_forward must be None, a bool or an int >= 1, got {r!r}")
    if index is not None and (not isinstance(index, ModelIndex) or index.root is not model):
        raise TypeError(f"plan_pipeline: index must be None or the ModelIndex of model, got {type(index).__name__}")
    idx = index if index is not None else ModelIndex.build(model)
    found = resolve_blocks(tuple(blocks), idx, "plan_pipeline") if blocks else discover_blocks(model, idx)
    parts = pipeline_parts(model, idx, found)
    split = split_stages(parts, config, pp)
    tied = _tied_across_stages(idx, split)
    if tied:
        raise PlanningError(
            "pipeline parallelism: tied parameters would live on different stages and drift apart: "
            + "; ".join(tied)
            + ". Untie them (Hugging Face: tie_word_embeddings=False) or put their modules on one stage"
        )
    num = len(split)
    ranks = stage_ranks(num, pp, config.resolved_placement)
    microbatches = config.microbatches if config.microbatches is not None else num
    problem = microbatch_problem(config.schedule, microbatches, num, pp)
    if problem is not None:
        raise PlanningError(problem)
    warnings: list[str] = []
    if microbatches < num:
        warnings.append(
            f"pipeline: {microbatches} micro-batches for {num} stages leave the pipeline idle "
            f"{bubble_fraction(pp, microbatches, config.stages_per_rank):.0%} of each step; use at least {num}"
        )
    stages = []
    for s, held in enumerate(split):
        module = build_stage_module(model, idx, parts, held, s, num)
        stage_plan = plan_indexed(
            module,
            transform,
            ModelIndex.build(module),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )
        numel, nbytes = _stage_size(idx, held)
        stages.append(Stage(s, ranks[s], held, stage_plan.replace(verified=None), numel, nbytes))
    pipeline = Pipeline(
        config.schedule, microbatches, pp, config.stages_per_rank, config.resolved_placement, parts.container, tuple(stages)
    )
    return Plan(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        pipeline=pipeline,
        warnings=tuple(warnings),
    )
