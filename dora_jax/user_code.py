"""Importing a user's module named in a config: ``path/to/file.py`` or ``package.module``.

:func:`import_target` loads the module before the ``:`` of a ``file.py:name`` or
``package.module:name`` spec (the reward function, the environment class); the callers name the
config field in their own errors. A file is loaded under a name derived from its path, so two
specs naming one file share one module. :func:`invoke` calls what the module gives (a coroutine
is run to its end). Imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


class UserImportError(Exception):
    """The module could not be imported (the message names it); ``cause`` is what it raised."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


def is_file_target(target: str) -> bool:
    """Whether a spec's target names a file (``.py`` or a path) rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def resolve_spec(spec: str) -> str:
    """``spec`` with a file path made absolute (workers may start elsewhere)."""
    target, sep, name = spec.rpartition(":")
    if sep and is_file_target(target):
        return f"{Path(target).resolve()}:{name}"
    return spec


def import_target(target: str, module_prefix: str) -> ModuleType:
    """The module ``target`` names. ``FileNotFoundError`` for a missing file,
    :class:`UserImportError` for a module that fails to import (whatever it raised)."""
    if not is_file_target(target):
        try:
            return importlib.import_module(target)
        except Exception as e:  # ImportError, or anything the module raises on import
            raise UserImportError(f"cannot import {target!r}", e) from None
    path = Path(target)
    if not path.is_file():
        raise FileNotFoundError(str(path))
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    mod_name = f"{module_prefix}_{digest}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file may raise anything on import
        del sys.modules[mod_name]
        raise UserImportError(f"{path} failed to import", e) from None
    return module


def load_named(
    spec: str, field: str, expected: str, prefix: str, error: type[Exception], noun: str = ""
) -> Any:
    """What a ``file.py:name`` or ``package.module:name`` ``spec`` names. A malformed spec, a
    missing file, a module that fails to import or a missing name raises ``error`` with one
    line naming the config ``field`` (``expected``: the forms it takes; ``noun``: what the name
    is, for the messages; ``prefix``: of a file's module name)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise error(f"{field}: expected {expected}, got {spec!r}")
    what = f"{noun} " if noun else ""
    try:
        module = import_target(target, prefix)
    except FileNotFoundError as e:
        looking = f" (looking for {what}{name!r})" if noun else ""
        raise error(f"{field}: {e}: no such file{looking}") from None
    except UserImportError as e:
        raise error(f"{field}: {e}: {one_line(e.cause)}") from None
    found = getattr(module, name, None)
    if found is None:
        raise error(f"{field}: {target} has no {what}{name!r}")
    return found


def one_line(e: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def invoke(fn: Any, *args: Any) -> Any:
    """``fn(*args)``; a coroutine is run to its end."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))
    return result


async def _wait(awaitable):
    return await awaitable


def finite_real(x: Any) -> float | None:
    """A value user code returned (a reward, a metric) as a float if it is a finite real number
    (a bool, int or float, or a 0-d array of such a dtype; not text, not complex), else None."""
    kind = (
        getattr(getattr(x, "dtype", None), "kind", None) if getattr(x, "ndim", None) == 0 else None
    )
    if not (isinstance(x, bool | int | float) or kind in ("b", "i", "u", "f")):
        return None
    try:
        v = float(x)
    except OverflowError:  # an int past float's range
        return None
    return v if math.isfinite(v) else None
