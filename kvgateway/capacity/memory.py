"""The KV pool: what is left of a GPU once vLLM has loaded and profiled the model.

vLLM (``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``) requests
``total_gpu_memory * gpu_memory_utilization`` and subtracts what profiling measured:
weights, the peak activation of a dummy forward pass of ``max_num_batched_tokens``
tokens, non-torch allocations (NCCL, cuBLAS workspaces) and, since v0.21, an estimate
of the CUDA-graph pool. The remainder is logged as ``Available KV cache memory: X GiB``.

We cannot profile, so each term is an estimate, and each is overridable:

* weights: ``param_count * weight_bytes_per_param / tp`` (vLLM shards the embedding and
  LM head too); override with the ``Model loading took X GiB`` figure from a log.
* activation: a chunked-prefill step of ``max_num_batched_tokens`` tokens keeps about
  ``2 bytes * (6 * hidden + 4 * intermediate / tp)`` per token alive, plus fp32 logits
  (and a working copy) for up to ``max_num_seqs`` sampled rows. Calibrated on
  Llama-3.1-8B on an H100 (8192 tokens: vLLM measured 1.44 GiB, this gives 1.49).
* overhead: a flat 1.0 GiB for non-torch memory (0.26-0.39 GiB in field logs) and the
  CUDA-graph pool (0.23-0.52 GiB).

The result is a planning figure, good to a GiB or so. The exact pool is whatever the
node logs; pass it as ``kv_cache_memory_gib`` and everything downstream is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgateway.capacity.arch import ModelArch

GIB = 1 << 30
# vLLM's default --gpu-memory-utilization: 0.92 since the 2026-04 change (v0.21 cycle;
# CacheConfig in v0.25 reads Field(default=0.92)); it was 0.90 in every earlier release.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_OVERHEAD_GIB = 1.0
# vLLM's default max_num_seqs for `vllm serve` on GPUs.
DEFAULT_MAX_NUM_SEQS = 256
_ACTIVATION_FALLBACK_GIB = 1.0


def gib_to_bytes(gib: float) -> int:
    return int(gib * GIB)


def _large_card(gpu_memory_gib: float | None) -> bool:
    # vLLM's get_batch_defaults: >= 70 GiB and not an A100 (H100, H200, MI300X). An
    # A100-80GB keeps the small defaults; give its flags explicitly when planning one.
    return gpu_memory_gib is not None and gpu_memory_gib >= 70


def default_max_num_batched_tokens(gpu_memory_gib: float | None) -> int:
    """vLLM's default chunked-prefill budget for `vllm serve`: 8192 on >=70 GiB cards
    (other than A100s), else 2048."""
    return 8192 if _large_card(gpu_memory_gib) else 2048


def default_max_num_seqs(gpu_memory_gib: float | None) -> int:
    """vLLM's default `max_num_seqs` for `vllm serve`: 1024 on >=70 GiB cards (other
    than A100s), else 256."""
    return 1024 if _large_card(gpu_memory_gib) else DEFAULT_MAX_NUM_SEQS


@dataclass(frozen=True, slots=True)
class PoolBreakdown:
    """Per GPU, in bytes. ``measured`` is True when the pool was given, not estimated."""

    pool_bytes: int
    measured: bool
    requested_bytes: int = 0
    weights_bytes: int = 0
    activation_bytes: int = 0
    overhead_bytes: int = 0


def weights_bytes_per_gpu(arch: ModelArch, tp: int) -> int | None:
    if arch.param_count is None:
        return None
    return int(arch.param_count * arch.weight_bytes_per_param / tp)


def activation_bytes(
    arch: ModelArch, tp: int, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    if arch.hidden_size is None or arch.intermediate_size is None:
        return gib_to_bytes(_ACTIVATION_FALLBACK_GIB)
    per_token = 2 * (6 * arch.hidden_size + 4 * arch.intermediate_size // tp)
    logits = min(max_num_seqs, max_num_batched_tokens) * (arch.vocab_size or 0) * 4 * 2
    return max_num_batched_tokens * per_token + logits


def measured_pool(kv_cache_memory_gib: float) -> PoolBreakdown:
    return PoolBreakdown(pool_bytes=gib_to_bytes(kv_cache_memory_gib), measured=True)


def estimate_pool(
    *,
    total_gib: float,
    utilization: float,
    weights_bytes: int,
    activation: int,
    overhead: int,
) -> PoolBreakdown:
    # vLLM rounds the requested budget up (math.ceil in its MemorySnapshot maths).
    requested = math.ceil(gib_to_bytes(total_gib) * utilization)
    return PoolBreakdown(
        pool_bytes=requested - weights_bytes - activation - overhead,
        measured=False,
        requested_bytes=requested,
        weights_bytes=weights_bytes,
        activation_bytes=activation,
        overhead_bytes=overhead,
    )
