"""One walk of a model that both planning and applying read.

Planning needs FQN tables; ``apply_plan`` needs to know whether the model is
still the one a plan was made from. The planner's tables come from one
pre-order walk (:func:`walk_model`), and a Plan carries a
:class:`Fingerprint` of the model its units were resolved against: weak
references to every module and parameter the walk met, and what the walk
read from them (each module's class and the names and identities in its
child and parameter tables; each parameter's dtype, ``requires_grad`` and
rank; in a model with tied parameters, the tie declarations that name them).
A model that still matches its fingerprint is the same tree holding the same
parameters in the same state, so every claim the planner derived still
holds. Checking a fingerprint needs no walk: the modules are the ones the
weak references lead to, and each comparison is a C-level map over them, a
fraction of what walking and re-deriving cost. Anything that differs (a
cast, a frozen or replaced parameter, a module swapped or sharded, a
hand-edited unit) sends ``check_plan`` down the full check, so no error is
weakened.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ._unit_checks import module_problems, settings_problems

if TYPE_CHECKING:
    from ._plan import Plan, Reduction, Unit
    from ._planner import ModelIndex

__all__ = [
    "TIE_ATTRIBUTES",
    "Fingerprint",
    "ModelWalk",
    "Vouched",
    "declared_ties",
    "vouch",
    "vouch_marks",
    "vouched_modules",
    "walk_model",
]

# What a walk reads from each parameter: (dtype, requires_grad, ndim).
ParamFacts = tuple[torch.dtype, bool, int]
_FACTS = operator.attrgetter("dtype", "requires_grad", "ndim")
_NDIM = operator.itemgetter(2)
_DTYPE_GRAD = operator.itemgetter(0, 1)


@dataclass(frozen=True)
class ModelWalk:
    """A pre-order walk of a model, first visits only (as ``named_modules``).

    ``parents``/``names`` give each module's parent position and attribute
    name, so FQNs follow without touching a module again; ``repeats`` lists
    every further registration of a shared module (parent position, name,
    position). Parameter slots (``owners``, ``slot_names``, ``params``) list
    every non-``None`` direct parameter of every visited module; a tied
    parameter fills several. ``None`` entries in a module's tables hold
    nothing ``fully_shard`` could claim and are not recorded.
    """

    modules: list[nn.Module]
    parents: list[int]
    names: list[str]
    repeats: list[tuple[int, str, int]]
    owners: list[int]
    slot_names: list[str]
    params: list[nn.Parameter]
    position: dict[int, int]  # module id -> position in ``modules``
    complete: bool  # False: FSDP modules were not entered, the walk vouches for nothing

    @property
    def shared_modules(self) -> bool:
        """Whether some module is registered under two parents."""
        return bool(self.repeats)

    @functools.cached_property
    def types(self) -> list[type]:
        """Each module's class (``fully_shard`` swaps it in place)."""
        return list(map(type, self.modules))

    @functools.cached_property
    def facts(self) -> list[ParamFacts]:
        """Per slot, what the walk read from its parameter, all at once."""
        return list(map(_FACTS, self.params))

    @functools.cached_property
    def tie_declarations(self) -> list[tuple[int, str, object]]:
        """When some parameter fills two slots (a tie), what each module
        declares about ties (see :func:`_tie_declarations`); empty for a
        model without ties, whose names nothing declared decides."""
        if len(set(map(id, self.params))) == len(self.params):
            return []
        return _tie_declarations(self.modules)


TIE_ATTRIBUTES = ("_tied_weights_keys", "all_tied_weights_keys")


def declared_ties(module: nn.Module, attr: str) -> object:
    """What ``module`` declares about ties under ``attr`` (one of
    :data:`TIE_ATTRIBUTES`), or ``None``: ``getattr(module, attr, None)``
    without ``nn.Module.__getattr__``, which raises (slowly) for every
    module that declares nothing."""
    found = module.__dict__.get(attr, _ABSENT)
    if found is not _ABSENT:
        return found
    on_class = getattr(type(module), attr, None)
    # A descriptor (a property) computes the value from the instance.
    return getattr(module, attr, None) if hasattr(on_class, "__get__") else on_class


_ABSENT = object()


