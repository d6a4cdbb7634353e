"""Checking a JSON object against the dataclass it is read into, field by field.

A manifest is read from a file that anyone may have written, and a field of the wrong type does not
fail where it is read: a string ``num_heads`` fails deep inside a cell, an alias to a missing name
at the first lookup, each with a traceback. ``check_fields`` compares every value with its field's
annotation first, so the reader names the field in one line instead. It knows the annotations the
manifest uses: ``int``, ``float``, ``str``, ``bool``, ``None``, unions of them, ``list[X]``,
``dict[str, X]`` and ``Any``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

__all__ = ["check_fields", "is_attribute_path"]

# a name a directory gives a module or a tensor (a cell's module, an alias, a weight, a graph's
# get_attr and call_module targets): dotted parts that may be numeric ("layers.0.weight"), never
# Python's special attributes ("__class__", "__globals__"), through which a path would leave the
# modules and tensors the directory holds
_ATTRIBUTE_PATH = re.compile(r"(?!__)[A-Za-z0-9_]+(\.(?!__)[A-Za-z0-9_]+)*\Z")


def is_attribute_path(name: Any) -> bool:
    """Whether ``name`` is a dotted path of plain attributes (``layers.0.weight``)."""
    return isinstance(name, str) and _ATTRIBUTE_PATH.match(name) is not None


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _fits(value: Any, hint: Any, where: str) -> bool:
    """Does ``value`` fit ``hint``? A dataclass field is checked whole (raising for what does not fit)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if dataclasses.is_dataclass(hint):
        check_fields(hint, value, where)
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option, where) for option in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _fits(k, key, where) and _fits(v, item, f"{where}[{k!r}]") for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    raise TypeError(f"check_fields cannot check the annotation {hint!r}")  # a new kind of field: teach it here


def check_fields(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``data`` if it is an object whose keys are ``cls``'s fields (every field without a default
    present) and whose values fit their annotations, dataclass fields checked the same way; else
    ``ValueError`` naming ``where`` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where} has an unknown field {unknown[0]!r}")
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where} lacks the field {name!r}")
            continue
        if not _fits(data[name], hints[name], f"{where}.{name}"):
            raise ValueError(f"{where}.{name} must be {_name(hints[name])}, got {_describe(data[name])}")
    return data
