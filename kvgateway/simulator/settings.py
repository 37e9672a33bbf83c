"""Settings of one simulated vLLM node, and their validation.

A :class:`NodeSettings` is a frozen value: profiles (``profiles.py``) are instances of it,
and a config file's ``simulate:`` block is applied on top with
:func:`apply_overrides`, which names the YAML path of any bad value. Everything a node
does is decided by these fields, so two nodes built from equal settings behave alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgateway.capacity.layout import kv_tokens_from_blocks
from kvgateway.simulator.cost import CostModel
from kvgateway.simulator.engine import EngineConfig

OUTPUT_DISTRIBUTIONS = ("lognormal", "uniform", "fixed")
CONTEXT_OVERFLOW = ("clamp", "reject")


class SettingsError(ValueError):
    """A setting is invalid; the message starts with its YAML path."""


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """Everything that defines one simulated node.

    Capacity fields mirror vLLM's engine arguments. Timing fields are in *simulated*
    seconds (see :class:`~kvgateway.simulator.engine.CostModel`); ``time_scale`` divides
    them into wall-clock time, so 10 runs the node ten times faster than the hardware it
    models. Metrics histograms are reported in simulated seconds (what the modelled
    hardware would show).
    """

    # Identity: `model` is the served name (/v1/models id), `model_root` the model path.
    name: str = "sim"
    profile: str = "custom"
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    model_root: str | None = None

    # KV cache and scheduler, as vLLM's --num-gpu-blocks-override, --block-size, ...
    max_model_len: int = 8192
    num_gpu_blocks: int = 1920
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.92
    cache_dtype: str = "auto"
    # vLLM v0.29's --max-num-queued-reqs: in-flight (waiting + running) sequences
    # beyond which new requests get HTTP 503. None = unlimited (vLLM's default).
    max_num_queued_reqs: int | None = None

    # Cost model (simulated seconds), see engine.CostModel.
    step_overhead_s: float = 0.002
    weight_read_s: float = 0.016
    offload_s: float = 0.0
    prefill_s_per_token: float = 0.0002
    kv_read_s_per_token: float = 1.31e-7
    time_scale: float = 1.0

    # Output lengths: min(budget, a draw from this distribution).
    output_dist: str = "lognormal"
    output_mean: float = 256.0
    output_sigma: float = 1.0
    output_min: int = 1
    output_max: int = 4096
    seed: int | None = None

    # The node's own token counting, which may differ from the gateway's estimate.
    tokenizer_encoding: str = "cl100k_base"
    tokenizer_bytes_per_token: float | None = None
    tokenizer_scale: float = 1.0
    chat_overhead_per_message: int = 5
    chat_overhead_fixed: int = 3
    # A model tokenizer directory (tokenizer.json, tokenizer_config.json, ...): when set,
    # the node renders the model's chat template and counts with that tokenizer, as a
    # vLLM serving that model does; the fields above are then unused.
    tokenizer: str | None = None
    # vLLM's --default-chat-template-kwargs: a JSON object every chat template gets
    # unless a request's chat_template_kwargs (or its own fields) say otherwise.
    default_chat_template_kwargs: str | None = None

    # /metrics: expose vllm:gpu_cache_usage_perc (vLLM < 0.12) instead of the new name.
    legacy_metric_names: bool = False
    engine_label: str = "0"

    # vLLM's --stream-interval: a stream sends the first token at once, then tokens only
    # once this many have piled up (and at the finish).
    stream_interval: int = 1
    # A max_tokens that does not fit beside the prompt: "clamp" as vLLM >= 0.32 (served,
    # max_tokens cut to what the context leaves), "reject" as vLLM <= 0.31 (a 400).
    context_overflow: str = "clamp"

    # Prefix caching, on by default as in vLLM V1 (--no-enable-prefix-caching turns it off).
    enable_prefix_caching: bool = True
    # Hybrid attention: besides one full-attention KV-cache group, this many
    # sliding-window groups of `sliding_window` tokens share the pool (capacity/layout.py).
    sliding_window: int | None = None
    num_sliding_window_groups: int = 0
    # vLLM numbers the groups by each kind's first layer: True when layer 0 is a
    # sliding-window layer (gpt-oss, Gemma 3), so the sliding-window groups come first.
    sliding_window_first: bool = False
    # --kv-events-config: ZMQ PUB endpoint (binds when it has `*`, else connects, as vLLM),
    # topic, optional ROUTER replay endpoint; `kv_events_array_like` selects the layout
    # of vLLM releases before the map-encoded events. See kv_events.py.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str | None = None
    kv_events_array_like: bool = False
    # vLLM's PYTHONHASHSEED: the seed of NONE_HASH, the parent of every chain's first
    # block. None: this process's PYTHONHASHSEED, else vLLM's fixed "vllm-none-hash".
    hash_seed: str | None = None

    @property
    def served_root(self) -> str:
        return self.model_root or self.model

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """Per KV-cache group: None for full attention, else its sliding window."""
        sliding = (self.sliding_window,) * self.num_sliding_window_groups
        return (*sliding, None) if self.sliding_window_first else (None, *sliding)

    @property
    def kv_tokens(self) -> int:
        """Usable KV tokens: block 0 is reserved; every KV-cache group holds a copy."""
        return kv_tokens_from_blocks(self.num_gpu_blocks, self.block_size, len(self.kv_windows))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            cost=CostModel(
                step_overhead_s=self.step_overhead_s,
                weight_read_s=self.weight_read_s,
                offload_s=self.offload_s,
                prefill_s_per_token=self.prefill_s_per_token,
                kv_read_s_per_token=self.kv_read_s_per_token,
            ),
            enable_prefix_caching=self.enable_prefix_caching,
            kv_windows=self.kv_windows,
            enable_kv_events=self.kv_events_endpoint is not None,
            hash_seed=self.hash_seed,
        )

    def describe(self) -> str:
        return (
            f"profile={self.profile} max_model_len={self.max_model_len} "
            f"kv_tokens={self.kv_tokens} ({self.num_gpu_blocks} blocks x {self.block_size}) "
            f"max_num_seqs={self.max_num_seqs} time_scale={self.time_scale:g}"
        )


# Field name -> accepted kind. Derived once from the dataclass so it cannot drift.
def _field_kinds() -> dict[str, str]:
    kinds: dict[str, str] = {}
    for f in dataclasses.fields(NodeSettings):
        kinds[f.name] = str(f.type).replace(" ", "")
    return kinds


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(NodeSettings))


def _coerce(kind: str, value: Any, path: str) -> Any:
    optional = kind.endswith("|None")
    base = kind.removesuffix("|None")
    if value is None:
        if optional:
            return None
        raise SettingsError(f"{path}: expected {_describe_kind(base)}, got null")
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise SettingsError(f"{path}: expected true or false, got {value!r}")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SettingsError(f"{path}: expected an integer, got {value!r}")
    if base == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise SettingsError(f"{path}: expected a number, got {value!r}")
    if isinstance(value, str):
        return value
    raise SettingsError(f"{path}: expected a string, got {value!r}")


def _describe_kind(base: str) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false"}.get(base, "a string")


def apply_overrides(
    base: NodeSettings, overrides: Mapping[str, Any], path: str, *, skip: tuple[str, ...] = ()
) -> NodeSettings:
    """``base`` with ``overrides`` applied; keys in ``skip`` are ignored (handled by caller)."""
    kinds = _field_kinds()
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in skip:
            continue
        key_path = f"{path}.{key}"
        if not isinstance(key, str) or key not in kinds:
            known = ", ".join(n for n in SETTING_NAMES if n not in ("name", "profile"))
            raise SettingsError(f"{key_path}: unknown setting; known: {known}")
        changes[key] = _coerce(kinds[key], value, key_path)
    settings = dataclasses.replace(base, **changes)
    validate(settings, path)
    return settings


def validate(s: NodeSettings, path: str = "settings") -> None:
    """Raise :class:`SettingsError` naming the first field that makes no sense."""
    positive_ints = {
        "max_model_len": s.max_model_len,
        "block_size": s.block_size,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "output_min": s.output_min,
        "output_max": s.output_max,
        "stream_interval": s.stream_interval,
    }
    for name, value in positive_ints.items():
        if value < 1:
            raise SettingsError(f"{path}.{name}: expected a positive integer, got {value}")
    if s.num_gpu_blocks < 2:
        raise SettingsError(
            f"{path}.num_gpu_blocks: expected at least 2 (block 0 is reserved), "
            f"got {s.num_gpu_blocks}"
        )
    if s.max_num_queued_reqs is not None and s.max_num_queued_reqs < 1:
        raise SettingsError(
            f"{path}.max_num_queued_reqs: expected a positive integer or null, "
            f"got {s.max_num_queued_reqs}"
        )
    if s.time_scale <= 0:
        raise SettingsError(f"{path}.time_scale: expected a positive number, got {s.time_scale}")
    for name in (
        "step_overhead_s",
        "weight_read_s",
        "offload_s",
        "prefill_s_per_token",
        "kv_read_s_per_token",
        "chat_overhead_per_message",
        "chat_overhead_fixed",
    ):
        if getattr(s, name) < 0:
            raise SettingsError(f"{path}.{name}: must not be negative, got {getattr(s, name)}")
    if s.step_overhead_s + s.weight_read_s + s.offload_s <= 0:
        raise SettingsError(f"{path}.step_overhead_s: a step must take some time")
    if s.context_overflow not in CONTEXT_OVERFLOW:
        raise SettingsError(
            f"{path}.context_overflow: unknown {s.context_overflow!r}; "
            f"known: {', '.join(CONTEXT_OVERFLOW)}"
        )
    if s.output_dist not in OUTPUT_DISTRIBUTIONS:
        raise SettingsError(
            f"{path}.output_dist: unknown distribution {s.output_dist!r}; "
            f"known: {', '.join(OUTPUT_DISTRIBUTIONS)}"
        )
    if s.output_mean <= 0 or s.output_sigma < 0:
        raise SettingsError(f"{path}.output_mean: expected a positive mean and sigma >= 0")
    if s.output_min > s.output_max:
        raise SettingsError(
            f"{path}.output_min: {s.output_min} is larger than output_max {s.output_max}"
        )
    if s.tokenizer_bytes_per_token is not None and s.tokenizer_bytes_per_token <= 0:
        raise SettingsError(f"{path}.tokenizer_bytes_per_token: expected a positive number")
    if s.default_chat_template_kwargs is not None:
        try:
            kwargs = json.loads(s.default_chat_template_kwargs)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise SettingsError(
                f"{path}.default_chat_template_kwargs: expected a JSON object, got "
                f"{s.default_chat_template_kwargs!r}"
            )
    if s.tokenizer is not None and not os.path.isdir(os.path.expanduser(s.tokenizer)):
        raise SettingsError(f"{path}.tokenizer: {s.tokenizer!r} is not a directory")
    if s.tokenizer_scale <= 0:
        raise SettingsError(f"{path}.tokenizer_scale: expected a positive number")
    if not 0 < s.gpu_memory_utilization <= 1:
        raise SettingsError(f"{path}.gpu_memory_utilization: expected a number in (0, 1]")
    if not s.model:
        raise SettingsError(f"{path}.model: must not be empty")
    if s.num_sliding_window_groups < 0:
        raise SettingsError(f"{path}.num_sliding_window_groups: must not be negative")
    if s.num_sliding_window_groups and (s.sliding_window is None or s.sliding_window < 1):
        raise SettingsError(
            f"{path}.sliding_window: a positive window is needed with sliding-window groups"
        )
