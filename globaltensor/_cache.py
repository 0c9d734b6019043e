"""The caches of the package: one bounded cache and one id-keyed cache, and ``clear_all()``.

Every cache here holds results of pure functions of its key (a decision for an op on given
layouts, a plan's per-rank cuts, the target layout of a ``to_global`` call), so forgetting an
entry only costs recomputing it. Both kinds empty themselves when full instead of evicting one
entry at a time: the working set of a program is small and repeats, and a clear is cheap.

- :class:`Bounded` is a dict keyed by values (hashing them on every lookup).
- :class:`ById` is a dict keyed by tuples that hold object ids (hashing ints, not layouts or
  plans). An entry pins the objects whose ids its key names, so an id is never reused by
  another object while the entry lives.

Both subclass dict, so a warm path's lookup is ``cache.get(key)``: one C call, no Python frame.
``clear_all()`` empties every cache made here, and the lru caches registered with :func:`memo`
(tests; after changing rules at run time). :class:`kept` caches a method per instance (an object
that lives in a cache of its own, such as the planner's spaces, keeps its answers).
"""
from __future__ import annotations

import functools
import weakref

MISSING = object()  # what ``cache.get(key, MISSING)`` returns for an absent key
_ALL: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # id -> every live cache
_MEMOS: list = []


class Bounded(dict):
    """A dict that empties itself when it would grow past ``maxsize`` entries."""

    __slots__ = ("maxsize", "__weakref__")

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize
        _ALL[id(self)] = self

    def put(self, key, value):
        """Store ``value`` under ``key`` and return it."""
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value


class ById(Bounded):
    """A :class:`Bounded` cache whose keys hold ``id()``s of the objects passed to :meth:`put`
    as ``pinned``; those objects are kept alive as long as the entry is."""

    __slots__ = ("_pins",)

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self._pins: dict = {}

    def put(self, key, value, pinned=()):
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        self._pins[key] = pinned
        return value

    def computed(self, obj, where, build):
        """``build(obj, where)``, worked out once per (obj, where) and pinning obj."""
        key = (id(obj), where)
        value = self.get(key, MISSING)
        if value is MISSING:
            value = self.put(key, build(obj, where), pinned=obj)
        return value

    def clear(self):
        super().clear()
        self._pins.clear()


def memo(maxsize: int):
    """``functools.lru_cache(maxsize)`` for a pure function, emptied by :func:`clear_all` too."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _MEMOS.append(cached)
        return cached
    return wrap


class kept:
    """A method whose results each instance keeps, per arguments (positional, hashable).

    The first access on an instance puts a ``functools.cache`` of the bound method in the
    instance's ``__dict__`` (a non-data descriptor: the instance's entry wins from then on), so
    a later call is one C lookup, no Python frame. The instance needs a ``__dict__``."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        cached = obj.__dict__[self.name] = functools.cache(self.fn.__get__(obj, owner))
        return cached


def clear_all() -> None:
    """Forget every cached result (decisions, plans, layouts' boxes, moves, per-rank cuts)."""
    for cache in list(_ALL.values()):
        cache.clear()
    for fn in _MEMOS:
        fn.cache_clear()


__all__ = ["MISSING", "Bounded", "ById", "clear_all", "kept", "memo"]
