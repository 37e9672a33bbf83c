"""What would fit when a model does not fit a node at all (pure; no printing).

When the weights and overheads leave no room for even one request, trimming
``--max-model-len`` cannot help: the operator needs a different shape of node. Each
alternative here is re-estimated, so it is only offered when it really fits, in the order
operators reach for them: split the model over more GPUs, quantize the weights, or a
larger card.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvgateway.capacity.estimate import CapacityEstimate, estimate
from kvgateway.capacity.memory import GIB
from kvgateway.capacity.spec import CapacitySpec

_TP_SIZES = (2, 4, 8)
# Bytes per parameter of quantized checkpoints (4-bit: packed weights plus group scales).
_QUANTIZATIONS = (
    ("fp8 weights (--quantization fp8, or an FP8 checkpoint)", 1.0),
    ("4-bit weights (an AWQ or GPTQ checkpoint)", 0.53),
)
# Per-GPU memory as torch reports it, and what the card is sold as.
CARDS = (
    (47.5, "48 GB (L40S, RTX 6000 Ada)"),
    (79.25, "80 GB (A100 80GB, H100)"),
    (139.8, "141 GB (H200)"),
    (178.4, "180 GB (B200)"),
)


@dataclass(frozen=True, slots=True)
class Alternative:
    kind: str  # "tensor_parallel" | "quantization" | "larger_gpu"
    change: str  # what to do, as the operator would say it
    estimate: CapacityEstimate


def does_not_fit(spec: CapacitySpec, est: CapacityEstimate) -> bool:
    """No request at all fits: the weights (and overheads) leave no KV pool."""
    return spec.kv_cache_memory_gib is None and est.max_model_len_fit <= 0


def needed_len(est: CapacityEstimate) -> int:
    """The context an alternative must hold to count: the target, at most 8k."""
    return max(est.block_size, min(est.target_len, 8192))


def what_would_fit(spec: CapacitySpec, est: CapacityEstimate) -> tuple[Alternative, ...]:
    if spec.gpu_memory_gib is None:
        return ()
    need = needed_len(est)
    out: list[Alternative] = []
    tp = _smallest_tp(spec, need, spec.weights_gib)
    if tp is not None:
        alt = estimate(replace(spec, tp=tp[0]))
        out.append(
            Alternative(
                "tensor_parallel",
                f"--tensor-parallel-size {tp[0]} over {tp[0]} GPUs of {spec.gpu_memory_gib:g} GiB",
                alt,
            )
        )
    for label, bytes_per_param in _QUANTIZATIONS:
        weights = _quantized_gib(spec, est, bytes_per_param)
        if weights is None:
            continue
        found = _smallest_tp(replace(spec, tp=1), need, weights, include_current=True)
        if found is not None:
            tp_n, alt = found
            where = "on one GPU" if tp_n == 1 else f"with --tensor-parallel-size {tp_n}"
            out.append(Alternative("quantization", f"{label} {where}", alt))
    for gib, name in CARDS:
        if gib <= spec.gpu_memory_gib:
            continue
        alt = estimate(replace(spec, gpu_memory_gib=gib))
        if alt.max_model_len_fit >= need:
            card = f"one {name} GPU" if spec.tp == 1 else f"{spec.tp} {name} GPUs"
            out.append(Alternative("larger_gpu", f"{card} ({gib:g} GiB as torch sees it)", alt))
            break
    return tuple(out)


def _quantized_gib(
    spec: CapacitySpec, est: CapacityEstimate, bytes_per_param: float
) -> float | None:
    """Weights of the whole model (tp 1) at ``bytes_per_param``, if that is smaller."""
    model = spec.model
    if model.param_count is not None:
        if bytes_per_param >= model.weight_bytes_per_param:
            return None
        return model.param_count * bytes_per_param / GIB
    if spec.weights_gib is None or model.weight_bytes_per_param <= bytes_per_param:
        return None
    return spec.weights_gib * spec.tp * bytes_per_param / model.weight_bytes_per_param


def _smallest_tp(
    spec: CapacitySpec, need: int, weights_gib: float | None, *, include_current: bool = False
) -> tuple[int, CapacityEstimate] | None:
    """The smallest tensor-parallel size (beyond the spec's) at which ``need`` tokens fit.

    ``weights_gib``: per GPU at the spec's tp, when known (split evenly over more GPUs)."""
    sizes = [spec.tp] if include_current else []
    sizes += [t for t in _TP_SIZES if t > spec.tp]
    for tp in sizes:
        trial = replace(spec, tp=tp)
        if weights_gib is not None:
            trial = replace(trial, weights_gib=weights_gib * spec.tp / tp)
        alt = estimate(trial)
        if alt.max_model_len_fit >= need:
            return tp, alt
    return None
