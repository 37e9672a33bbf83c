"""A simulated node sized from a model preset, a GPU and vLLM's serve flags.

The hand-made profiles (``profiles.py``) fix their block counts. Here the flags an
operator changes between tuning rounds (``--max-model-len``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--gpu-memory-utilization``, ``--kv-cache-dtype``,
``--cpu-offload-gb``) go through the planner's capacity maths (:func:`estimate`), so
the node gets the KV pool ``gateway plan`` predicts for them, and refuses to start,
with vLLM's own message, when one ``max_model_len`` request does not fit.

Timing comes from a card class picked by memory size (bandwidth and effective bf16
throughput from public datasheets; see profiles.py and VLLM.md's roofline): decode reads
the GPU-resident weights once per step, prefill costs ``2 x params`` FLOPs per token,
attention reads the KV bytes per token of every context token (fp8 halves them), and
offloaded weights cross PCIe every step. Estimates, right in shape, not exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgateway.capacity import layout as lay
from kvgateway.capacity.arch import KV_DTYPE_ALIASES
from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.estimate import CapacityEstimate, estimate
from kvgateway.capacity.layout import KVLayout
from kvgateway.capacity.memory import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GIB,
    default_max_num_seqs,
)
from kvgateway.capacity.presets import find_preset
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.simulator.settings import NodeSettings, SettingsError, validate

# Host-to-GPU bandwidth for --cpu-offload-gb weights (PCIe 4/5 x16, effective).
PCIE_BYTES_PER_S = 34e9
_SIM_VERSION = "0.21.0+sim"


@dataclass(frozen=True, slots=True)
class CardClass:
    """Timing figures of a GPU class: HBM bandwidth, effective dense bf16 throughput."""

    label: str
    max_gib: float
    bandwidth_bytes_per_s: float
    effective_flops: float
    step_overhead_s: float


# By memory size, first match wins (24 GB consumer, 32 GB, 48 GB workstation, H100, H200).
CARD_CLASSES: tuple[CardClass, ...] = (
    CardClass("24 GB class (RTX 4090)", 24.5, 1.0e12, 80e12, 0.002),
    CardClass("32 GB class (RTX 5090)", 32.5, 1.79e12, 112e12, 0.002),
    CardClass("48 GB class (L40S)", 48.5, 0.864e12, 180e12, 0.002),
    CardClass("80 GB class (H100 SXM)", 96.0, 3.35e12, 487e12, 0.0015),
    CardClass("141 GB class (H200)", 1e9, 4.8e12, 500e12, 0.0015),
)


@dataclass(frozen=True, slots=True)
class ServeFlags:
    """The ``vllm serve`` flags a tuning round changes; None = vLLM's default."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    cpu_offload_gb: float = 0.0

    def non_default(self) -> dict[str, object]:
        """As vLLM logs them at start-up (``non-default args: {...}``)."""
        values: dict[str, object] = {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_dtype": None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
            "cpu_offload_gb": self.cpu_offload_gb or None,
        }
        return {k: v for k, v in values.items() if v is not None}


class StartupError(SettingsError):
    """vLLM would refuse to start with these flags; ``log`` holds what it printed."""

    def __init__(self, message: str, log: tuple[str, ...]) -> None:
        super().__init__(message)
        self.log = log


@dataclass(frozen=True, slots=True)
class SizedNode:
    settings: NodeSettings
    estimate: CapacityEstimate
    card: CardClass
    log: tuple[str, ...]  # vLLM-style start-up lines (parse_vllm_log reads them)


def card_class(gpu_memory_gib: float) -> CardClass:
    return next(c for c in CARD_CLASSES if gpu_memory_gib <= c.max_gib)


