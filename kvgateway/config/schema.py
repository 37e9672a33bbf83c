"""The config format as a JSON Schema, for editors (``gateway config-schema``).

Derived by walking the loader over an empty document in schema mode (see
:mod:`.yamlread`): every key the loader reads, with its type, bounds and default, is what
the schema allows, so the two cannot drift apart. The loader stays the authority: it also
checks what a schema cannot say (model names that exist, URLs without ``/v1``).
"""

from __future__ import annotations

from typing import Any

from kvgateway.config.load import config_root_section
from kvgateway.config.yamlread import Section

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def config_schema() -> dict[str, Any]:
    root = config_root_section()
    schema: dict[str, Any] = {
        "$schema": SCHEMA_DIALECT,
        "title": "kvgateway configuration",
        "description": (
            "Gateway YAML (see config/gateway.example.yaml). String values may hold "
            "${VAR} or ${VAR:-default} environment references."
        ),
    }
    schema.update(_resolve(root.schema()))
    return schema


def _resolve(node: Any) -> Any:
    """Replace each ``{"$section": Section}`` placeholder with that section's schema."""
    if isinstance(node, dict):
        section = node.get("$section")
        if isinstance(section, Section):
            return _resolve(section.schema())
        return {k: _resolve(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v) for v in node]
    return node
