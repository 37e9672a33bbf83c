"""Typed reads from parsed YAML, with errors that name the YAML path.

Config parsing walks the YAML document with :class:`Section`; every failed read raises
:class:`ConfigError` whose message starts with the dotted path of the offending value,
e.g. ``tiers[1].backends[0].max_num_seqs: expected a positive integer, got "four"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid configuration; ``str(err)`` names the YAML path and what was expected."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if value is None:
        return "null"
    return repr(value)


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class Section:
    """A YAML mapping at ``path``; reads check types and reject unknown keys."""

    def __init__(self, data: Any, path: str = "") -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(path or "<document>", f"expected a mapping, got {_show(data)}")
        self.data: Mapping[str, Any] = data
        self.path = path
        self._seen: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self._seen.add(key)
        return self.data.get(key, default)

    def where(self, key: str | int) -> str:
        return join(self.path, key)

    def section(self, key: str) -> Section:
        return Section(self.raw(key), self.where(key))

    def sections(self, key: str, *, required: bool = False) -> Iterator[Section]:
        value = self.raw(key)
        if value is None:
            if required:
                raise ConfigError(self.where(key), "is required (a list)")
            return
        if not isinstance(value, list):
            raise ConfigError(self.where(key), f"expected a list, got {_show(value)}")
        if required and not value:
            raise ConfigError(self.where(key), "must not be empty")
        for i, item in enumerate(value):
            yield Section(item, join(self.where(key), i))

    def text(self, key: str, default: str | None = None) -> str:
        value = self.raw(key, default)
        if value is None:
            raise ConfigError(self.where(key), "is required")
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(self.where(key), f"expected a non-empty string, got {_show(value)}")
        return value

    def opt_str(self, key: str) -> str | None:
        return self.text(key) if self.has(key) else self.raw(key)

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.raw(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(self.where(key), f"expected a list of strings, got {_show(value)}")
        return tuple(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.where(key), f"expected true or false, got {_show(value)}")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.raw(key, default)
        if value is None:
            raise ConfigError(self.where(key), "is required")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError(self.where(key), f"expected {what}, got {_show(value)}")
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        return self.integer(key, minimum=minimum) if self.has(key) else None

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        minimum: float = 0.0,
        maximum: float | None = None,
        exclusive_min: bool = True,
    ) -> float:
        value = self.raw(key, default)
        if value is None:
            raise ConfigError(self.where(key), "is required")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(self.where(key), f"expected a number, got {_show(value)}")
        low_ok = value > minimum if exclusive_min else value >= minimum
        if not low_ok or (maximum is not None and value > maximum):
            rng = f"{'>' if exclusive_min else '>='} {minimum}"
            if maximum is not None:
                rng += f" and <= {maximum}"
            raise ConfigError(self.where(key), f"expected a number {rng}, got {_show(value)}")
        return float(value)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.raw(key, default)
        if value not in choices:
            raise ConfigError(
                self.where(key), f"expected one of {', '.join(choices)}, got {_show(value)}"
            )
        return str(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(self.where(key), f"expected a mapping, got {_show(value)}")
        return value

    def reject_unknown(self, *, ignore: tuple[str, ...] = ()) -> None:
        """Fail on keys nobody read: a typo must not silently fall back to a default."""
        unknown = sorted(set(self.data) - self._seen - set(ignore))
        if unknown:
            known = ", ".join(sorted(self._seen | set(ignore)))
            raise ConfigError(
                self.where(str(unknown[0])), f"unknown key (known keys here: {known})"
            )
