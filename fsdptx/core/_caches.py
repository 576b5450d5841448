"""The caches' one switch, and the layers that put a cache over a plain function.

Every fast path in fsdptx that remembers a result is one of the layers
below, wrapped around a function that computes the same result without it.
All of them read one switch, :func:`caches`, so a test (or a user who
suspects a cache) can run the plain functions alone and compare:

- :func:`memoized`: a memo for one computation (one planning call), gone
  with it: the dtype keys and the policies of one resolution;
- :class:`memo_property`: a value derived from an immutable snapshot (a
  model walk, its index), computed on first use and kept on that snapshot,
  which lives for one call;
- :func:`process_memo`: the one kind that outlives a call, process-wide,
  bounded (least recently used entries go first), cleared by
  :func:`clear_caches`. Its keys and values hold no module or parameter.

Block replay (``fsdptx.plan.resolve._replay``), vouching (``fsdptx.plan._vouch``) and
the imperative API's memo of calls (``fsdptx.compat._imperative``) read
:func:`caches_enabled` where they decide to take their fast path.

The switch is a context variable: it holds for the current thread (or
asyncio task) inside the ``with`` block, and other threads keep theirs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "BoundedMemo",
    "caches",
    "caches_enabled",
    "clear_caches",
    "memo_property",
    "memoized",
    "process_memo",
    "process_wide",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
O = TypeVar("O")

_ENABLED: ContextVar[bool] = ContextVar("fsdptx_caches_enabled", default=True)


def caches_enabled() -> bool:
    """Whether fsdptx's caches are on here (they are unless a
    :func:`caches` block turned them off)."""
    return _ENABLED.get()


@contextlib.contextmanager
def caches(enabled: bool = True) -> Iterator[None]:
    """Turn every fsdptx cache on or off inside the ``with`` block::

        with fsdptx.caches(enabled=False):
            p = fsdptx.plan(model, pipeline)   # no block replay, no vouching
            fsdptx.apply_plan(p, model, mesh)  # the full check of every unit

    Off, each result is computed by the plain function the cache sits on:
    planning plans every block in full, a Plan carries no vouched
    signature (so ``apply_plan`` re-derives every unit's claims), the
    imperative API plans every call, and derived tables are recomputed
    when read. Results are equal either way (the property tests compare
    them); only the cost differs. Entries remembered while on are kept,
    neither read nor added to while off. The TP-replica layouts kept on a
    model (sync, broadcast, audit) follow the switch too.

    Args:
        enabled: ``False`` to compute everything by the plain functions
            inside the block; ``True`` (the default) to turn caches back on
            inside an outer ``enabled=False`` block.

    Yields:
        Nothing; the setting holds until the block exits.

    Raises:
        TypeError: ``enabled`` is not a bool.

    Example::

        with fsdptx.caches(enabled=False):
            plain = fsdptx.plan(model, pipeline)
        assert plain == fsdptx.plan(model, pipeline)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"caches: enabled must be True or False, got {enabled!r}")
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class BoundedMemo(Generic[K, V]):
    """At most ``limit`` entries, the least recently used dropped first;
    lookups and stores are thread-safe (a lookup reorders the entries, which
    must not meet another thread's eviction)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"BoundedMemo: limit must be at least 1, got {limit}")
        self.limit = limit
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


M = TypeVar("M", bound=BoundedMemo[Any, Any])

# The process-wide memos, for clear_caches; created at import, never dropped.
_PROCESS_MEMOS: list[BoundedMemo[Any, Any]] = []


def process_wide(memo: M) -> M:
    """Register ``memo`` as a process-wide memo (:func:`clear_caches`
    empties it); returns it."""
    _PROCESS_MEMOS.append(memo)
    return memo


def clear_caches() -> None:
    """Empty fsdptx's process-wide memos (the imperative API's memo of
    calls, the fp32 token searches). Nothing else outlives the call that
    made it, except the TP-replica layouts, which live and die with their
    model.

    Example::

        fsdptx.clear_caches()   # e.g. between tests that count planning work
    """
    for memo in _PROCESS_MEMOS:
        memo.clear()


def process_memo(limit: int) -> Callable[[Callable[[K], V]], Callable[[K], V]]:
    """A one-argument function with a process-wide memo of ``limit``
    results (see :class:`BoundedMemo`), bypassed while caches are off."""

    def wrap(fn: Callable[[K], V]) -> Callable[[K], V]:
        memo: BoundedMemo[K, tuple[V]] = process_wide(BoundedMemo(limit))

        @functools.wraps(fn)
        def remembered(key: K) -> V:
            if not _ENABLED.get():
                return fn(key)
            found = memo.get(key)
            if found is None:
                found = (fn(key),)
                memo.put(key, found)
            return found[0]

        return remembered

    return wrap


def memoized(fn: Callable[[K], V]) -> Callable[[K], V]:
    """``fn`` with a memo of its results for the caller's one computation
    (the memo goes when the returned function does), or ``fn`` itself while
    caches are off. For a function asked the same few keys many times:
    thousands of parameters share a handful of dtype facts."""
    if not _ENABLED.get():
        return fn
    memo: dict[K, V] = {}

    def remembered(key: K) -> V:
        try:
            return memo[key]
        except KeyError:
            value = memo[key] = fn(key)
            return value

    return remembered


class memo_property(Generic[O, V]):  # noqa: N801 (used as a decorator, like property)
    """A value derived from an immutable snapshot: computed on first use
    and kept in the instance's ``__dict__`` (as ``functools.cached_property``)
    while caches are on; recomputed on every read while they are off. Kept
    values are found before the descriptor, so a value remembered while on
    is still read inside a block that turned caches off: build the
    snapshot inside the block to compare."""

    def __init__(self, fn: Callable[[O], V]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> memo_property[O, V]: ...

    @overload
    def __get__(self, obj: O, owner: type | None = None) -> V: ...

    def __get__(self, obj: O | None, owner: type | None = None) -> V | memo_property[O, V]:
        if obj is None:
            return self
        value = self.fn(obj)
        if _ENABLED.get():
            obj.__dict__[self.name] = value
        return value
