"""Typed reads from parsed YAML, with errors that name the YAML path.

Config parsing walks the YAML document with :class:`Section`. A failed read does not stop
the walk: it is recorded in the document's :class:`Reading` and the read returns a
placeholder, so one run reports every problem. :meth:`Reading.raise_if_any` then raises one
:class:`ConfigError` whose lines each start with the dotted path of the offending value,
e.g. ``tiers[1].backends[0].max_num_seqs: expected a positive integer, got "four"``.

The same walk, run over an empty document in *schema mode*, records what each read accepts
(type, bounds, default, required) instead: that is how ``gateway config-schema`` derives a
JSON Schema from the loader without a second description of the format.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

# A value produced by an environment reference may be a string where a number is expected.
_ENV_STRING: dict[str, Any] = {"type": "string", "pattern": r"\$\{"}


class ConfigError(ValueError):
    """Invalid configuration; ``str(err)`` names the YAML path and what was expected.

    ``errors`` holds every problem found (this one alone for a single problem); ``path`` and
    ``problem`` are those of the first.
    """

    def __init__(self, path: str, problem: str, errors: Sequence[ConfigError] = ()) -> None:
        self.path = path
        self.problem = problem
        self.errors: tuple[ConfigError, ...] = tuple(errors) or (self,)
        if len(self.errors) > 1:
            lines = "\n".join(f"  {e}" for e in self.errors)
            super().__init__(f"{len(self.errors)} problems:\n{lines}")
        else:
            super().__init__(f"{path}: {problem}" if path else problem)

    @classmethod
    def of(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error standing for all of ``errors`` (which must not be empty)."""
        if len(errors) == 1:
            return errors[0]
        return cls(errors[0].path, errors[0].problem, errors)


@dataclass
class Reading:
    """What one walk over a document collects: its errors, or (schema mode) its schema."""

    schema_mode: bool = False
    errors: list[ConfigError] = field(default_factory=list)
    # YAML paths whose strings came from ${VAR} references: typed reads may coerce them.
    expanded: set[str] = field(default_factory=set)

    def fail(self, path: str, problem: str) -> None:
        if not self.schema_mode:
            self.errors.append(ConfigError(path, problem))

    def raise_if_any(self) -> None:
        if self.errors:
            raise ConfigError.of(self.errors)


def retype_expanded(value: Any, path: str, expanded: Collection[str]) -> Any:
    """``value`` (at ``path``) with every string that came from an environment reference
    (its path in ``expanded``) read as YAML when it is a number, boolean or null: what a
    typed getter does, for values typed later (``simulate`` blocks,
    ``chat_template_kwargs``)."""
    if isinstance(value, Mapping):
        return {k: retype_expanded(v, join(path, str(k)), expanded) for k, v in value.items()}
    if isinstance(value, list):
        return [retype_expanded(v, join(path, i), expanded) for i, v in enumerate(value)]
    if isinstance(value, str) and path in expanded:
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        if parsed is None or isinstance(parsed, bool | int | float):
            return parsed
    return value


