"""Frozen, slotted records for the cores' values, events and actions (stdlib only).

``@record`` is ``@dataclass(frozen=True, slots=True, kw_only=True)`` with its ``__eq__``,
``__hash__`` and ``__repr__`` shared by every record instead of generated per class: the
dataclass machinery compiles a string of source for each method of each class, and for the
cores' ~150 classes that was most of the daemon's import time (docs/BENCHMARKS.md). The
shared methods compare, hash and show the fields in order, as the generated ones do;
``tests/unit/test_records.py`` holds them to ``dataclass``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, cast, dataclass_transform, overload

T = TypeVar("T", bound=type)


def _eq(self: Any, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented  # type: ignore[no-any-return]  # the protocol's "not mine"
    return all(getattr(self, n) == getattr(other, n) for n in self.__record_fields__)


def _hash(self: Any) -> int:
    return hash((self.__class__, *(getattr(self, n) for n in self.__record_fields__)))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__record_shown__)
    return f"{self.__class__.__qualname__}({shown})"


def _finish(cls: T) -> T:
    own = fields(cls)
    cls.__record_fields__ = tuple(f.name for f in own if f.compare)  # type: ignore[attr-defined]
    cls.__record_shown__ = tuple(f.name for f in own if f.repr)  # type: ignore[attr-defined]
    cls.__eq__ = _eq  # type: ignore[assignment]
    cls.__hash__ = _hash  # type: ignore[assignment]
    cls.__repr__ = _repr  # type: ignore[assignment]
    return cls


@overload
def record(cls: T, /) -> T: ...


@overload
def record(*, kw_only: bool = True) -> Callable[[T], T]: ...


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(field,))
def record(cls: T | None = None, /, *, kw_only: bool = True) -> T | Callable[[T], T]:
    """A frozen, slotted dataclass (keyword-only fields unless ``kw_only=False``) whose
    equality, hash and repr are the shared ones."""

    def make(cls: T) -> T:
        made: type = dataclass(frozen=True, slots=True, kw_only=kw_only, eq=False, repr=False)(cls)
        return _finish(cast(T, made))

    return make if cls is None else make(cls)
