"""Resolving each backend's limits from what is configured, discovered and derived.

Order of precedence, per limit: an explicit value in the backend's YAML entry; the
value the live node reports (``/v1/models`` -> ``max_model_len``; ``/metrics`` ->
``vllm:cache_config_info`` ``num_gpu_blocks`` x ``block_size``); the value derived from
the backend's ``capacity`` block (GPU memory, model architecture). Disagreements are
reported as warnings (``gateway check`` prints them, the server logs them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from kvgateway.capacity.layout import kv_tokens_from_blocks
from kvgateway.config.model import BackendConfig


class LimitSource(StrEnum):
    CONFIG = "config"
    DISCOVERED = "discovered"
    DERIVED = "derived"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Limit:
    value: int | None
    source: LimitSource


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: Limit
    kv_cache_tokens: Limit
    max_num_seqs: Limit
    block_size: int = 16
    warnings: tuple[str, ...] = ()
    # KV-cache groups sharing the pool (hybrid attention: 2+), and the node's own
    # statement of its capacity in tokens of max_model_len requests (vLLM >= 0.32).
    kv_groups: int = 1
    node_kv_tokens: int | None = None

    @property
    def known(self) -> bool:
        return self.max_model_len.value is not None and self.kv_cache_tokens.value is not None


@dataclass(frozen=True, slots=True)
class Observed:
    """Limits from one source (a live node, or the capacity maths)."""

    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    # Discovered: the pool's size as the node reports it (vllm:cache_config_info).
    num_gpu_blocks: int | None = None
    # How many KV-cache groups share the pool (2+ for hybrid attention models): derived
    # from the model's architecture, or discovered as a lower bound from the node's own
    # capacity (:func:`kv_groups_from_capacity`).
    kv_groups: int | None = None
    # Discovered: vLLM >= 0.32's own capacity in tokens of max_model_len requests.
    node_kv_tokens: int | None = None

    def keeping_pool_of(self, earlier: Observed | None) -> Observed:
        """This report, with ``earlier``'s pool if this one has none."""
        if earlier is None or earlier.num_gpu_blocks is None or self.num_gpu_blocks is not None:
            return self
        return replace(
            self,
            kv_cache_tokens=earlier.kv_cache_tokens,
            block_size=earlier.block_size,
            num_gpu_blocks=earlier.num_gpu_blocks,
        )


def usable_tokens(num_gpu_blocks: int, block_size: int) -> int:
    """Tokens requests can use on a node that reports ``num_gpu_blocks`` (one KV group)."""
    return kv_tokens_from_blocks(num_gpu_blocks, block_size)


def _pick(
    name: str,
    configured: int | None,
    discovered: int | None,
    derived: int | None,
    warnings: list[str],
) -> Limit:
    if configured is not None and discovered is not None and configured != discovered:
        risk = (
            "the node will reject or preempt requests the gateway admits"
            if configured > discovered
            else "capacity is left unused"
        )
        warnings.append(
            f"{name}: configured {configured} but the node reports {discovered} ({risk}); "
            "using the configured value"
        )
    if derived is not None:
        actual = discovered if discovered is not None else configured
        if actual is not None and abs(derived - actual) > 0.05 * max(actual, 1):
            warnings.append(
                f"{name}: derived from the capacity block as {derived} but "
                f"{'the node reports' if discovered is not None else 'configured'} {actual}"
            )
    if configured is not None:
        return Limit(configured, LimitSource.CONFIG)
    if discovered is not None:
        return Limit(discovered, LimitSource.DISCOVERED)
    if derived is not None:
        return Limit(derived, LimitSource.DERIVED)
    return Limit(None, LimitSource.UNKNOWN)


def kv_groups_from_capacity(
    num_gpu_blocks: int, block_size: int, max_model_len: int | None, node_tokens: int | None
) -> int | None:
    """KV-cache groups a node has at least, from vLLM >= 0.32's own capacity
    (``kv_cache_size_tokens``: ``num_gpu_blocks / blocks per max_model_len request x
    max_model_len``): a request of max_model_len takes a full-attention group's
    ``ceil(len / block)`` blocks in each of its groups, a sliding-window group's fewer,
    so the blocks it takes over its full run are a lower bound of the groups. None
    when the node does not say (before 0.32)."""
    if not node_tokens or not max_model_len:
        return None
    per_request = num_gpu_blocks * max_model_len / node_tokens
    full = -(-max_model_len // block_size)
    return max(1, math.ceil(per_request / full - 0.01))


def _in_groups(disc: Observed, derived: Observed | None) -> Observed:
    """A node reports its whole block pool; for a hybrid model (several KV-cache groups,
    from the architecture, else at least what the node's own capacity says) each
    request's tokens take a block in every group, so the pool holds
    ``(blocks - 1) // groups * block_size`` tokens."""
    groups = derived.kv_groups if derived is not None else None
    groups = groups or disc.kv_groups
    if not groups or groups <= 1 or disc.num_gpu_blocks is None or not disc.block_size:
        return disc
    tokens = kv_tokens_from_blocks(disc.num_gpu_blocks, disc.block_size, groups)
    return replace(disc, kv_cache_tokens=tokens)


def resolve_limits(
    cfg: BackendConfig, discovered: Observed | None, derived: Observed | None
) -> Limits:
    disc = _in_groups(discovered or Observed(), derived)
    der = derived or Observed()
    warnings: list[str] = []
    mml = _pick("max_model_len", cfg.max_model_len, disc.max_model_len, der.max_model_len, warnings)
    kv = _pick(
        "kv_cache_tokens", cfg.kv_cache_tokens, disc.kv_cache_tokens, der.kv_cache_tokens, warnings
    )
    seqs = _pick("max_num_seqs", cfg.max_num_seqs, disc.max_num_seqs, der.max_num_seqs, warnings)
    block = disc.block_size or der.block_size or 16
    return Limits(
        max_model_len=mml,
        kv_cache_tokens=kv,
        max_num_seqs=seqs,
        block_size=block,
        warnings=tuple(warnings),
        kv_groups=der.kv_groups or disc.kv_groups or 1,
        node_kv_tokens=disc.node_kv_tokens,
    )
