"""One walk of a model that both planning and applying read.

Planning needs FQN tables; ``apply_plan`` needs to know whether the model is
still the one a plan was made from. Both come from the same pre-order walk,
and the walk also yields a *signature*: the tree's shape (each module's
parent and attribute name, and every further parent of a shared module),
each module's identity and class (with whether each ModuleList/ModuleDict
class is a bare container, which a patch of its ``forward`` changes), each
parameter slot's module and name,
each parameter's identity, dtype, ``requires_grad`` and rank, and, in a model
with tied parameters, the tie declarations that name them. Two walks with
equal signatures saw the same tree holding the same parameters in the same
state, so every claim the planner derived from the first still holds for the
second. A Plan therefore carries the signature of the model its units were
resolved against (:class:`Vouched`), and applying it costs one walk and a
list comparison instead of re-deriving each unit's claims. Anything that
differs (a cast, a frozen or replaced parameter, a module swapped or
sharded, a hand-edited unit) sends ``check_plan`` down the full check, so no
error is weakened.

Identities are compared as ids, which a new object may reuse once the old
one is gone; that is safe because everything the planner and the full check
derive depends on where each object sits and what the walk read from it,
which the signature holds fixed, never on which object it is. The modules
handed to the primitive are the ones this walk found.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..core._caches import memo_property
from ._unit_checks import container_classes

__all__ = [
    "TIE_ATTRIBUTES",
    "ModelWalk",
    "declared_ties",
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
    complete: bool  # False: FSDP modules were not entered, the signature vouches for nothing

    @property
    def shared_modules(self) -> bool:
        """Whether some module is registered under two parents."""
        return bool(self.repeats)

    @memo_property
    def types(self) -> list[type]:
        """Each module's class (``fully_shard`` swaps it in place)."""
        return list(map(type, self.modules))

    @memo_property
    def facts(self) -> list[ParamFacts]:
        """Per slot, what the walk read from its parameter, all at once."""
        return list(map(_FACTS, self.params))

    @memo_property
    def param_ids(self) -> list[int]:
        """Per slot, its parameter's id."""
        return list(map(id, self.params))

    @memo_property
    def tied(self) -> bool:
        """Whether some parameter fills two slots."""
        return len(set(self.param_ids)) != len(self.params)

    @memo_property
    def tie_declarations(self) -> list[tuple[int, str, object]]:
        """In a tied model, what each module declares about ties (see
        :func:`_tie_declarations`); empty for a model without ties, whose
        names nothing declared decides."""
        return _tie_declarations(self.modules) if self.tied else []

    @memo_property
    def signature(self) -> Signature:
        """This walk's :class:`Signature`."""
        return Signature(
            list(self.position),  # module ids, in walk order
            self.types,
            container_classes(self.types),
            self.parents,
            self.names,
            self.repeats,
            self.owners,
            self.slot_names,
            self.param_ids,
            self.facts,
            self.tied,
            self.tie_declarations,
        )


@dataclass(frozen=True, eq=False)
class Signature:
    """Everything two walks must share for claims derived from one to hold
    for the other. Identities are kept as ids, never objects, so a Plan does
    not keep its model alive."""

    module_ids: list[int]
    types: list[type]
    containers: frozenset[tuple[type, bool]]
    parents: list[int]
    names: list[str]
    repeats: list[tuple[int, str, int]]
    owners: list[int]
    slot_names: list[str]
    param_ids: list[int]
    facts: list[ParamFacts]
    tied: bool
    tie_declarations: list[tuple[int, str, object]]

    def matches(self, walk: ModelWalk) -> bool:
        """Whether ``walk`` has this signature, reading from it only what
        the comparison so far leaves open: with the same classes, only the
        recorded container classes are asked for their ``forward`` again;
        with the same parameter ids in the same slots, an untied model is
        still untied and its tie declarations are not read."""
        return (
            list(walk.position) == self.module_ids
            and walk.types == self.types
            and container_classes(t for t, _ in self.containers) == self.containers
            and walk.parents == self.parents
            and walk.names == self.names
            and walk.repeats == self.repeats
            and walk.owners == self.owners
            and walk.slot_names == self.slot_names
            and walk.param_ids == self.param_ids
            and walk.facts == self.facts
            and (not self.tied or _tie_declarations(walk.modules) == self.tie_declarations)
        )


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
    ``all_tied_weights_keys``) as plain values, by walk position: a tied
    parameter's canonical name follows these declarations, so a walk
    vouches for the names only while they hold."""
    return [
        (i, attr, _frozen_declaration(declared))
        for i, module in enumerate(modules)
        for attr in TIE_ATTRIBUTES
        if (declared := declared_ties(module, attr)) is not None
    ]


def _frozen_declaration(declared: object) -> object:
    """A tie declaration as a value a later walk compares with (a model may
    change the very dict or list it declared). Its type is kept: the
    planner reads a ``dict`` and a list-like differently from any other
    mapping or value."""
    if isinstance(declared, Mapping):
        return (type(declared), tuple(declared.items()))
    if isinstance(declared, (list, tuple, set, frozenset)):
        items = tuple(declared)
        return (type(declared), frozenset(items) if isinstance(declared, (set, frozenset)) else items)
    return (type(declared), declared)


def walk_model(root: nn.Module, *, enter_sharded: bool = True) -> ModelWalk:
    """Walk ``root`` once, children in registration order.

    ``enter_sharded=False`` records an FSDP module below ``root`` but not
    what it holds: ``fully_shard`` stops there too, so planning one call of
    the imperative API after its blocks were sharded needs nothing inside
    them. Such a partial walk's signature vouches for nothing.

    The loop only collects objects and names; the per-object reads of the
    signature are C-level maps over the collected lists, done when needed.
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