def _show(value: Any) -> str:
    if isinstance(value, str):
        shown = f'"{value}"'
    elif value is None:
        return "null"
    else:
        try:
            shown = repr(value)
        except ValueError:  # an integer too long to print
            return "an integer of more than 4,300 digits"
    return shown if len(shown) <= 80 else shown[:77] + "..."


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class Section:
    """A YAML mapping at ``path``; reads check types and reject unknown keys."""

    def __init__(self, data: Any, path: str = "", reading: Reading | None = None) -> None:
        self.reading = reading if reading is not None else Reading()
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            self.reading.fail(path or "<document>", f"expected a mapping, got {_show(data)}")
            data = {}
        self.data: Mapping[str, Any] = data
        self.path = path
        self._seen: set[str] = set()
        # Schema mode: JSON Schema of each key read, and the keys without a default.
        self.properties: dict[str, dict[str, Any]] = {}
        self.required: list[str] = []
        self.extra_keys: tuple[str, ...] = ()
        self.variants: tuple[str, ...] = ()

    # -- recording -----------------------------------------------------------------------

    def fail(self, key: str | int, problem: str) -> None:
        self.reading.fail(self.where(key), problem)

    def _note(self, key: str, schema: dict[str, Any], *, required: bool = False) -> None:
        if not self.reading.schema_mode:
            return
        self.properties[key] = schema
        if required and key not in self.required:
            self.required.append(key)

    def schema(self) -> dict[str, Any]:
        """This section's JSON Schema (schema mode): what the loader read from it."""
        props = dict(self.properties)
        for key in self.extra_keys:
            props.setdefault(key, {})
        out: dict[str, Any] = {"type": "object", "properties": props}
        required = [k for k in self.required if k not in self.variants]
        if required:
            out["required"] = required
        if self.variants:
            out["oneOf"] = [{"required": [k]} for k in self.variants]
        out["additionalProperties"] = False
        return out

    # -- reads ---------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self._seen.add(key)
        return self.data.get(key, default)

    def where(self, key: str | int) -> str:
        return join(self.path, key)

    def section(self, key: str) -> Section:
        child = Section(self.raw(key), self.where(key), self.reading)
        if self.reading.schema_mode:
            self.properties[key] = {"$section": child}
        return child

    def sections(self, key: str, *, required: bool = False) -> Iterator[Section]:
        if self.reading.schema_mode:
            child = Section(None, join(self.where(key), 0), self.reading)
            self._note(key, {"type": "array", "items": {"$section": child}}, required=required)
            if required:
                self.properties[key]["minItems"] = 1
            yield child
            return
        value = self.raw(key)
        if value is None:
            if required:
                self.fail(key, "is required (a list)")
            return
        if not isinstance(value, list):
            self.fail(key, f"expected a list, got {_show(value)}")
            return
        if required and not value:
            self.fail(key, "must not be empty")
        for i, item in enumerate(value):
            if not isinstance(item, Mapping):
                self.reading.fail(
                    join(self.where(key), i), f"expected a mapping, got {_show(item)}"
                )
                continue
            yield Section(item, join(self.where(key), i), self.reading)

    def one_of(self, *keys: str) -> Iterator[str]:
        """Exactly one of ``keys`` must be given; yields it (schema mode: each of them)."""
        if self.reading.schema_mode:
            self.variants = keys
            yield from keys
            return
        given = [k for k in keys if self.has(k)]
        if len(given) == 1:
            yield given[0]
            return
        choices = " or ".join(f"`{k}`" for k in keys)
        if given:
            self.fail(given[1], f"give either {choices}, not both")
        else:
            self.reading.fail(self.path or "<document>", f"needs {choices}")

    def text(self, key: str, default: str | None = None) -> str:
        note: dict[str, Any] = {"type": "string", "minLength": 1}
        if default:  # "" is the schema's stand-in for a default taken from another key
            note["default"] = default
        self._note(key, note, required=default is None)
        value = self.raw(key, default)
        if value is None:
            self.fail(key, "is required")
            return ""
        if not isinstance(value, str) or not value.strip():
            self.fail(key, f"expected a non-empty string, got {_show(value)}")
            return ""
        return value

    def opt_str(self, key: str) -> str | None:
        if self.has(key):
            return self.text(key)
        self.raw(key)  # known here, even unset: an unknown key's error lists it
        self._note(key, {"type": ["string", "null"]})
        return None

    def str_list(self, key: str) -> tuple[str, ...]:
        string = {"type": "string", "minLength": 1}
        self._note(key, {"anyOf": [string, {"type": "array", "items": string}], "default": []})
        value = self.raw(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(key, f"expected a list of strings, got {_show(value)}")
            return ()
        return tuple(value)

    def _typed(self, key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        """The value at ``key``; a string from an environment reference is read as YAML."""
        value = self.raw(key, default)
        if isinstance(value, str) and self.where(key) in self.reading.expanded:
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                return value
            if isinstance(parsed, kind):
                return parsed
        return value

    def _note_typed(self, key: str, schema: dict[str, Any], default: Any) -> None:
        note: dict[str, Any] = {"anyOf": [schema, _ENV_STRING]}
        if default is not None:
            note["default"] = default
        self._note(key, note, required=default is None)

    def flag(self, key: str, default: bool) -> bool:
        self._note_typed(key, {"type": "boolean"}, default)
        value = self._typed(key, default, bool)
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {_show(value)}")
            return default
        return value

    def integer(
        self, key: str, default: int | None = None, *, minimum: int = 1, maximum: int | None = None
    ) -> int:
        note: dict[str, Any] = {"type": "integer", "minimum": minimum}
        if maximum is not None:
            note["maximum"] = maximum
        self._note_typed(key, note, default)
        value = self._typed(key, default, int)
        if value is None:
            self.fail(key, "is required")
            return minimum
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            if maximum is not None:
                what = f"an integer from {minimum} to {maximum}"
            self.fail(key, f"expected {what}, got {_show(value)}")
            return default if default is not None else minimum
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        if self.has(key):
            return self.integer(key, minimum=minimum)
        self.raw(key)
        schema = {"anyOf": [{"type": "integer", "minimum": minimum}, _ENV_STRING, {"type": "null"}]}
        self._note(key, schema)
        return None

    def opt_number(
        self,
        key: str,
        *,
        minimum: float = 0.0,
        maximum: float | None = None,
        exclusive_min: bool = True,
    ) -> float | None:
        """A number (as :meth:`number` reads it), or None when absent or null: a setting
        whose absence means something of its own (a limit not set, another key's value),
        which the schema shows as no default."""
        if self.has(key):
            return self.number(key, minimum=minimum, maximum=maximum, exclusive_min=exclusive_min)
        self.raw(key)
        bounds: dict[str, Any] = {"type": "number"}
        bounds["exclusiveMinimum" if exclusive_min else "minimum"] = minimum
        if maximum is not None:
            bounds["maximum"] = maximum
        self._note(key, {"anyOf": [bounds, _ENV_STRING, {"type": "null"}]})
        return None

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        minimum: float = 0.0,
        maximum: float | None = None,
        exclusive_min: bool = True,
        fixed_maximum: bool = True,
    ) -> float:
        """``fixed_maximum`` False: ``maximum`` follows another key's value (the schema,
        which cannot say so, leaves it out)."""
        note: dict[str, Any] = {"type": "number"}
        note["exclusiveMinimum" if exclusive_min else "minimum"] = minimum
        if maximum is not None and fixed_maximum:
            note["maximum"] = maximum
        self._note_typed(key, note, default)
        value = self._typed(key, default, (int, float))
        fallback = default if default is not None else (maximum or minimum + 1.0)
        if value is None:
            self.fail(key, "is required")
            return fallback
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"expected a number, got {_show(value)}")
            return fallback
        if isinstance(value, int) and abs(value) > 2**53:
            self.fail(key, f"expected a number below 2**53, got {_show(value)}")
            return fallback
        if not math.isfinite(value):
            self.fail(key, f"expected a finite number, got {_show(value)}")
            return fallback
        low_ok = value > minimum if exclusive_min else value >= minimum
        if not low_ok or (maximum is not None and value > maximum):
            rng = f"{'>' if exclusive_min else '>='} {minimum}"
            if maximum is not None:
                rng += f" and <= {maximum}"
            self.fail(key, f"expected a number {rng}, got {_show(value)}")
            return fallback
        return float(value)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        self._note(key, {"enum": list(choices), "default": default})
        value = self.raw(key, default)
        if value not in choices:
            self.fail(key, f"expected one of {', '.join(choices)}, got {_show(value)}")
            return default
        return str(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        self._note(key, {"type": ["object", "null"]})
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            self.fail(key, f"expected a mapping, got {_show(value)}")
            return None
        retyped: Mapping[str, Any] = retype_expanded(value, self.where(key), self.reading.expanded)
        return retyped

    def reject_unknown(self, *, ignore: tuple[str, ...] = ()) -> None:
        """Fail on keys nobody read: a typo must not silently fall back to a default."""
        self.extra_keys = ignore
        unknown = sorted(set(self.data) - self._seen - set(ignore), key=str)
        known = ", ".join(sorted(self._seen | set(ignore)))
        for key in unknown:
            self.fail(str(key), f"unknown key (known keys here: {known})")
