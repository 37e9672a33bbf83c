"""The set of backends the gateway routes to, rebuilt on reload without losing state.

A reload keeps the :class:`Backend` object of every backend whose name survives (so its
reservations, health and load stay), updates its config and limits, adds new ones,
and marks removed ones ``draining``: they take no new work and vanish once their last
reservation is released.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvgateway.config.model import BackendConfig, GatewayConfig
from kvgateway.core.backends import Backend, Observed, resolve_limits
from kvgateway.core.routing import ModelIndex

log = logging.getLogger("kvgateway.core.fleet")


_EMPTY = ModelIndex(())


@dataclass(frozen=True, slots=True)
class ReloadSummary:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]


class Fleet:
    def __init__(
        self, config: GatewayConfig, derived: Mapping[str, Observed] | None = None
    ) -> None:
        self._derived: dict[str, Observed] = dict(derived or {})
        self._discovered: dict[str, Observed] = {}
        self._active: list[Backend] = []
        self._draining: list[Backend] = []
        self._by_model: dict[str, ModelIndex] = {}
        self.config = config
        self._build(config)

    def _new_backend(self, cfg: BackendConfig, tier_index: int) -> Backend:
        limits = resolve_limits(cfg, self._discovered.get(cfg.name), self._derived.get(cfg.name))
        return Backend(
            config=cfg,
            tier_index=tier_index,
            limits=limits,
            budget_fraction=self.config.admission.budget_fraction,
        )

    def _build(self, config: GatewayConfig) -> None:
        self._active = [
            self._new_backend(b, i) for i, tier in enumerate(config.tiers) for b in tier.backends
        ]
        self._index()

    def _index(self) -> None:
        by_model: dict[str, list[Backend]] = {}
        for b in self._active:
            by_model.setdefault(b.model, []).append(b)
        self._by_model = {m: ModelIndex(bs) for m, bs in by_model.items()}

    @property
    def backends(self) -> Sequence[Backend]:
        """Active backends in tier order, then those draining after a reload."""
        return [*self._active, *self._draining]

    @property
    def active(self) -> Sequence[Backend]:
        return self._active

    def for_model(self, model: str) -> Sequence[Backend]:
        idx = self._by_model.get(model)
        return idx.backends if idx is not None else ()

    def index(self, model: str) -> ModelIndex:
        idx = self._by_model.get(model)
        return idx if idx is not None else _EMPTY

    def block_size(self, model: str) -> int:
        """The KV block size reservations of ``model`` are rounded to."""
        return self.index(model).block_size

    def largest_context(self, model: str) -> int:
        """The longest sequence any backend of ``model`` with known limits can hold."""
        return max((t.max_context for t in self.index(model).tiers), default=0)

    def adjust(self, b: Backend, tokens: int, seqs: int, in_flight: int) -> None:
        """Change a backend's reservations through its model's routing index; a draining
        backend leaves the fleet (admin view, metrics) when its last request ends."""
        self.index(b.model).adjust(b, tokens, seqs, in_flight)
        if b.draining and b.in_flight == 0 and b in self._draining:
            self.reap_drained()
            log.info("backend %s drained and removed", b.name)

    def get(self, name: str) -> Backend | None:
        for b in self._active:
            if b.name == name:
                return b
        return None

    def discovered(self, backend: Backend) -> Observed | None:
        """What the node last reported of its limits."""
        return self._discovered.get(backend.name)

    def set_discovered(self, backend: Backend, observed: Observed) -> bool:
        """Record what the node reported; returns True when its limits changed."""
        self._discovered[backend.name] = observed
        new = resolve_limits(backend.config, observed, self._derived.get(backend.name))
        changed = new != backend.limits
        if changed:
            for w in new.warnings:
                if w not in backend.limits.warnings:
                    log.warning("backend %s: %s", backend.name, w)
            backend.limits = new
            self._index()  # budgets and contexts are part of the routing index
        return changed

    def reap_drained(self) -> None:
        self._draining = [b for b in self._draining if b.in_flight > 0]

    def _drain(self, b: Backend) -> None:
        b.draining = True
        self._draining.append(b)
        self._discovered.pop(b.name, None)

    def _undrain(self, cfg: BackendConfig) -> Backend | None:
        """The draining backend of this name, url and model, back in service: its
        requests are still on it. What the node reported was forgotten when it left, so
        it counts as unchecked until probed again (and its limits rediscovered)."""
        for b in self._draining:
            if b.name == cfg.name and b.config.url == cfg.url and b.model == cfg.model:
                self._draining.remove(b)
                b.draining = False
                b.healthy = False
                return b
        return None

    def apply(self, config: GatewayConfig, derived: Mapping[str, Observed]) -> ReloadSummary:
        old = {b.name: b for b in self._active}
        self.config = config
        self._derived = dict(derived)
        active: list[Backend] = []
        added: list[str] = []
        changed: list[str] = []
        for i, tier in enumerate(config.tiers):
            for cfg in tier.backends:
                prev = old.pop(cfg.name, None)
                if prev is not None and (prev.config.url != cfg.url or prev.model != cfg.model):
                    # Same name, different node: the old one drains, and the new one
                    # starts unknown until probed (or is one still draining from before).
                    self._drain(prev)
                    changed.append(cfg.name)
                    prev = self._undrain(cfg)
                elif prev is None:
                    # Removed by an earlier reload and back before it drained: the same
                    # node, still holding its requests; one object, or its reservations
                    # are forgotten (and /metrics shows the name twice).
                    prev = self._undrain(cfg)
                    added.append(cfg.name)
                if prev is None:
                    active.append(self._new_backend(cfg, i))
                    continue
                if prev.config != cfg or prev.tier_index != i:
                    changed.append(cfg.name)
                prev.config = cfg
                prev.tier_index = i
                prev.budget_fraction = config.admission.budget_fraction
                prev.limits = resolve_limits(
                    cfg, self._discovered.get(cfg.name), self._derived.get(cfg.name)
                )
                active.append(prev)
        for gone in old.values():
            self._drain(gone)
        self._active = active
        self._index()
        self.reap_drained()
        return ReloadSummary(tuple(added), tuple(old), tuple(changed))
