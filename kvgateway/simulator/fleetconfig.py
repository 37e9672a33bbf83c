"""Simulated node specs from the gateway's YAML config.

Reads only what the simulator needs, and ignores the rest of the file:

- ``models[]``: ``name`` and ``served_name`` (default: ``name``);
- ``tiers[].backends[]`` with a ``simulate:`` mapping (backends without one are real
  nodes and are skipped): ``name``, ``url`` (host and port to bind), ``model`` (a
  ``models[].name``; the node serves its ``served_name``) and ``simulate.profile`` plus
  optional overrides of any :class:`NodeSettings` field; or, instead of ``profile``,
  ``preset`` + ``gpu_memory_gib`` and vLLM's flags (``max_model_len``, ``max_num_seqs``,
  ``max_num_batched_tokens``, ``gpu_memory_utilization``, ``kv_cache_dtype``,
  ``cpu_offload_gb``): a node sized by the planner's maths (``sizing.py``); and
  ``simulate.kv_events`` (``{endpoint, topic, replay_endpoint, array_like}``, vLLM's
  ``--kv-events-config``);
- ``simulation:`` (optional, top level): defaults for every simulated node, e.g.
  ``time_scale`` or ``seed``. A default ``seed`` is a base: node ``i`` (in file order)
  gets ``seed + i`` so nodes do not draw identical output lengths.

Precedence, lowest first: profile, ``simulation:``, the backend's ``simulate:``, then
overrides given by the caller (CLI flags). Errors name the YAML path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvgateway.config.document import read_document
from kvgateway.config.yamlread import ConfigError, Reading, retype_expanded
from kvgateway.simulator.kv_events import kv_events_overrides
from kvgateway.simulator.profiles import get_profile
from kvgateway.simulator.settings import NodeSettings, SettingsError, apply_overrides
from kvgateway.simulator.sizing import SIZING_KEYS, size_from_mapping


class SimulatorConfigError(SettingsError):
    """The config cannot describe a simulated fleet; the message names the YAML path."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Where one simulated node listens and how it behaves."""

    settings: NodeSettings
    host: str = "127.0.0.1"
    port: int = 0

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def node_spec(
    profile: str,
    *,
    name: str = "sim",
    host: str = "127.0.0.1",
    port: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> NodeSpec:
    """One ad-hoc node from a profile name plus overrides (``port=0``: any free port)."""
    base = dataclasses.replace(get_profile(profile, "profile"), name=name)
    return NodeSpec(apply_overrides(base, overrides or {}, "overrides"), host, port)


def load_fleet_config(
    path: str | Path,
    *,
    port_offset: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> list[NodeSpec]:
    """Node specs of every backend with a ``simulate:`` block in the YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SimulatorConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    # Read as the gateway reads it: duplicate keys rejected, ${VAR} references expanded, so
    # a node listens where the gateway will look for it.
    reading = Reading()
    try:
        data = read_document(text, str(path), reading)
    except ConfigError as exc:
        raise SimulatorConfigError(str(exc)) from exc
    if reading.errors:
        raise SimulatorConfigError(f"{path}: {ConfigError.of(reading.errors)}")
    # A number or boolean from a reference in a simulate or simulation block is one
    # (simulation: {time_scale: ${TS:-1}}), as the gateway types its own values; the
    # rest of the file (names, URLs, topics) is read as the gateway reads it.
    data = _retype_simulation(data, reading.expanded)
    return parse_fleet_config(data, port_offset=port_offset, overrides=overrides)


# Settings that are strings whatever a reference holds ("0" stays "0"), and the
# kv_events block (endpoints and a topic).
_STRING_SETTINGS = frozenset(
    {f.name for f in dataclasses.fields(NodeSettings) if str(f.type).startswith("str")}
    | {"kv_events"}
)


def _retyped_block(block: Any, path: str, expanded: set[str]) -> Any:
    if not isinstance(block, Mapping):
        return block
    return {
        k: v if k in _STRING_SETTINGS else retype_expanded(v, f"{path}.{k}", expanded)
        for k, v in block.items()
    }


def _retype_simulation(data: Any, expanded: set[str]) -> Any:
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    if "simulation" in out:
        out["simulation"] = _retyped_block(out["simulation"], "simulation", expanded)
    tiers = out.get("tiers")
    if isinstance(tiers, list):
        out["tiers"] = [_retype_tier(t, f"tiers[{i}]", expanded) for i, t in enumerate(tiers)]
    return out


def _retype_tier(tier: Any, path: str, expanded: set[str]) -> Any:
    if not isinstance(tier, Mapping) or not isinstance(tier.get("backends"), list):
        return tier
    backends = []
    for j, b in enumerate(tier["backends"]):
        if isinstance(b, Mapping) and "simulate" in b:
            where = f"{path}.backends[{j}].simulate"
            backends.append({**b, "simulate": _retyped_block(b["simulate"], where, expanded)})
        else:
            backends.append(b)
    return {**tier, "backends": backends}


def parse_fleet_config(
    data: Any,
    *,
    port_offset: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> list[NodeSpec]:
    """Node specs from an already loaded config mapping (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise SimulatorConfigError("config: expected a mapping at the top level")
    models = _models(data.get("models"))
    defaults = _mapping(data.get("simulation"), "simulation")
    base_seed = defaults.get("seed")
    if base_seed is not None and (isinstance(base_seed, bool) or not isinstance(base_seed, int)):
        raise SimulatorConfigError(f"simulation.seed: expected an integer, got {base_seed!r}")
    tiers = data.get("tiers")
    if not isinstance(tiers, list):
        raise SimulatorConfigError("tiers: expected a list of tiers")

    specs: list[NodeSpec] = []
    seen: dict[tuple[str, int], str] = {}
    for ti, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            raise SimulatorConfigError(f"tiers[{ti}]: expected a mapping")
        backends = tier.get("backends") or []
        if not isinstance(backends, list):
            raise SimulatorConfigError(f"tiers[{ti}].backends: expected a list")
        for bi, backend in enumerate(backends):
            path = f"tiers[{ti}].backends[{bi}]"
            if not isinstance(backend, Mapping):
                raise SimulatorConfigError(f"{path}: expected a mapping")
            if backend.get("simulate") is None:
                continue  # a real node
            spec = _backend_spec(
                backend, path, models, defaults, base_seed=base_seed, index=len(specs)
            )
            spec = _shift(spec, port_offset, path)
            if overrides:
                spec = dataclasses.replace(
                    spec, settings=apply_overrides(spec.settings, overrides, "overrides")
                )
            key = (spec.host, spec.port)
            if key in seen:
                raise SimulatorConfigError(
                    f"{path}.url: {spec.host}:{spec.port} is already used by {seen[key]}"
                )
            seen[key] = path
            specs.append(spec)
    return specs


def _backend_spec(
    backend: Mapping[str, Any],
    path: str,
    models: dict[str, str],
    defaults: Mapping[str, Any],
    *,
    base_seed: int | None,
    index: int,
) -> NodeSpec:
    name = backend.get("name")
    if not isinstance(name, str) or not name:
        raise SimulatorConfigError(f"{path}.name: expected a non-empty string")
    host, port = _host_port(backend.get("url"), f"{path}.url")
    served = _served_model(backend.get("model"), models, f"{path}.model")
    sim = _mapping(backend.get("simulate"), f"{path}.simulate")
    profile = sim.get("profile")
    skip: tuple[str, ...] = ("profile",)
    if "preset" in sim:
        # A node sized by the planner's maths from vLLM's flags (simulator/sizing.py).
        if profile is not None:
            raise SimulatorConfigError(f"{path}.simulate.preset: give profile or preset, not both")
        sized = size_from_mapping(sim, f"{path}.simulate", name=name)
        base = sized.settings
        skip = SIZING_KEYS
    elif not isinstance(profile, str):
        raise SimulatorConfigError(
            f"{path}.simulate.profile: required, a profile name (or preset: a planner preset)"
        )
    else:
        base = get_profile(profile, f"{path}.simulate.profile")
    settings = dataclasses.replace(base, name=name, model=served)
    settings = apply_overrides(settings, defaults, "simulation", skip=("seed",))
    if base_seed is not None:
        settings = dataclasses.replace(settings, seed=base_seed + index)
    if sim.get("kv_events") is not None:
        events = kv_events_overrides(sim["kv_events"], f"{path}.simulate.kv_events")
        sim = {**{k: v for k, v in sim.items() if k != "kv_events"}, **events}
    settings = apply_overrides(settings, sim, f"{path}.simulate", skip=skip)
    return NodeSpec(settings, host, port)


def _shift(spec: NodeSpec, offset: int, path: str) -> NodeSpec:
    if not offset:
        return spec
    port = spec.port + offset
    if not 0 < port < 65536:
        raise SimulatorConfigError(
            f"{path}.url: port {spec.port} + offset {offset} is out of range"
        )
    return dataclasses.replace(spec, port=port)


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SimulatorConfigError(f"{path}: expected a mapping, got {value!r}")
    return value


def _models(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise SimulatorConfigError("models: expected a list")
    models: dict[str, str] = {}
    for i, model in enumerate(value):
        if not isinstance(model, Mapping) or not isinstance(model.get("name"), str):
            raise SimulatorConfigError(f"models[{i}].name: expected a string")
        served = model.get("served_name", model["name"])
        if not isinstance(served, str) or not served:
            raise SimulatorConfigError(f"models[{i}].served_name: expected a string")
        models[model["name"]] = served
    return models


def _served_model(value: Any, models: dict[str, str], path: str) -> str:
    if value is None:
        if len(models) == 1:
            return next(iter(models.values()))
        raise SimulatorConfigError(f"{path}: required (one of: {', '.join(models) or 'none'})")
    if not isinstance(value, str) or value not in models:
        raise SimulatorConfigError(
            f"{path}: unknown model {value!r}; known: {', '.join(models) or 'none'}"
        )
    return models[value]


def _host_port(value: Any, path: str) -> tuple[str, int]:
    if not isinstance(value, str):
        raise SimulatorConfigError(f"{path}: expected a URL like http://127.0.0.1:9101")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise SimulatorConfigError(f"{path}: invalid URL {value!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise SimulatorConfigError(
            f"{path}: a simulated node needs an http URL with host and port, got {value!r}"
        )
    return parts.hostname, port