def _tie_declarations(modules: list[nn.Module]) -> list[tuple[int, str, object]]:
    """What each module declares about ties (``_tied_weights_keys``,
    ``all_tied_weights_keys``), as plain values by walk position: a tied
    parameter's canonical name follows these declarations, so a plan
    vouches for its names only while they hold."""
    return [
        (i, attr, _frozen_declaration(declared))
        for i, module in enumerate(modules)
        for attr in TIE_ATTRIBUTES
        if (declared := declared_ties(module, attr)) is not None
    ]


def _frozen_declaration(declared: object) -> object:
    """A tie declaration as a value a later walk compares with (a model may
    change the very dict or list it declared)."""
    if isinstance(declared, Mapping):
        return ("map", tuple(declared.items()))
    if isinstance(declared, (list, tuple, set, frozenset)):
        items = tuple(declared)
        return ("set", frozenset(items)) if isinstance(declared, (set, frozenset)) else ("seq", items)
    return ("other", declared)


def walk_model(root: nn.Module, *, enter_sharded: bool = True) -> ModelWalk:
    """Walk ``root`` once, children in registration order.

    ``enter_sharded=False`` records an FSDP module below ``root`` but not
    what it holds: ``fully_shard`` stops there too, so planning one call of
    the imperative API after its blocks were sharded needs nothing inside
    them. Such a partial walk vouches for nothing.

    The loop only collects objects and names; the per-object reads are
    C-level maps over the collected lists, done when needed.
    """
    modules: list[nn.Module] = []
    parents: list[int] = []
    names: list[str] = []
    repeats: list[tuple[int, str, int]] = []
    owners: list[int] = []
    slot_names: list[str] = []
    params: list[nn.Parameter] = []
    position: dict[int, int] = {}
    stack: list[tuple[nn.Module, int, str]] = [(root, -1, "")]
    pop, push = stack.pop, stack.append
    while stack:
        module, up, name = pop()
        mid = id(module)
        if mid in position:
            repeats.append((up, name, position[mid]))  # first path wins, as named_modules
            continue
        here = len(modules)
        position[mid] = here
        modules.append(module)
        parents.append(up)
        names.append(name)
        if not enter_sharded and up >= 0 and isinstance(module, FSDPModule):
            continue
        direct = module._parameters
        if direct:
            for pname, p in direct.items():
                if p is not None:
                    owners.append(here)
                    slot_names.append(pname)
                    params.append(p)
        children = module._modules
        if children:
            for cname, child in reversed(children.items()):
                if child is not None:
                    push((child, here, cname))
    return ModelWalk(modules, parents, names, repeats, owners, slot_names, params, position, enter_sharded)


_CHILDREN = operator.attrgetter("_modules")
_PARAMETERS = operator.attrgetter("_parameters")
_IS_PARAM = functools.partial(operator.is_not, None)
# Stands in for the weak reference of a ``None`` table entry: calling it
# gives ``None`` back, so one ``map(operator.call, ...)`` resolves every entry.
_NO_PARAM: Callable[[], None] = type(None)


def _tables(modules: list[Any]) -> tuple[list[int], list[str], list[int], list[int], list[str], list[Any]]:
    """What each module's child and parameter tables hold, flattened in walk
    order: child counts, names and ids; parameter counts, names and values
    (``None`` entries included: moving a parameter to another slot of the
    same module changes its name)."""
    children = list(map(_CHILDREN, modules))
    tables = list(map(_PARAMETERS, modules))
    return (
        list(map(len, children)),
        list(chain.from_iterable(children)),
        list(map(id, chain.from_iterable(map(dict.values, children)))),
        list(map(len, tables)),
        list(chain.from_iterable(tables)),
        list(chain.from_iterable(map(dict.values, tables))),
    )


def _param_facts(values: Iterable[Any]) -> list[ParamFacts]:
    return list(map(_FACTS, filter(_IS_PARAM, values)))


