"""Blocks: how vLLM turns KV memory into blocks, tokens and concurrency.

All of it follows ``vllm/v1/core/kv_cache_utils.py``:

* ``get_kv_cache_groups``: a model whose layers all share one spec is one group of
  every layer. A hybrid model (full + sliding-window layers, same page size) goes
  through ``_get_kv_cache_groups_uniform_page_size``: group size = the smallest
  per-type layer count (or the largest, when largest < 1.5 x smallest), each type split
  into ``cdiv(n, group_size)`` groups, the last one padded with dummy layers.
* ``get_kv_cache_config_from_groups`` / ``get_num_blocks``:
  ``num_blocks = available_memory // page_size // group_size`` with
  ``page_size = block_size * bytes_per_token_per_layer``; the node takes the minimum
  over its GPUs (``get_kv_cache_configs``).
* ``BlockPool`` pops block 0 as the ``null_block`` at start-up: it is never handed to
  a request, so ``num_blocks - 1`` blocks are usable.
* ``_report_kv_cache_config`` logs ``GPU KV cache size`` as
  ``num_blocks // num_groups * block_size``, i.e. *including* the null block (newest
  releases log ``int(max_concurrency * max_model_len)``, the same number for one-group
  models when ``max_model_len`` is a multiple of the block size).
* ``get_max_concurrency_for_kv_cache_config``: ``num_blocks / blocks_per_request``,
  again including the null block; per request a full-attention group needs
  ``cdiv(len, block_size)`` blocks and a sliding-window group
  ``cdiv(min(window - 1 + in_flight, len), block_size) + 1``
  (``SlidingWindowSpec.max_admission_blocks_per_request``; ``in_flight``: vLLM's
  ``max_in_flight_tokens``, see :func:`kvgateway.capacity.estimate.in_flight_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgateway.capacity.arch import ModelArch, kv_bytes_per_token_per_layer


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: ``num_layers`` real layers sharing one block table."""

    num_layers: int
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class KVLayout:
    bytes_per_token_per_layer: int
    group_size: int
    groups: tuple[KVGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def padding_layers(self) -> int:
        return self.group_size * self.num_groups - sum(g.num_layers for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1


def kv_layout(arch: ModelArch, tp: int, kv_cache_dtype: str) -> KVLayout:
    per_layer = kv_bytes_per_token_per_layer(arch, tp, kv_cache_dtype)
    if not arch.is_hybrid:
        window = arch.sliding_window if arch.all_sliding else None
        return KVLayout(per_layer, arch.num_layers, (KVGroup(arch.num_layers, window),))
    n_sliding = len(arch.sliding_layers)
    by_type: list[tuple[int | None, int]] = [
        (None, arch.num_layers - n_sliding),
        (arch.sliding_window, n_sliding),
    ]
    # vLLM numbers the groups by each type's first layer (kv_cache_utils groups layers
    # by spec in layer order): gpt-oss and Gemma 3 start with a sliding-window layer.
    if min(arch.sliding_layers) == 0:
        by_type.reverse()
    smallest = min(n for _, n in by_type)
    largest = max(n for _, n in by_type)
    # vLLM pads to the larger count when the two are close (e.g. gpt-oss + an EAGLE
    # drafter, 12 sliding + 13 full), to avoid doubling the groups for one layer.
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KVGroup] = []
    for window, count in by_type:
        n_groups = cdiv(count, group_size)
        # layers[i::n_groups] goes to group i, so group sizes differ by at most one.
        for i in range(n_groups):
            groups.append(KVGroup(len(range(i, count, n_groups)), window))
    return KVLayout(per_layer, group_size, tuple(groups))


def page_bytes(layout: KVLayout, block_size: int) -> int:
    """One block of one layer."""
    return block_size * layout.bytes_per_token_per_layer


def num_gpu_blocks(layout: KVLayout, pool_bytes: int, block_size: int) -> int:
    if pool_bytes <= 0:
        return 0
    return pool_bytes // page_bytes(layout, block_size) // layout.group_size


def blocks_per_request(layout: KVLayout, context_len: int, block_size: int, in_flight: int) -> int:
    """Blocks one request of ``context_len`` tokens holds at its peak, all groups
    (``in_flight``: the tokens scheduled but not yet freed, which a sliding window holds
    beyond itself)."""
    total = 0
    for group in layout.groups:
        if group.sliding_window is None:
            total += cdiv(context_len, block_size)
        else:
            live = min(group.sliding_window - 1 + in_flight, context_len)
            total += cdiv(live, block_size) + 1
    return total


def vllm_logged_tokens(layout: KVLayout, blocks: int, block_size: int) -> int:
    """What vLLM prints as ``GPU KV cache size: N tokens`` (null block included)."""
    return blocks // layout.num_groups * block_size


def vllm_logged_tokens_at_length(
    layout: KVLayout, blocks: int, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """What the newest vLLM prints there: ``int(max_concurrency * max_model_len)``, the
    context tokens the pool holds at full-length concurrency. The same as
    :func:`vllm_logged_tokens` for one group; more for a hybrid model, whose
    sliding-window groups hold at most a window per request."""
    per_request = blocks_per_request(layout, max_model_len, block_size, max_num_batched_tokens)
    return int(blocks / per_request * max_model_len)


def blocks_from_logged_at_length(
    layout: KVLayout, tokens: int, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """The pool's blocks from a :func:`vllm_logged_tokens_at_length` figure (never more)."""
    per_request = blocks_per_request(layout, max_model_len, block_size, max_num_batched_tokens)
    return tokens * per_request // max(1, max_model_len)


def kv_tokens_from_blocks(num_blocks: int, block_size: int, num_groups: int = 1) -> int:
    """KV tokens requests can hold in a pool of ``num_blocks`` blocks: the one formula.

    vLLM keeps block 0 as the null block; the rest are shared by the KV-cache groups, so
    each request's tokens take a block in every group.
    """
    return max(0, num_blocks - 1) // max(1, num_groups) * block_size


def usable_tokens(layout: KVLayout, blocks: int, block_size: int) -> int:
    """Tokens requests can really hold: the null block removed.

    For a hybrid model this counts every group as if it held a full-attention copy of
    the request, which is exact for requests shorter than the window and conservative
    beyond it: the right bias for an admission budget.
    """
    return kv_tokens_from_blocks(blocks, block_size, layout.num_groups)


def kv_group_count(arch: ModelArch) -> int:
    """KV-cache groups vLLM forms for ``arch`` (the grouping depends on layer types only)."""
    return kv_layout(arch, 1, "auto").num_groups


def discovered_usable_tokens(
    num_gpu_blocks: int, block_size: int, arch: ModelArch | None = None
) -> int:
    """Usable KV tokens from what a node reports (``vllm:cache_config_info``).

    ``num_gpu_blocks`` is the pool's size, shared by all of the model's KV-cache groups,
    so a hybrid model holds ``(num_gpu_blocks - 1) // groups * block_size`` tokens of
    short requests; without a known architecture the model counts as one group.
    """
    if arch is None:
        return kv_tokens_from_blocks(num_gpu_blocks, block_size)
    return usable_tokens(kv_layout(arch, 1, "auto"), num_gpu_blocks, block_size)


def max_context_fitting(
    layout: KVLayout,
    available_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    upper: int,
) -> int:
    """Largest context one request can have within ``available_blocks`` (0 if none).

    Binary search, as vLLM's ``_estimate_max_model_len_from_groups`` does, because the
    sliding-window term makes the cost non-linear.
    """
    if available_blocks <= 0:
        return 0

    def fits(n: int) -> bool:
        return blocks_per_request(layout, n, block_size, max_num_batched_tokens) <= available_blocks

    if not fits(1):
        return 0
    lo, hi = 1, max(1, upper)
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def concurrency(
    layout: KVLayout,
    available_blocks: int,
    context_len: int,
    block_size: int,
    max_num_batched_tokens: int,
) -> float:
    """How many requests of ``context_len`` tokens fit in ``available_blocks`` at once."""
    need = blocks_per_request(layout, max(1, context_len), block_size, max_num_batched_tokens)
    return max(0, available_blocks) / need
