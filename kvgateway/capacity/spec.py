"""``CapacitySpec``: one node's capacity inputs, parsed once from a YAML mapping.

A backend's ``capacity:`` block in the gateway YAML looks like::

    capacity:
      gpu_memory_gib: 24            # per GPU, as torch reports it (an "80 GB" H100: 79.25)
      preset: llama-3.1-8b          # or model_config: path/to/config.json (or an inline mapping)
      tp: 1
      pp: 1                         # pipeline stages (alias pipeline_parallel_size)
      kv_cache_dtype: auto          # auto | bfloat16 | float16 | float32 | fp8 | fp8_e4m3 | ...
      gpu_memory_utilization: 0.92
      # optional: block_size (16), kv_cache_memory_gib (the log's "Available KV cache
      # memory", replaces the estimate), weights_gib, overhead_gib (activation +
      # non-torch + CUDA graphs), max_model_len, max_num_seqs, max_num_batched_tokens
      speculative:                  # optional: the drafter shares the KV pool
        method: eagle               # eagle | eagle3 | mtp | draft_model | ngram
        num_speculative_tokens: 3
        # optional: draft_layers, draft_model_config (or draft_preset), draft_weights_gib

Every error is a :class:`CapacityConfigError` naming the YAML path of the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgateway.capacity.arch import (
    KV_CACHE_DTYPES,
    KV_DTYPE_ALIASES,
    ModelArch,
    kv_bytes_per_token_per_layer,
)
from kvgateway.capacity.errors import CapacityConfigError, show
from kvgateway.capacity.hf_config import arch_from_hf_config
from kvgateway.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from kvgateway.capacity.presets import preset_arch
from kvgateway.capacity.speculative import SpeculativeSpec, parse_speculative

_KEYS = (
    "gpu_memory_gib", "gpu_memory_utilization", "preset", "model_config", "tp",
    "tensor_parallel_size", "kv_cache_dtype", "block_size", "kv_cache_memory_gib",
    "weights_gib", "overhead_gib", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "pp", "pipeline_parallel_size", "speculative",
)  # fmt: skip
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class CapacitySpec:
    """Per-GPU figures; ``tp`` x ``pp`` GPUs serve one model replica."""

    model: ModelArch
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tp: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_gib: float | None = None
    weights_gib: float | None = None
    overhead_gib: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    pp: int = 1
    speculative: SpeculativeSpec | None = None

    @classmethod
    def from_mapping(
        cls,
        data: Mapping[str, Any],
        path: str,
        *,
        base_dir: Path | None = None,
        read_text: Callable[[Path], str] | None = None,
    ) -> CapacitySpec:
        """Parse a ``capacity:`` mapping; ``path`` is its YAML path for error messages.

        A relative ``model_config`` path is resolved against ``base_dir`` (the YAML
        file's directory) and read with ``read_text`` (injectable for tests).
        """
        if not isinstance(data, Mapping):
            raise CapacityConfigError(path, f"expected a mapping, got {show(data)}")
        try:
            return _parse(data, base_dir, read_text or _read_text)
        except CapacityConfigError as exc:
            raise exc.under(path) from None


def _read_text(file: Path) -> str:
    return file.read_text(encoding="utf-8")


def _positive_int(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CapacityConfigError(key, f"expected a positive integer, got {show(value)}")
    return value


def _positive_float(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CapacityConfigError(key, f"expected a positive number, got {show(value)}")
    if not math.isfinite(value) or value <= 0 or value > _LARGEST:
        raise CapacityConfigError(
            key, f"expected a positive number of at most {_LARGEST:,}, got {show(value)}"
        )
    return float(value)


# No memory size, ratio or count in a capacity block comes near this (GiB: a pebibyte).
_LARGEST = 1 << 20


def _non_negative_float(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value == 0 and not isinstance(value, bool):
        return 0.0
    return _positive_float(data, key)


def _model(
    data: Mapping[str, Any], base_dir: Path | None, read_text: Callable[[Path], str]
) -> ModelArch:
    preset, config = data.get("preset"), data.get("model_config")
    if preset is not None and config is not None:
        raise CapacityConfigError("preset", "give either preset or model_config, not both")
    if preset is not None:
        if not isinstance(preset, str) or not preset.strip():
            raise CapacityConfigError("preset", f"expected a preset name, got {show(preset)}")
        return preset_arch(preset)
    if config is None:
        raise CapacityConfigError(
            "preset", "missing: give preset (a built-in model) or model_config (a config.json)"
        )
    if isinstance(config, Mapping):
        try:
            return arch_from_hf_config(config, name="inline model_config")
        except CapacityConfigError as exc:
            raise exc.under("model_config") from None
    if not isinstance(config, str) or not config.strip():
        raise CapacityConfigError(
            "model_config", f"expected a path to config.json or a mapping, got {show(config)}"
        )
    file = Path(config).expanduser()
    if base_dir is not None and not file.is_absolute():
        file = base_dir / file
    if file.is_dir():
        file = file / "config.json"
    try:
        decoded = json.loads(read_text(file))
    except OSError as exc:
        raise CapacityConfigError(
            "model_config", f"cannot read {str(file)!r}: {exc.strerror or exc}"
        ) from None
    except json.JSONDecodeError as exc:
        raise CapacityConfigError(
            "model_config", f"{str(file)!r} is not valid JSON: {exc}"
        ) from None
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    try:
        return arch_from_hf_config(decoded, name=name)
    except CapacityConfigError as exc:
        raise CapacityConfigError(f"model_config ({file.name}: {exc.path})", exc.detail) from None


def _parse(
    data: Mapping[str, Any], base_dir: Path | None, read_text: Callable[[Path], str]
) -> CapacitySpec:
    for key in data:
        if key not in _KEYS:
            raise CapacityConfigError(str(key), f"unknown key; expected one of {', '.join(_KEYS)}")
    if "tp" in data and "tensor_parallel_size" in data:
        raise CapacityConfigError("tp", "give tp or tensor_parallel_size, not both")
    tp_key = "tensor_parallel_size" if "tensor_parallel_size" in data else "tp"
    tp = _positive_int(data, tp_key) or 1
    if "pp" in data and "pipeline_parallel_size" in data:
        raise CapacityConfigError("pp", "give pp or pipeline_parallel_size, not both")
    pp_key = "pipeline_parallel_size" if "pipeline_parallel_size" in data else "pp"
    pp = _positive_int(data, pp_key) or 1
    utilization = _positive_float(data, "gpu_memory_utilization")
    if utilization is not None and utilization > 1:
        raise CapacityConfigError(
            "gpu_memory_utilization", f"expected a fraction in (0, 1], got {show(utilization)}"
        )
    raw_dtype = data.get("kv_cache_dtype", "auto")
    kv_dtype = raw_dtype.lower() if isinstance(raw_dtype, str) else ""
    kv_dtype = KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    if kv_dtype not in KV_CACHE_DTYPES:
        raise CapacityConfigError(
            "kv_cache_dtype",
            f"expected one of {', '.join(KV_CACHE_DTYPES)}, got {show(raw_dtype)}",
        )
    block_size = _positive_int(data, "block_size") or 16
    if block_size not in _BLOCK_SIZES and block_size % 16:
        raise CapacityConfigError(
            "block_size", f"expected 1, 8 or a multiple of 16, got {show(block_size)}"
        )
    gpu_gib = _positive_float(data, "gpu_memory_gib")
    kv_gib = _positive_float(data, "kv_cache_memory_gib")
    if gpu_gib is None and kv_gib is None:
        raise CapacityConfigError(
            "gpu_memory_gib",
            "missing: give gpu_memory_gib (per GPU) or kv_cache_memory_gib (the KV memory "
            "vLLM logged as 'Available KV cache memory')",
        )
    model = _model(data, base_dir, read_text)
    speculative = _speculative(data.get("speculative"), base_dir, read_text)
    spec = CapacitySpec(
        model=model,
        gpu_memory_gib=gpu_gib,
        gpu_memory_utilization=utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        tp=tp,
        kv_cache_dtype=kv_dtype,
        block_size=block_size,
        kv_cache_memory_gib=kv_gib,
        weights_gib=_non_negative_float(data, "weights_gib"),
        overhead_gib=_non_negative_float(data, "overhead_gib"),
        max_model_len=_positive_int(data, "max_model_len"),
        max_num_seqs=_positive_int(data, "max_num_seqs"),
        max_num_batched_tokens=_positive_int(data, "max_num_batched_tokens"),
        pp=pp,
        speculative=speculative,
    )
    validate(spec)
    return spec


def _speculative(
    data: Any, base_dir: Path | None, read_text: Callable[[Path], str]
) -> SpeculativeSpec | None:
    if data is None:
        return None
    try:
        draft = None
        if isinstance(data, Mapping) and (
            data.get("draft_model_config") is not None or data.get("draft_preset") is not None
        ):
            sub = {
                "model_config": data.get("draft_model_config"),
                "preset": data.get("draft_preset"),
            }
            try:
                draft = _model(sub, base_dir, read_text)
            except CapacityConfigError as exc:
                if exc.path.startswith("preset"):
                    raise CapacityConfigError("draft_preset", exc.detail) from None
                raise CapacityConfigError(f"draft_{exc.path}", exc.detail) from None
        return parse_speculative(data, draft)
    except CapacityConfigError as exc:
        raise exc.under("speculative") from None


def validate(spec: CapacitySpec) -> None:
    """Cross-field checks shared by the YAML parser and the CLI."""
    kv_bytes_per_token_per_layer(spec.model, spec.tp, spec.kv_cache_dtype)
    if spec.pp > spec.model.num_layers:
        raise CapacityConfigError(
            "pp",
            f"{spec.pp} pipeline stages for {spec.model.num_layers} layers: a stage "
            "would hold no layer",
        )
    needs_weights = spec.kv_cache_memory_gib is None and spec.weights_gib is None
    if needs_weights and spec.model.param_count is None:
        raise CapacityConfigError(
            "weights_gib",
            f"missing: cannot size the weights of {spec.model.name} from its config; "
            "give weights_gib (the log's 'Model loading took X GiB') or kv_cache_memory_gib",
        )