@dataclass(frozen=True, eq=False)
class Fingerprint:
    """A model as one complete walk found it, checked again without walking.

    Modules and parameters are held through weak references, so a Plan does
    not keep its model alive, and a reference that still resolves proves the
    object is the very one the walk met (an id alone could be reused). Two
    models match when the references resolve, ``root`` is the first module,
    every module keeps its class and its child and parameter tables (names
    and identities, in order), and every parameter keeps its dtype,
    ``requires_grad`` and rank. Every module reachable from ``root`` is then
    one of the recorded ones: each recorded module's children are.
    """

    modules: list[weakref.ref[nn.Module]]
    types: list[type]
    tables: tuple[list[int], list[str], list[int], list[int], list[str]]
    params: list[Callable[[], Any]]  # per parameter-table entry, None ones included
    facts: list[ParamFacts]
    ties: list[tuple[int, str, object]]

    @classmethod
    def of(cls, walk: ModelWalk) -> Fingerprint:
        """The fingerprint of a complete walk's model."""
        *tables, values = _tables(walk.modules)
        return cls(
            list(map(weakref.ref, walk.modules)),
            walk.types,
            tuple(tables),  # type: ignore[arg-type]
            [_NO_PARAM if p is None else weakref.ref(p) for p in values],
            _param_facts(values),
            walk.tie_declarations,
        )

    def modules_of(self, root: nn.Module) -> list[nn.Module] | None:
        """The model's modules in walk order when ``root`` still matches;
        ``None`` at the first difference."""
        alive = list(map(operator.call, self.modules))
        if alive[0] is not root or list(map(type, alive)) != self.types:
            return None  # a module was swapped, re-classed, or is gone
        modules = cast(list[nn.Module], alive)  # every class matched: none is None
        *tables, values = _tables(modules)
        if tuple(tables) != self.tables or len(values) != len(self.params):
            return None
        if not all(map(operator.is_, values, map(operator.call, self.params))):
            return None
        if _param_facts(values) != self.facts:
            return None
        if self.ties and _tie_declarations(modules) != self.ties:
            return None
        return modules


@dataclass(frozen=True, eq=False)
class Vouched:
    """What planning vouches for: ``units`` (this very tuple) were resolved
    against a model matching ``fingerprint``, and are found, in walk order,
    at ``positions``. ``reductions``/``exclusions`` (these very objects)
    were checked against the same model, or are ``None``."""

    fingerprint: Fingerprint
    units: tuple[Unit, ...]
    positions: tuple[tuple[int, ...], ...]
    reductions: Mapping[str, Reduction] | None = None
    exclusions: tuple[str, ...] | None = None


def vouch(index: ModelIndex, units: tuple[Unit, ...]) -> Vouched | None:
    """Vouch for ``units``, just resolved from ``index``; ``None`` (no
    vouching: the full check runs and names the problems) when the index
    did not see the whole model, some parameter is a scalar or a trainable
    non-floating (complex) one (the planner does not group those by dtype),
    or the primitive would refuse some unit's settings or modules. Those
    depend only on the units and the modules' classes, which the
    fingerprint holds fixed, so applying a vouched plan re-checks none of
    them."""
    walk = index.walk
    if not walk.complete or 0 in map(_NDIM, walk.facts):
        return None
    if any(grad and not dtype.is_floating_point for dtype, grad in set(map(_DTYPE_GRAD, walk.facts))):
        return None  # a trainable complex parameter: the planner leaves it keyless
    position, modules = walk.position, index.modules
    positions = tuple(tuple(position[id(modules[f])] for f in u.modules) for u in units)
    for i, (unit, at) in enumerate(zip(units, positions)):
        if settings_problems(i, unit) or module_problems(i, unit.modules, [walk.modules[j] for j in at]):
            return None
    return Vouched(Fingerprint.of(walk), units, positions)


def vouch_marks(index: ModelIndex, plan: Plan) -> object:
    """``plan.verified`` extended to the plan's reductions and exclusions when
    each names a parameter or module of the model ``index`` was built from."""
    vouched = plan.verified
    if not isinstance(vouched, Vouched) or vouched.units is not plan.units:
        return vouched
    named = all(map(index.has_param, plan.reductions)) and all(f in index.modules for f in plan.exclusions)
    return dataclasses.replace(vouched, reductions=plan.reductions, exclusions=plan.exclusions) if named else vouched


def vouched_modules(plan: Plan, model: nn.Module) -> list[list[nn.Module]] | None:
    """Each unit's modules when the plan is vouched for and ``model`` still
    matches its fingerprint; ``None`` when anything calls for the full check."""
    vouched = plan.verified
    if not isinstance(vouched, Vouched) or vouched.units is not plan.units:
        return None
    if plan.reductions and vouched.reductions is not plan.reductions:
        return None
    if plan.exclusions and vouched.exclusions is not plan.exclusions:
        return None
    found = vouched.fingerprint.modules_of(model)
    if found is None:
        return None
    return [[found[i] for i in at] for at in vouched.positions]
