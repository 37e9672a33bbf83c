"""Calibration: how the nodes' own prompt counts relate to the gateway's count.

Fed with each response's ``usage.prompt_tokens`` next to the gateway's count, per backend
and model; read when a request is admitted, to bound its prompt. A node's count is, to a
good approximation, ``fixed + ratio * counted``: its chat template adds a fixed block (a
default system prompt, role headers) and its tokenizer splits text differently by a
roughly constant factor. The two are learned apart, so a template's 30 fixed tokens on
tiny chats are not read as a 4x ratio (which would then double every long prompt's
reservation and refuse prompts the node serves):

- ``fixed`` from small prompts (below :data:`SMALL` counted tokens), where the overhead
  dominates: an EWMA of ``reported - ratio * counted``;
- ``ratio`` from larger prompts only, on the tokens above the fixed overhead: the median
  of the last :data:`WINDOW` prompts' ratios, once :data:`MIN_RATIO_SAMPLES` were seen
  (1.0 before). The ratio differs by content, not only by node (digit runs cost a
  Qwen node 2.5x what cl100k counts, English prose 1.05x): a median is what most prompts
  see, and one digit-heavy chat does not scale every English prompt after it past the
  context. What a prompt unlike most costs is not predicted: near a limit the node is
  asked (planning and :mod:`kvgateway.upstream.node_tokenize`).

Each observation is clamped before it is used, so one odd answer moves either only so
far. Reads never go below the gateway's own count.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_RATIO = 4.0
MAX_FIXED = 4096.0
SMALL = 256  # counted tokens below which a prompt teaches the fixed overhead
WINDOW = 31  # large prompts whose ratios the median is taken over
MIN_RATIO_SAMPLES = 3  # large prompts seen before their median is used
FIXED_ALPHA = 0.2


@dataclass(slots=True)
class _Fit:
    fixed: float = 0.0
    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    samples: int = 0  # reports seen

    @property
    def ratio(self) -> float:
        if len(self.ratios) < MIN_RATIO_SAMPLES:
            return 1.0
        return statistics.median(self.ratios)

    def add(self, counted: int, reported: int) -> None:
        self.samples += 1
        if counted < SMALL:
            sample = min(max(reported - self.ratio * counted, 0.0), MAX_FIXED)
            self.fixed += FIXED_ALPHA * (sample - self.fixed)
            return
        r = (reported - self.fixed) / counted
        self.ratios.append(min(max(r, 1.0 / MAX_RATIO), MAX_RATIO))

    def predict(self, counted: float) -> float:
        return self.fixed + max(1.0, self.ratio) * counted


class PromptCalibration:
    def __init__(self, observe: Callable[[str, float], None] | None = None) -> None:
        # By model, then backend: a request reads its model's fits only.
        self._fits: dict[str, dict[str, _Fit]] = {}
        self._observe = observe

    def _model_fits(self, model: str) -> Iterable[_Fit]:
        return self._fits.get(model, {}).values()

    def backends(self) -> set[str]:
        """The backends with a fit (any model)."""
        return {name for fits in self._fits.values() for name in fits}

    def keep_backends(self, present: set[str]) -> None:
        """Forget the fits of backends gone from the fleet: DNS members come and go as
        new names, and every request reads its model's fits (and a gone node's ratio
        would bound every prompt for good)."""
        for model, fits in list(self._fits.items()):
            for name in [n for n in fits if n not in present]:
                del fits[name]
            if not fits:
                del self._fits[model]

    def ratio(self, model: str) -> float:
        """The largest learned tokenizer ratio among ``model``'s backends (1.0 unknown)."""
        return max((f.ratio for f in self._model_fits(model)), default=1.0)

    def fixed(self, model: str) -> float:
        """The largest learned fixed template overhead among ``model``'s backends."""
        return max((f.fixed for f in self._model_fits(model)), default=0.0)

    def scaled(self, model: str, counted: int, margin: float) -> int:
        """A bound on what ``model``'s backends will count for a prompt the gateway
        counted as ``counted``: the configured margin, then the largest prediction of any
        backend's fit (the backend is not chosen yet)."""
        base = counted * (1.0 + margin)
        predicted = max((f.predict(base) for f in self._model_fits(model)), default=base)
        return math.ceil(max(base, predicted) - 1e-9)

    def learned(self, model: str, counted: int, margin: float, min_samples: int) -> int | None:
        """What ``model``'s backends are predicted to count for a prompt the stand-in
        counted as ``counted`` (:meth:`scaled`), once they reported ``min_samples``
        prompts; None before. No worst-case vocabulary bound: for reservations that
        trade the guarantee for capacity (``output_reservation: learned``)."""
        if sum(f.samples for f in self._model_fits(model)) < min_samples:
            return None
        return self.scaled(model, counted, margin)

    def observe(self, backend: str, model: str, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        if self._observe is not None:
            self._observe(model, reported / estimated)
        self._fits.setdefault(model, {}).setdefault(backend, _Fit()).add(estimated, reported)
