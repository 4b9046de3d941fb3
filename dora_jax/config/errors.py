"""The error every configuration check raises, and the check itself."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type, or invalid.

    ``path`` is the dotted field path (e.g. ``model.num_kv_heads``); the message starts with it.
    """

    def __init__(self, path: str, message: str):
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix`` prepended to its path."""
        return ConfigError(f"{prefix}.{self.path}" if self.path else prefix, self.reason)


def check(ok: bool, name: str, message: str) -> None:
    """Raise :class:`ConfigError` naming the field ``name`` unless ``ok``."""
    if not ok:
        raise ConfigError(name, message)


def check_positive(cfg: object, *names: str) -> None:
    """:func:`check` that each field ``names`` of ``cfg`` is > 0."""
    for name in names:
        value = getattr(cfg, name)
        check(value > 0, name, f"must be > 0, got {value}")


def check_non_negative(cfg: object, *names: str) -> None:
    """:func:`check` that each field ``names`` of ``cfg`` is >= 0."""
    for name in names:
        value = getattr(cfg, name)
        check(value >= 0, name, f"must be >= 0, got {value}")


def check_choice(cfg: object, name: str, choices: tuple[str, ...]) -> None:
    """:func:`check` that field ``name`` of ``cfg`` is one of ``choices`` (at least two)."""
    value = getattr(cfg, name)
    *first, last = map(repr, choices)
    check(value in choices, name, f"must be {', '.join(first)} or {last}, got {value!r}")


def check_bool(cfg: object, *names: str) -> None:
    """:func:`check` that each field ``names`` of ``cfg`` is true or false."""
    for name in names:
        value = getattr(cfg, name)
        check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
