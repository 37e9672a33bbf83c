"""Pipeline parallelism: which layers, weights and KV each stage holds.

``vllm/distributed/utils.py`` ``get_pp_indices`` gives each of ``pp`` stages
``num_layers // pp`` decoder layers and hands the remainder out one each to the stages
before the last, counting backwards from the second-to-last (the last stage also runs
the final norm, LM head and sampler): 61 layers over 2 stages are [31, 30], 22 over 4
are [5, 6, 6, 5]. The first stage holds the input embedding, the last the LM head (a
tied embedding is loaded there a second time).

Each stage's workers profile their own memory and size their own KV tensors for the
layers they hold (``get_kv_cache_configs`` projects the model-wide KV groups onto each
worker); the scheduler is shared, so every worker is then cut down to the smallest
block count of any worker. A drafter (EAGLE, MTP) runs on the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgateway.capacity.arch import ModelArch
from kvgateway.capacity.layout import KVLayout, cdiv
from kvgateway.capacity.speculative import average_layer_params, embedding_params


def pp_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, as vLLM's ``get_pp_indices`` splits them."""
    if pp <= 1:
        return (num_layers,)
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return tuple(counts)


@dataclass(frozen=True, slots=True)
class StageShare:
    """One pipeline stage, per GPU of that stage."""

    stage: int
    model_layers: int
    draft_layers: int
    kv_layers: int  # the group size vLLM divides this worker's pool by
    weights_bytes: int | None  # None: no parameter count to size them from
    pool_bytes: int = 0
    num_blocks: int = 0


def _group_members(arch: ModelArch, layout: KVLayout, total_layers: int) -> list[set[int]]:
    """Layer indices of each KV group, model-wide, as ``layout`` forms them.

    Per attention type, in layer order, ``layers[i::n_groups]`` go to group ``i`` (the
    construction in :func:`layout.kv_layout`); drafter layers follow the model's and are
    full attention.
    """
    sliding = [i for i in arch.sliding_layers if i < total_layers]
    full = [i for i in range(total_layers) if i not in set(sliding)]
    members: list[set[int]] = []
    for indices in (full, sliding):
        n_groups = cdiv(len(indices), layout.group_size) if indices else 0
        members += [set(indices[i::n_groups]) for i in range(n_groups)]
    return members


def stage_kv_layers(arch: ModelArch, layout: KVLayout, held: set[int], total_layers: int) -> int:
    """The group size a worker holding layers ``held`` divides its pool by.

    vLLM forms the KV groups over the whole model and projects them onto each worker
    (``_project_kv_cache_groups_to_worker``); a worker's group size is its largest
    projected group. With one group that is simply the layers it holds.
    """
    if not layout.is_hybrid:
        return len(held)
    return max(len(group & held) for group in _group_members(arch, layout, total_layers))


def stage_weights_bytes(
    arch: ModelArch, tp: int, stage: int, pp: int, stage_layers: int
) -> int | None:
    """Weights per GPU of one stage: its layers (average size), plus embedding / LM head."""
    layer = average_layer_params(arch)
    if layer is None:
        return None
    params = stage_layers * layer
    if stage == 0:
        params += embedding_params(arch)
    if stage == pp - 1 and (pp > 1 or not arch.tied_embeddings):
        params += embedding_params(arch)
    return int(params * arch.weight_bytes_per_param / tp)


def stage_shares(
    arch: ModelArch,
    layout: KVLayout,
    tp: int,
    pp: int,
    draft_layers: int,
) -> tuple[StageShare, ...]:
    """Every stage's layers and weights (pool and blocks are filled in by the estimate)."""
    counts = pp_partition(arch.num_layers, pp)
    total = arch.num_layers + draft_layers
    shares: list[StageShare] = []
    start = 0
    for stage, layers in enumerate(counts):
        draft = draft_layers if stage == pp - 1 else 0
        held = set(range(start, start + layers))
        if draft:  # the whole drafter runs on the last stage
            held |= set(range(arch.num_layers, total))
        start += layers
        shares.append(
            StageShare(
                stage=stage,
                model_layers=layers,
                draft_layers=draft,
                kv_layers=stage_kv_layers(arch, layout, held, total),
                weights_bytes=stage_weights_bytes(arch, tp, stage, pp, layers),
            )
        )
    return tuple(shares)
