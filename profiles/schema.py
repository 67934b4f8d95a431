"""Typed TOML tables -> frozen dataclasses, with one-line errors that name the file and field.

A profile section is a `@dataclass(frozen=True, kw_only=True)`. Its fields' type hints are the
schema: `int`, `float` (an int is accepted), `str`, `bool`, `tuple[str, ...]`, a nested
section dataclass, or any of these `| None` (optional). A field with `metadata={"size": True}`
is a byte size: an int or a string such as "24GiB" (parsed by `offload.core.sizes.parse_size`).
Every number must be > 0 unless its metadata says `{"min": 0}`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from ..offload.core.errors import SizeError, TierwiseError
from ..offload.core.sizes import parse_size

T = TypeVar("T")


class ProfileError(TierwiseError):
    """A profile could not be found or is malformed."""


class UnknownProfileError(ProfileError, LookupError):
    """No profile of that name (the message lists the known ones)."""


class ProfileFieldError(ProfileError, ValueError):
    """A field of a profile file is wrong; `.where` is the file, `.field` the dotted field name."""

    def __init__(self, message: str, *, where: str, field: str):
        self.where, self.field, self.detail = where, field, message
        super().__init__(f"{where}: {message}")


class MissingFieldError(ProfileFieldError):
    """A required field is absent."""


class FieldTypeError(ProfileFieldError, TypeError):
    """A field has the wrong TOML type."""


class FieldValueError(ProfileFieldError):
    """A field has the right type but an impossible value (zero, negative, unknown choice)."""


class UnknownFieldError(ProfileFieldError, KeyError):
    """A key the schema does not know (a typo, usually)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list of strings"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def check_value(value: Any, *, tp: Any, meta: typing.Mapping[str, Any], where: str, field: str) -> Any:
    """Type-check and convert one raw value; raise a ProfileFieldError naming `where`/`field`."""
    if meta.get("size"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise FieldTypeError(f"field '{field}' must be a size like \"24GiB\" or an integer of bytes, "
                                 f"got {value!r}", where=where, field=field)
        try:
            value = parse_size(value, what=f"field '{field}'")
        except SizeError as exc:
            raise FieldValueError(str(exc), where=where, field=field) from None
    elif typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise FieldTypeError(f"field '{field}' must be {_type_name(tp)}, got {value!r}", where=where, field=field)
        return tuple(value)
    elif tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise FieldTypeError(f"field '{field}' must be {_type_name(tp)}, got {value!r}", where=where, field=field)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low = meta.get("min")
        if low is None and value <= 0:
            raise FieldValueError(f"field '{field}' must be > 0, got {value!r}", where=where, field=field)
        if low is not None and value < low:
            raise FieldValueError(f"field '{field}' must be >= {low}, got {value!r}", where=where, field=field)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise FieldValueError(f"field '{field}' must be one of {', '.join(choices)}, got {value!r}",
                              where=where, field=field)
    return value


def from_table(cls: type[T], table: Any, *, where: str, prefix: str = "") -> T:
    """Build dataclass `cls` from a TOML table, checking keys, presence, types and values."""
    if not isinstance(table, dict):
        raise FieldTypeError(f"field '{prefix.rstrip('.')}' must be a table, got {table!r}",
                             where=where, field=prefix.rstrip("."))
    fields = {f.name: f for f in dataclasses.fields(typing.cast(Any, cls)) if f.init}
    for key in table:
        if key not in fields:
            raise UnknownFieldError(f"unknown field '{prefix}{key}' (known: {', '.join(sorted(fields))})",
                                    where=where, field=prefix + key)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        dotted = prefix + name
        tp, optional = _strip_optional(hints[name])
        if name not in table:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if not (has_default or optional):
                raise MissingFieldError(f"missing field '{dotted}'", where=where, field=dotted)
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = from_table(tp, table[name], where=where, prefix=dotted + ".")
        else:
            kwargs[name] = check_value(table[name], tp=tp, meta=f.metadata, where=where, field=dotted)
    try:
        return cls(**kwargs)
    except ProfileFieldError as exc:  # a cross-field check in __post_init__
        raise type(exc)(exc.detail, where=where, field=prefix + exc.field) from None


def validate_fields(obj: Any) -> None:
    """Re-check every scalar field of a constructed section (for profiles built in code)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        tp, _ = _strip_optional(hints[f.name])
        if value is None or dataclasses.is_dataclass(tp):
            continue
        meta = {k: v for k, v in f.metadata.items() if k != "size"}
        check_value(value, tp=int if f.metadata.get("size") else tp, meta=meta,
                    where=type(obj).__name__, field=f.name)
