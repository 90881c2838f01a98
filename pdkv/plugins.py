"""Classes named in the config: ``module:Class``, an installed distribution's entry point, or a built-in name.

A cache tier level can be any class (``tier.levels``, pdkv/tier/README.md,
"Your own backend"): the config names it and gives its options, and the class
declares what those options are (``Options``: a msgspec Struct or a
dataclass), so a typo or a wrong type fails at start with the field's full
path, as every other config error does, and never inside a request.

This module only finds classes and checks options; it imports nothing of
pdkv's above it, so the config can use it (what a level must be beyond that is
checked where levels are built, ``pdkv.tier.build_tier``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
from typing import Any

import msgspec

from pdkv.errors import ConfigError

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_HIDDEN = frozenset({"secret", "password", "token", "key"})  # an option with one of these words is never echoed


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]+@")  # the password of a URL's user part


def shown(name: str, value: Any) -> Any:
    """``value`` as an error message or ``--print-config`` may repeat it: redacted when ``name`` looks secret, and a
    URL's password (``redis://user:PASSWORD@host``) always."""
    if value and _HIDDEN & set(name.lower().split("_")):
        return "<redacted>"
    return _URL_PASSWORD.sub(r"\1<redacted>@", value) if isinstance(value, str) else value


def load_class(spec: str, group: str, builtins: dict[str, str], field: str) -> type:
    """The class ``spec`` names: ``module:Class``, else an entry point of ``group``, else one of ``builtins``
    (name -> ``module:Class``). Errors name ``field`` and say what was expected."""
    if not _SPEC.match(spec):
        target = _entry_point(spec, group) or builtins.get(spec)
        if target is None:
            known = sorted({*builtins, *(ep.name for ep in importlib.metadata.entry_points(group=group))})
            raise ConfigError(
                f"field '{field}' = {spec!r}: expected 'module:Class' or the name of a {group} entry point "
                f"(installed: {', '.join(known)})"
            )
        spec = target
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"field '{field}' = {spec!r}: cannot import {module_name!r} ({exc})") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"field '{field}' = {spec!r}: {module_name!r} has no {attr!r}")
    if not isinstance(obj, type):
        raise ConfigError(f"field '{field}' = {spec!r}: names a {type(obj).__name__}, expected a class")
    return obj


def _entry_point(name: str, group: str) -> str | None:
    """``module:Class`` of the entry point ``name`` in ``group`` of an installed distribution, or None."""
    found = importlib.metadata.entry_points(group=group, name=name)
    return next(iter(found)).value if found else None


def class_path(cls: type) -> str:
    """``module:Class``: what ``load_class`` takes back."""
    return f"{cls.__module__}:{cls.__qualname__}"


def convert_options(cls: type, raw: dict[str, Any], field: str) -> Any:
    """``raw`` as an instance of ``cls.Options`` (a msgspec Struct or a dataclass); errors name
    ``field.<option>``, the value given (secrets redacted) and what was expected."""
    options_type = getattr(cls, "Options", None)
    if not isinstance(options_type, type) or not (
        issubclass(options_type, msgspec.Struct) or dataclasses.is_dataclass(options_type)
    ):
        raise ConfigError(
            f"field '{field}.backend': {class_path(cls)} declares no typed options: give it a class attribute "
            "`Options`, a msgspec Struct or a dataclass"
        )
    names = [f.name for f in _fields(options_type)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        raise ConfigError(
            f"field '{field}.{unknown[0]}': unknown option of {class_path(cls)}; expected one of: {', '.join(names)}"
        )
    try:
        return msgspec.convert(raw, options_type, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        where = re.search(r"at `\$\.(\w+)`", text) or re.search(r"unknown field `(\w+)`", text)
        missing = re.search(r"missing required field `(\w+)`", text)
        option = (where or missing).group(1) if (where or missing) else ""
        expected = re.sub(r" - at `\$[^`]*`", "", text)
        if option in raw:
            what = f"{shown(option, raw[option])!r}: {expected}"
        else:
            what = f"missing: {expected}"
        raise ConfigError(
            f"field '{field}.{option}' = {what} (options of {class_path(cls)}: {', '.join(names)})"
        ) from None


def _fields(options_type: type) -> list[Any]:
    if issubclass(options_type, msgspec.Struct):
        return list(msgspec.structs.fields(options_type))
    return list(dataclasses.fields(options_type))
