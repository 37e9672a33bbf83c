"""What a simulated node "generates": output lengths and deterministic filler text."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from kvgateway.simulator.settings import NodeSettings

# One simulated token = one of these words; the text is the same for every run, so
# tests can compare it, and each piece is one cl100k token.
_WORDS = (
    " the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog",
    " and", " then", " it", " runs", " back", " home", ".",
)  # fmt: skip


# The same words as JSON string literals, for building SSE events without json.dumps.
_WORDS_JSON = tuple(json.dumps(w) for w in _WORDS)


def token_json(index: int) -> str:
    """``token_text(index)`` as a JSON string literal."""
    return _WORDS_JSON[index % len(_WORDS_JSON)]


def filler_words() -> tuple[str, ...]:
    """The cycle ``token_text`` walks through: output token ``i`` is word ``i % len``."""
    return _WORDS


def token_text(index: int) -> str:
    """The text of output token number ``index`` (0-based) of any sequence."""
    return _WORDS[index % len(_WORDS)]


def filler_text(start: int, count: int) -> str:
    return "".join(_WORDS[i % len(_WORDS)] for i in range(start, start + count))


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How many tokens a sequence will produce and the finish reason it then reports."""

    tokens: int
    reason: str


class OutputSampler:
    """Draws output lengths from the node's configured distribution.

    The generated length is ``min(budget, draw)``: reaching the budget ends with
    ``length``, stopping earlier with ``stop`` (an EOS), so both reasons occur as with a
    real model. Seeded per node, so a run with the same arrivals is repeatable.
    """

    def __init__(self, settings: NodeSettings, rng: random.Random) -> None:
        self._s = settings
        self._rng = rng
        # Lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2.
        self._mu = math.log(settings.output_mean) - settings.output_sigma**2 / 2

    def draw(self) -> int:
        s = self._s
        if s.output_dist == "fixed":
            value = round(s.output_mean)
        elif s.output_dist == "uniform":
            value = self._rng.randint(s.output_min, s.output_max)
        else:
            value = round(self._rng.lognormvariate(self._mu, s.output_sigma))
        return max(s.output_min, min(s.output_max, value))

    def plan(self, budget: int, *, ignore_eos: bool = False, min_tokens: int = 0) -> OutputPlan:
        if ignore_eos:
            return OutputPlan(budget, "length")
        draw = max(self.draw(), min_tokens)
        if draw >= budget:
            return OutputPlan(budget, "length")
        return OutputPlan(draw, "stop")
