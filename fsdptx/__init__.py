"""fsdptx: composable, functional FSDP2 and tensor-parallel sharding.

Plan purely, apply once::

    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    p = fsdptx.plan(model, pipeline, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    print(p)
    fsdptx.apply_plan(p, model, mesh)
    ...
    loss.backward()
    fsdptx.synchronize_tp_replica_gradients([model], mesh)   # once per optimizer step

The contract's names load on first use: ``import fsdptx`` (or of any of its
subpackages, such as the pytest plugin ``fsdptx.testing.plugin``, which
every pytest run of a suite with fsdptx installed loads) imports no torch;
the first name read imports them all, from :mod:`fsdptx._contract`, where
each is imported from the module that defines it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._contract import *  # noqa: F403  (the names, for type checkers)
    from ._contract import __all__ as __all__


class _Contract(types.ModuleType):
    """The ``fsdptx`` module: a name it does not hold yet loads the contract
    (:mod:`fsdptx._contract`, every name at once) and is then an attribute
    like any other. Private and dunder names (``_contract`` while it is
    imported, ``__path__``, ``__wrapped__``, ...: what the import system and
    tools probe modules for) never load it; ``__all__`` does.

    ``plan`` is both a name of the contract (the function) and a
    subpackage. Importing a subpackage binds it on its parent, so whichever
    of ``fsdptx.plan.*`` is imported first would otherwise replace the
    function with the subpackage; a data descriptor on the class wins over
    that binding, and the subpackage stays reachable through ``import``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") and name != "__all__":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        contract = _load()
        if name == "__all__" or name in contract.__all__:
            return getattr(contract, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_load().__all__})

    @property
    def plan(self) -> Any:
        return _load().plan

    @plan.setter
    def plan(self, value: Any) -> None:
        """Where the import system binds the subpackage ``fsdptx.plan``:
        ``fsdptx.plan`` stays the function (the subpackage is
        ``sys.modules["fsdptx.plan"]``)."""


def _load() -> types.ModuleType:
    """Import every contract name (and ``__all__``) into this module, once."""
    _contract = importlib.import_module("._contract", __name__)
    namespace = vars(sys.modules[__name__])
    if "__all__" not in namespace:
        namespace.update((name, getattr(_contract, name)) for name in _contract.__all__ if name != "plan")
        namespace["__all__"] = list(_contract.__all__)
    return _contract


sys.modules[__name__].__class__ = _Contract