def size_node(
    preset: str, gpu_memory_gib: float, flags: ServeFlags, *, name: str = "sim"
) -> SizedNode:
    """Settings of a node serving ``preset`` on one GPU of ``gpu_memory_gib`` GiB.

    Raises :class:`StartupError` (vLLM's message) when the flags leave no room for one
    ``max_model_len`` request, and :class:`SettingsError` for flags that make no sense.
    """
    try:
        info = find_preset(preset)
        base = CapacitySpec.from_mapping({"preset": preset, "gpu_memory_gib": gpu_memory_gib}, "")
    except CapacityConfigError as exc:
        raise SettingsError(f"--{exc.path.replace('_', '-')}: {exc.detail}") from None
    _check(flags)
    weights_gib = (info.param_count * info.weight_bytes_per_param) / GIB
    if flags.cpu_offload_gb >= weights_gib:
        raise SettingsError(
            f"--cpu-offload-gb: {flags.cpu_offload_gb:g} GiB is all of the "
            f"{weights_gib:.2f} GiB of weights"
        )
    resident_gib = weights_gib - flags.cpu_offload_gb
    spec = dataclasses.replace(
        base,
        gpu_memory_utilization=flags.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        kv_cache_dtype=KV_DTYPE_ALIASES.get(flags.kv_cache_dtype, flags.kv_cache_dtype),
        weights_gib=resident_gib if flags.cpu_offload_gb else None,
        max_model_len=flags.max_model_len,
        max_num_seqs=flags.max_num_seqs,
        max_num_batched_tokens=flags.max_num_batched_tokens,
    )
    try:
        est = estimate(spec)
    except CapacityConfigError as exc:
        raise SettingsError(f"--{exc.path.replace('_', '-')}: {exc.detail}") from None
    max_model_len = flags.max_model_len or info.config.get("max_position_embeddings") or 8192
    card = card_class(gpu_memory_gib)
    log = _startup_log(info.hf_id, flags, est, max_model_len, resident_gib)
    if est.num_gpu_blocks < 2:
        raise StartupError(_NO_MEMORY, (*log, f"ERROR [core.py] ValueError: {_NO_MEMORY}"))
    if est.max_model_len_fit < max_model_len:
        raise StartupError(_no_fit_message(est, max_model_len), log)
    bw = card.bandwidth_bytes_per_s
    settings = NodeSettings(
        name=name,
        profile=f"{info.name}@{gpu_memory_gib:g}GiB",
        model=info.hf_id,
        max_model_len=max_model_len,
        num_gpu_blocks=est.num_gpu_blocks,
        block_size=est.block_size,
        max_num_seqs=flags.max_num_seqs or default_max_num_seqs(gpu_memory_gib),
        max_num_batched_tokens=est.max_num_batched_tokens,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        cache_dtype=flags.kv_cache_dtype,
        step_overhead_s=card.step_overhead_s,
        weight_read_s=resident_gib * GIB / bw,
        offload_s=flags.cpu_offload_gb * GIB / PCIE_BYTES_PER_S,
        prefill_s_per_token=2 * info.param_count / card.effective_flops,
        kv_read_s_per_token=est.bytes_per_token / bw,
        **_groups(est.layout),
    )
    validate(settings, "sized node")
    return SizedNode(settings, est, card, log)


def _groups(layout: KVLayout) -> dict[str, Any]:
    """The node's KV-cache groups as NodeSettings fields: a hybrid model's
    sliding-window groups share the pool with its full-attention ones (a model whose
    every layer slides is one group; it is sized as full attention, which holds less)."""
    windows = [g.sliding_window for g in layout.groups]
    sliding = [w for w in windows if w is not None]
    if not sliding or len(sliding) == len(windows):
        return {}
    return {
        "sliding_window": sliding[0],
        "num_sliding_window_groups": len(sliding),
        "sliding_window_first": windows[0] is not None,
    }


# Keys of a ``simulate:`` block that size a --preset node (the rest are NodeSettings).
SIZING_KEYS = (
    "preset", "gpu_memory_gib", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "gpu_memory_utilization", "kv_cache_dtype", "cpu_offload_gb",
)  # fmt: skip


def size_from_mapping(data: Mapping[str, Any], path: str, *, name: str) -> SizedNode:
    """A node from a YAML ``simulate:`` block with ``preset:``; errors name the YAML path."""

    def number(key: str, *, integer: bool = False) -> Any:
        value = data.get(key)
        if value is None:
            return None
        ok = isinstance(value, int) if integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok or value <= 0:
            kind = "a positive integer" if integer else "a positive number"
            raise SettingsError(f"{path}.{key}: expected {kind}, got {value!r}")
        return value

    preset, dtype = data.get("preset"), data.get("kv_cache_dtype", "auto")
    if not isinstance(preset, str) or not isinstance(dtype, str):
        raise SettingsError(f"{path}.preset: expected a preset name and a kv_cache_dtype string")
    gib = number("gpu_memory_gib")
    if gib is None:
        raise SettingsError(f"{path}.gpu_memory_gib: required with preset")
    flags = ServeFlags(
        max_model_len=number("max_model_len", integer=True),
        max_num_seqs=number("max_num_seqs", integer=True),
        max_num_batched_tokens=number("max_num_batched_tokens", integer=True),
        gpu_memory_utilization=number("gpu_memory_utilization"),
        kv_cache_dtype=dtype,
        cpu_offload_gb=number("cpu_offload_gb") or 0.0,
    )
    try:
        return size_node(preset, float(gib), flags, name=name)
    except StartupError as exc:
        raise StartupError(f"{path}: {exc}", exc.log) from None
    except SettingsError as exc:
        raise SettingsError(f"{path}: {exc}") from None


