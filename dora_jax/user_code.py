"""Importing a user's module named in a config: ``path/to/file.py`` or ``package.module``.

:func:`import_target` loads the module before the ``:`` of a ``file.py:name`` or
``package.module:name`` spec (the reward function, the environment class); the callers name the
config field in their own errors. A file is loaded under a name derived from its path, so two
specs naming one file share one module. Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class UserImportError(Exception):
    """The module could not be imported: ``cause`` is what it raised; ``from_file`` says whether
    ``target`` named a file."""

    def __init__(self, target: str, cause: BaseException, from_file: bool):
        super().__init__(f"{target}: {type(cause).__name__}: {cause}")
        self.target, self.cause, self.from_file = target, cause, from_file


def is_file_target(target: str) -> bool:
    """Whether a spec's target names a file (``.py`` or a path) rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def import_target(target: str, module_prefix: str) -> ModuleType:
    """The module ``target`` names. ``FileNotFoundError`` for a missing file,
    :class:`UserImportError` for a module that fails to import (whatever it raised)."""
    if not is_file_target(target):
        try:
            return importlib.import_module(target)
        except Exception as e:  # ImportError, or anything the module raises on import
            raise UserImportError(target, e, from_file=False) from None
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
        raise UserImportError(str(path), e, from_file=True) from None
    return module
