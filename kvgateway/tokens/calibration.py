"""Calibration: how far the nodes' own prompt counts run above the gateway's estimate.

Fed with each response's ``usage.prompt_tokens`` next to the gateway's count; read when
a request is admitted, to scale its counted prompt. Per model, an EWMA of the ratio,
never below 1 (an over-count is safe) and never above :data:`MAX_RATIO`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_RATIO = 2.0


class PromptCalibration:
    def __init__(self, observe: Callable[[str, float], None] | None = None) -> None:
        self._ratio: dict[str, float] = {}
        self._observe = observe

    def ratio(self, model: str) -> float:
        return self._ratio.get(model, 1.0)

    def scaled(self, model: str, counted: int, margin: float) -> int:
        """The counted prompt, grown by the configured margin and by the learned ratio."""
        ratio = max(1.0, min(self.ratio(model), MAX_RATIO))
        return math.ceil(counted * (1.0 + margin) * ratio)

    def observe(self, model: str, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        ratio = reported / estimated
        if self._observe is not None:
            self._observe(model, ratio)
        prev = self._ratio.get(model, 1.0)
        self._ratio[model] = 0.9 * prev + 0.1 * ratio