# vLLM's check_enough_kv_cache_memory when nothing is left for KV blocks.
_NO_MEMORY = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
    "when initializing the engine."
)


def _check(flags: ServeFlags) -> None:
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(flags, key)
        if value is not None and value < 1:
            raise SettingsError(f"--{key.replace('_', '-')}: expected a positive integer")
    util = flags.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        raise SettingsError("--gpu-memory-utilization: expected a fraction in (0, 1]")
    if flags.cpu_offload_gb < 0:
        raise SettingsError("--cpu-offload-gb: must not be negative")


def _no_fit_message(est: CapacityEstimate, max_model_len: int) -> str:
    # vLLM's _max_memory_usage_bytes_from_groups: one request's blocks in every group (a
    # sliding-window group's capped by its window), each a page of every layer it pools.
    blocks = lay.blocks_per_request(
        est.layout, max_model_len, est.block_size, est.max_num_batched_tokens
    )
    needed = est.kv_layers_per_gpu * lay.page_bytes(est.layout, est.block_size) * blocks / GIB
    return (
        f"To serve at least one request with the models's max seq len ({max_model_len}), "
        f"({needed:.2f} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({est.kv_pool_bytes / GIB:.2f} GiB). Based on the available memory, the "
        f"estimated maximum model length is {max(0, est.max_model_len_fit)}. Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )


def _startup_log(
    hf_id: str, flags: ServeFlags, est: CapacityEstimate, max_model_len: int, weights_gib: float
) -> tuple[str, ...]:
    """The start-up lines of a vLLM V1 node, in the wordings ``parse_vllm_log`` reads."""
    pool = est.pool
    args = {"model": hf_id, **flags.non_default()}
    lines = [
        f"INFO [utils.py] non-default args: {args!r}",
        f"INFO [core.py] Initializing a V1 LLM engine (v{_SIM_VERSION}) with config: "
        f"model='{hf_id}', dtype=torch.bfloat16, max_seq_len={max_model_len}, "
        f"tensor_parallel_size=1, quantization=None, kv_cache_dtype={flags.kv_cache_dtype}",
        f"INFO [gpu_model_runner.py] Model loading took {weights_gib:.4f} GiB",
        "INFO [gpu_worker.py] Memory profiling takes 1.00 seconds. "
        f"total_gpu_memory={est_total_gib(pool.requested_bytes, flags):.2f}GiB; "
        f"gpu_memory_utilization={flags.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION:.2f}; "
        f"torch peak memory increase: {pool.activation_bytes / GIB:.2f}GiB; "
        f"Total non-torch memory: {pool.overhead_bytes / GIB:.2f}GiB",
        f"INFO [gpu_worker.py] Available KV cache memory: {pool.pool_bytes / GIB:.2f} GiB",
    ]
    if est.num_gpu_blocks >= 2:
        lines.append(
            f"INFO [kv_cache_utils.py] GPU KV cache size: {est.vllm_logged_tokens:,} tokens"
        )
        lines.append(
            f"INFO [kv_cache_utils.py] Maximum concurrency for {max_model_len:,} tokens per "
            f"request: {est.vllm_logged_concurrency:.2f}x"
        )
    if est.num_gpu_blocks >= 2 and est.max_model_len_fit < max_model_len:
        lines.append(f"ERROR [core.py] ValueError: {_no_fit_message(est, max_model_len)}")
    return tuple(lines)


def est_total_gib(requested_bytes: int, flags: ServeFlags) -> float:
    """The GPU's memory back from vLLM's request (total x utilization)."""
    return requested_bytes / GIB / (flags.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
