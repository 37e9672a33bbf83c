"""The one exception of the capacity package.

``CapacityConfigError(ValueError)`` is raised for every bad input: a YAML capacity
block, a Hugging Face ``config.json``, a preset name, a CLI flag, or a model whose KV
layout we refuse to guess. ``path`` names where the problem is (a YAML path such as
``tiers[0].backends[1].capacity.tp``, or a config.json key); ``str(exc)`` is
``"<path>: <detail>"`` so callers can show it as is.
"""

from __future__ import annotations

import json


class CapacityConfigError(ValueError):
    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}" if path else detail)

    def under(self, prefix: str) -> CapacityConfigError:
        """The same error re-rooted below ``prefix`` (a YAML path or a file name)."""
        if not prefix:
            return self
        joined = f"{prefix}.{self.path}" if self.path else prefix
        return CapacityConfigError(joined, self.detail)


def show(value: object) -> str:
    """Render an offending value the way it appeared in YAML/JSON: strings quoted."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
