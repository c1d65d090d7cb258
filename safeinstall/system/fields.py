"""Typed readers of the fields of a JSON document safeinstall wrote and reads back (a run's document, its
journal, a prepared run's record, the baseline, the probe's answer): each returns the value as its type
says, or raises :class:`FieldError` (a ValueError) saying which field is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class FieldError(ValueError):
    """A field of a document is missing or of another type than the document's."""


def is_number(value: object) -> bool:
    """Pure: an int or a float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check(value: object, ok: Callable[[object], bool], what: str) -> Any:
    """``value`` when ``ok`` says so. Raises FieldError naming ``what`` and the type found."""
    if not ok(value):
        raise FieldError(f"{what}: {type(value).__name__} where the document has another type")
    return value


def text(value: object, what: str) -> str:
    """``value``, a string. Raises FieldError."""
    return str(check(value, lambda v: isinstance(v, str), what))


def text_or_none(value: object, what: str) -> str | None:
    """``value``, a string or None. Raises FieldError."""
    return None if value is None else text(value, what)


def texts(value: object, what: str) -> tuple[str, ...]:
    """``value``, a list of strings. Raises FieldError."""
    return tuple(text(v, what) for v in check(value, lambda v: isinstance(v, list), what))


def objects(value: object, what: str, read: Callable[[Mapping[str, Any]], T]) -> tuple[T, ...]:
    """``value``, a list of objects, each read by ``read``. Raises FieldError (or what ``read`` raises)."""
    items = check(value, lambda v: isinstance(v, list), what)
    return tuple(read(check(v, lambda o: isinstance(o, dict), what)) for v in items)


def typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` when it is a ``kind`` (a bool is never a number). Raises FieldError."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FieldError(f"{value!r} is not a {kind}")
    return value


def optional_text(value: Any) -> str | None:
    """``value``, a string or None. Raises FieldError."""
    return None if value is None else str(typed(value, str))


def nonempty_text(data: Mapping[str, Any], key: str) -> str:
    """``data[key]``, a string that is not empty. Raises FieldError."""
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise FieldError(f"{key} must be a non-empty string")
    return value


def field(data: Mapping[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    """``data[key]``, a ``kind`` (an int is never a bool); None when ``optional`` and it is absent or null.
    Raises FieldError saying it is missing or of the wrong type."""
    if key not in data:
        if optional:
            return None
        raise FieldError(f"{key!r} is missing")
    value = data[key]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FieldError(f"{key!r} has the wrong type ({type(value).__name__})")
    return value


def list_of(data: Mapping[str, Any], key: str, kind: type) -> list[Any]:
    """``data[key]`` (empty when absent), a list of ``kind`` (a bool only where ``kind`` is bool).
    Raises FieldError."""
    values = data.get(key, [])
    if not isinstance(values, list) or not all(
        isinstance(v, kind) and (kind is bool or not isinstance(v, bool)) for v in values
    ):
        raise FieldError(f"{key!r} must be a list of {kind.__name__}")
    return values
