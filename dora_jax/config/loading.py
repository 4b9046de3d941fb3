"""Build an :class:`ExperimentConfig` from YAML presets and dotted command-line overrides.

Checks are strict: an unknown key, a value of the wrong type, or a value that a section's
``__post_init__`` rejects raises :class:`ConfigError` whose message starts with the full dotted
path of the field and says what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from dora_jax.config.schema import ConfigError, ExperimentConfig

T = typing.TypeVar("T")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(path, f"expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"expected {_describe(tp)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected {_describe(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:  # free-form (a constructor's keyword arguments)
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected {_describe(tp)}, got {value!r}")
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected a boolean (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected a float, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected a float, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            hint = " (quote it: YAML reads an unquoted 4:8 as a number)" if value else ""
            raise ConfigError(path, f"expected a string, got {value!r}{hint}")
        return value
    raise TypeError(f"{path}: unsupported config annotation {tp!r}")  # a bug in the schema


def _unknown_key(cls: type, key: str, path: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
    return ConfigError(_join(path, str(key)), f"unknown key{hint}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; missing keys take their defaults."""
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise _unknown_key(cls, key, path)
        kwargs[key] = _coerce(value, hints[key], _join(path, key))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(path) if path else e from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists), suitable for YAML or JSON."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.lr=1e-6"`` -> ``(["train", "lr"], 1e-6)``; the value is parsed as YAML (string
    fields keep the raw text, see :func:`apply_overrides`)."""
    if "=" not in text:
        raise ConfigError("", f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError("", f"override {text!r} has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:  # fine for a string field (its raw text is kept), else an error
        value = _Unparsed(ConfigError(key, f"cannot parse value {raw!r}: {e}"))
    return parts, value


@dataclasses.dataclass(frozen=True)
class _Unparsed:
    """An override value that is not valid YAML (``{prompt} ...``)."""

    error: ConfigError


def apply_overrides(data: dict[str, Any], overrides: list[str], cls: type) -> dict[str, Any]:
    """Set each dotted override into a copy of ``data``; unknown paths fail early."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node, node_cls, path = out, cls, ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # a section's field (inside a free-form mapping, env.kwargs.start=5, any key goes)
            if node_cls is not dict:
                if node_cls is None or not dataclasses.is_dataclass(node_cls):
                    raise ConfigError(path, f"is not a section; cannot set {'.'.join(parts[i:])!r}")
                if part not in {f.name for f in dataclasses.fields(node_cls)}:
                    raise _unknown_key(node_cls, part, path)
                hint = typing.get_type_hints(node_cls)[part]
                raw = text.split("=", 1)[1].strip()
                if last and _is_str_field(hint) and not (raw == "null" and _is_optional(hint)):
                    value = raw  # YAML 1.1 would read "4:8" as the base-60 integer 248
            path = _join(path, part)
            if last:
                if isinstance(value, _Unparsed):
                    raise value.error
                node[part] = value
                break
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
            if node_cls is not dict:
                node_cls = dict if _is_dict(hint) else _dataclass_in(hint)
    return out


def _is_str_field(tp: Any) -> bool:
    """``str`` or ``str | None`` (not ``tuple[str, ...]``, whose values are YAML lists)."""
    origin = typing.get_origin(tp)
    return tp is str or (origin in (Union, types.UnionType) and str in typing.get_args(tp))


def _is_dict(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def _is_optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def _dataclass_in(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError("", f"config file {str(p)!r} is a directory, not a YAML file")
    if not p.exists():
        raise ConfigError("", f"config file {str(p)!r} does not exist")
    if not (p.is_file() or p.is_char_device()):  # (/dev/null reads as an empty config)
        raise ConfigError("", f"config file {str(p)!r} is not a regular file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError("", f"config file {str(p)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def load_dataclass(
    cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> T:
    """A config of type ``cls``: defaults, then the YAML file at ``path``, then ``overrides``;
    an error names the field (and the file it came from)."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides), cls)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        given = override_for(e.path, overrides)
        if given is not None:
            raise ConfigError(e.path, f"{e.reason} (from the command line: {given})") from None
        if path is not None:
            raise ConfigError(e.path, f"{e.reason} (in {path})") from None
        raise


def override_for(path: str, overrides: list[str] | tuple[str, ...]) -> str | None:
    """The last override that sets ``path``, a field under it, or the section holding it."""
    for text in reversed(list(overrides)):
        key = text.split("=", 1)[0].strip()
        if not key or not path:
            continue
        if path == key or path.startswith((key + ".", key + "[")) or key.startswith(path + "."):
            return text
    return None


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """The experiment config: defaults, then the YAML file at ``path``, then ``overrides``.

    An ``env.spec`` given on the command line that swaps the file's environment for another
    does not inherit the file's ``env.kwargs``: they were the other class's arguments (the
    command line's ``env.kwargs.NAME=...`` are the new one's)."""
    overrides = list(overrides)
    swaps = any(o.split("=", 1)[0].strip() == "env.spec" for o in overrides)
    if swaps and path is not None and _swaps_environment(load_yaml(path), overrides):
        keys = [o.split("=", 1)[0].strip() for o in overrides]
        first = next((i for i, k in enumerate(keys) if k.startswith("env.kwargs")), len(keys))
        overrides.insert(first, "env.kwargs={}")  # before the new class's own arguments
    return load_dataclass(ExperimentConfig, path, overrides)


def _swaps_environment(data: dict[str, Any], overrides: list[str]) -> bool:
    """True when ``overrides`` set ``env.spec`` to another value than the file's, which has
    ``env.kwargs``."""
    env = data.get("env") if isinstance(data.get("env"), dict) else {}
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    if not env.get("kwargs") or "env.spec" not in keys:
        return False
    given = overrides[len(keys) - 1 - keys[::-1].index("env.spec")].split("=", 1)[1]
    return str(yaml.safe_load(given) or "") != str(env.get("spec") or "")


def dump_yaml(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
