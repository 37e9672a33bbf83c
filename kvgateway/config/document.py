"""From YAML text to plain data: duplicate keys rejected, ``${VAR}`` references expanded.

PyYAML keeps the last of two equal keys without a word, so a pasted block can silently
override a setting above it. :class:`StrictLoader` checks the node tree before building
values, so each duplicate is reported with its YAML path and both lines.

Environment references in string values follow the shell: ``${VAR}`` (an error when
unset), ``${VAR:-default}`` (the default when unset or empty) and ``$$`` for a literal
``$``. A value that came from a reference may then be read as a number or boolean.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import yaml

from kvgateway.config.yamlread import ConfigError, Reading, join

_MERGE_TAG = "tag:yaml.org,2002:merge"
_REF = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}|\$\{")


class StrictLoader(yaml.SafeLoader):
    """A safe loader that reports duplicate mapping keys (with YAML paths) to a Reading."""

    def check_duplicates(self, node: yaml.Node, path: str, reading: Reading) -> None:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    self.check_duplicates(value_node, path, reading)
                    continue
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    reading.fail(
                        join(path, str(key)),
                        f"duplicate key (first at line {first_line[key]}, again at line {line})",
                    )
                else:
                    first_line[key] = line
                self.check_duplicates(value_node, join(path, str(key)), reading)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.check_duplicates(item, join(path, i), reading)


# Values a document may hold once its aliases are expanded: a config of a thousand
# backends holds a few tens of thousands; a few lines of nested aliases hold billions.
MAX_VALUES = 200_000


def _values(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` holds with its aliases expanded (each node counted once:
    an alias is the very node it names)."""
    size = sizes.get(id(node))
    if size is None:
        size = 1
        if isinstance(node, yaml.MappingNode):
            size += sum(_values(k, sizes) + _values(v, sizes) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            size += sum(_values(item, sizes) for item in node.value)
        sizes[id(node)] = size = min(size, MAX_VALUES + 1)
    return size


def read_document(text: str, source: str, reading: Reading) -> Any:
    """The document's data; problems are recorded in ``reading`` (YAML syntax raises)."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _values(node, {}) > MAX_VALUES:
            raise ConfigError(
                "", f"{source}: more than {MAX_VALUES:,} values once its YAML aliases are expanded"
            )
        loader.check_duplicates(node, "", reading)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("", f"{source}: invalid YAML{where}: {exc}") from exc
    except ValueError as exc:  # e.g. an integer past Python's 4,300-digit limit
        raise ConfigError("", f"{source}: invalid YAML: {exc}") from exc
    finally:
        loader.dispose()
    return expand_env(data, "", reading, os.environ)


def expand_env(data: Any, path: str, reading: Reading, env: Mapping[str, str]) -> Any:
    """``data`` with every ``${VAR}`` in its strings replaced from ``env``."""
    if isinstance(data, Mapping):
        return {k: expand_env(v, join(path, str(k)), reading, env) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, join(path, i), reading, env) for i, v in enumerate(data)]
    if not isinstance(data, str) or "$" not in data:
        return data

    def one(match: re.Match[str]) -> str:
        whole, name, has_default, default = match.group(0), match[1], match[2], match[3]
        if whole == "$$":
            return "$"
        if name is None:
            reading.fail(path, "unterminated or invalid ${...} reference (use $$ for a literal $)")
            return ""
        value = env.get(name)
        if has_default is not None and not value:
            return str(default)
        if value is None:
            reading.fail(
                path, f"environment variable {name} is not set (write ${{{name}:-default}})"
            )
            return ""
        return value

    out = _REF.sub(one, data)
    if out != data:
        reading.expanded.add(path)
    return out
