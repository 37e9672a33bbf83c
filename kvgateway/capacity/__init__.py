"""Per-node KV-cache capacity: how many tokens a vLLM node can hold, and why.

The arithmetic follows vLLM's own (``vllm/v1/core/kv_cache_utils.py``,
``vllm/v1/kv_cache_interface.py``, ``vllm/v1/worker/gpu_worker.py``; see each module's
docstring). Everything here is a pure function of its inputs, except ``cli.py``.

Public API, for the gateway config::

    spec = CapacitySpec.from_mapping(backend["capacity"], "tiers[0].backends[1].capacity")
    est = estimate(spec)
    est.kv_cache_tokens      # the admission budget: usable tokens, null block excluded
    est.max_model_len_fit    # longest single request that fits
    est.max_concurrency      # full-length requests at the target context, at once

    facts = parse_vllm_log(text)   # what a start-up log says (LogFacts)

Errors: :class:`CapacityConfigError` (a ``ValueError``) naming the YAML path.

Module map: ``arch`` (bytes per token), ``layout`` (blocks, groups, concurrency),
``memory`` (the pool), ``speculative`` (a drafter's KV layers and weights),
``pipeline`` (layers, weights and KV per pipeline stage),
``hf_config`` / ``presets`` (models), ``spec`` (inputs),
``estimate``, ``logparse``, ``advice`` / ``explain`` (recommendations), ``report``
(text/JSON), ``cli`` (``gateway plan``).
"""

from __future__ import annotations

from kvgateway.capacity.advice import Plan, Recommendation, Settings, make_plan
from kvgateway.capacity.arch import ModelArch, kv_bytes_per_token
from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.estimate import CapacityEstimate, estimate
from kvgateway.capacity.logparse import LogFacts, parse_vllm_log
from kvgateway.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from kvgateway.capacity.presets import preset_arch, preset_names
from kvgateway.capacity.spec import CapacitySpec

__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "CapacityConfigError",
    "CapacityEstimate",
    "CapacitySpec",
    "LogFacts",
    "ModelArch",
    "Plan",
    "Recommendation",
    "Settings",
    "estimate",
    "kv_bytes_per_token",
    "make_plan",
    "parse_vllm_log",
    "preset_arch",
    "preset_names",
]
