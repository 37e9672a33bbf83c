"""Limits derived from each backend's ``capacity:`` block (GPU memory, model architecture).

The bridge between the gateway config and the pure maths in :mod:`kvgateway.capacity`.
Runs once per (re)load; errors name the YAML path of the capacity block.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.estimate import CapacityEstimate, estimate
from kvgateway.capacity.hf_config import arch_from_hf_config
from kvgateway.capacity.layout import kv_group_count
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.config.model import BackendConfig, GatewayConfig
from kvgateway.config.yamlread import ConfigError
from kvgateway.core.backends import Observed


def derive_backend(
    cfg: BackendConfig, base_dir: Path | None
) -> tuple[Observed, CapacityEstimate] | None:
    if cfg.capacity is None:
        return None
    where = f"{cfg.path}.capacity"
    try:
        spec = CapacitySpec.from_mapping(cfg.capacity, where, base_dir=base_dir)
        est = estimate(spec)
    except CapacityConfigError as exc:
        raise ConfigError("", str(exc)) from exc
    except ValueError as exc:
        raise ConfigError(where, str(exc)) from exc
    # A max_model_len longer than the pool holds would fail vLLM's start-up check: the
    # derived limit never exceeds what fits (gateway check shows the note).
    mml = (
        est.max_model_len_fit
        if spec.max_model_len is None
        else min(spec.max_model_len, est.max_model_len_fit)
    )
    observed = Observed(
        max_model_len=mml,
        kv_cache_tokens=est.kv_cache_tokens,
        max_num_seqs=spec.max_num_seqs,
        block_size=spec.block_size,
        kv_groups=est.layout.num_groups,
    )
    return observed, est


def model_dir_groups(config: GatewayConfig) -> dict[str, int]:
    """KV-cache groups of each model whose tokenizer directory is its model directory
    (a ``config.json`` beside the tokenizer): what vLLM forms for its layers."""
    out: dict[str, int] = {}
    for m in config.models:
        path = m.tokenizer.path
        if not path:
            continue
        try:
            with open(os.path.join(os.path.expanduser(path), "config.json"), "rb") as fh:
                doc = json.load(fh)
            out[m.name] = kv_group_count(arch_from_hf_config(doc, name=m.name))
        except (OSError, ValueError, CapacityConfigError):
            continue  # not a model directory the capacity maths reads: the node says
    return out


def derive_all(config: GatewayConfig) -> dict[str, Observed]:
    base = Path(config.source).parent if config.source and config.source != "<memory>" else None
    groups = model_dir_groups(config)
    out: dict[str, Observed] = {}
    for b in config.backends:
        derived = derive_backend(b, base)
        if derived is not None:
            out[b.name] = derived[0]
        elif b.model in groups:
            out[b.name] = Observed(kv_groups=groups[b.model])
    return out
