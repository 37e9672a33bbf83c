"""``parse_vllm_log(text)``: the KV-capacity facts a vLLM start-up log states.

Wordings recognised (any logger prefix: ``INFO 05-27 10:11:12 [kv_cache_utils.py:1087]``,
``(EngineCore_DP0 pid=1)``, ANSI colours, docker timestamps):

V1 engine (``vllm/v1``)
  ``Available KV cache memory: 19.25 GiB``                       (gpu_worker.py)
  ``GPU KV cache size: 157,648 tokens``                          (kv_cache_utils.py;
  thousands separators since 2025-02, PR #13596; newest releases append
  ``, Maximum concurrency for ...`` on the same line)
  ``Maximum concurrency for 131,072 tokens per request: 1.20x``
  ``# GPU blocks: 1381`` (early V1, before token counts were logged)
  ``To serve at least one request with the models's max seq len (N), (X GiB KV cache
  is needed, which is larger than the available KV cache memory (Y GiB). Based on the
  available memory, the estimated maximum model length is M.`` (the "models's" typo
  is vLLM's; older releases say "model's" and omit the parenthesis before X)
  ``Initializing a V1 LLM engine (v0.11.1) with config: model='...', ...,
  max_seq_len=131072, ..., tensor_parallel_size=2, pipeline_parallel_size=1, ...,
  kv_cache_dtype=auto``, with ``speculative_config=SpeculativeConfig(method='eagle',
  model='...', num_spec_tokens=3)`` when a drafter is configured (``SpeculativeConfig``'s
  ``__repr__``)
V0 engine
  ``# GPU blocks: 1952, # CPU blocks: 2048`` (also lower-case ``# cpu blocks``)
  ``Maximum concurrency for 20000 tokens per request: 1.56x``
  ``The model's max seq len (29000) is larger than the maximum number of tokens that
  can be stored in KV cache (23648).``
  ``Memory profiling results: ... kv_cache_size=3.81GiB gpu_memory_utilization=0.90``
  ``non_torch_memory takes 0.31GiB`` (also ``Total non-torch memory: 0.31GiB``)

Several TP ranks each log their own ``Available KV cache memory``; vLLM sizes the
pool from the smallest, so the smallest is kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FLOAT = r"-?\d+(?:\.\d+)?"
_NUM = rf"({_FLOAT})"
_INT = r"(\d[\d,]*)"


def _to_int(text: str) -> int:
    return int(text.replace(",", ""))


@dataclass(frozen=True, slots=True)
class LogFacts:
    """Everything is optional: a log excerpt may hold any subset of the lines."""

    vllm_version: str | None = None
    engine: str | None = None  # "v1" or "v0"
    model: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    speculative_method: str | None = None  # from speculative_config=SpeculativeConfig(...)
    num_speculative_tokens: int | None = None
    kv_cache_dtype: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    available_kv_gib: float | None = None
    kv_cache_tokens: int | None = None  # as logged: includes the reserved null block
    concurrency_len: int | None = None
    max_concurrency: float | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    weights_gib: float | None = None
    total_gpu_gib: float | None = None
    gpu_memory_utilization: float | None = None
    activation_gib: float | None = None
    cuda_graph_gib: float | None = None
    non_torch_gib: float | None = None
    padding_layers: int | None = None
    needed_kv_gib: float | None = None  # start-up failure: KV needed for max_model_len
    estimated_max_model_len: int | None = None  # vLLM's suggestion in that failure
    v0_kv_token_capacity: int | None = None  # V0 "maximum number of tokens ... (M)"
    startup_failed: bool = False

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) in (None, False) for f in fields(self))

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# (pattern, handler) pairs; a handler returns the fields a match sets.
_Handler = Callable[[re.Match[str], dict[str, object]], dict[str, object]]


def _available(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    value = float(m.group(1))
    previous = seen.get("available_kv_gib")
    if isinstance(previous, float) and previous < value:
        return {}
    return {"available_kv_gib": value}


def _engine_config(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    found: dict[str, object] = {"engine": "v1" if m.group(1) else "v0", "vllm_version": m.group(2)}
    body = m.group(3)
    for key, pattern, convert in (
        ("model", r"\bmodel='([^']*)'", str),
        ("max_model_len", r"\bmax_seq_len=(\d+)", int),
        ("tensor_parallel_size", r"\btensor_parallel_size=(\d+)", int),
        ("pipeline_parallel_size", r"\bpipeline_parallel_size=(\d+)", int),
        ("speculative_method", r"\bspeculative_config=SpeculativeConfig\(method='(\w+)'", str),
        ("num_speculative_tokens", r"SpeculativeConfig\([^)]*\bnum_spec_tokens=(\d+)", int),
        ("kv_cache_dtype", r"\bkv_cache_dtype=([\w.]+)", str),
        ("dtype", r"\bdtype=(?:torch\.)?(\w+)", str),
        ("quantization", r"\bquantization=(\w+)", str),
    ):
        hit = re.search(pattern, body)
        if hit:
            found[key] = convert(hit.group(1))
    if found.get("quantization") == "None":
        del found["quantization"]
    return found


def _failure(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    found: dict[str, object] = {
        "startup_failed": True,
        "max_model_len": int(m.group(1)),
        "needed_kv_gib": float(m.group(2)),
        "available_kv_gib": float(m.group(3)),
    }
    if m.group(4):
        found["estimated_max_model_len"] = int(m.group(4))
    return found


_RULES: tuple[tuple[re.Pattern[str], _Handler], ...] = (
    (
        re.compile(r"Initializing an? (V1 )?LLM engine \(v([^)\s]+)\) with config: (.*)"),
        _engine_config,
    ),
    (re.compile(rf"Available KV cache memory:\s*{_NUM}\s*GiB"), _available),
    (
        # An open PR (#54840) may label the figure "(max_concurrency x max_model_len)".
        re.compile(rf"GPU KV cache size(?:\s*\([^)]*\))?:\s*{_INT}\s*tokens"),
        lambda m, s: {"kv_cache_tokens": _to_int(m.group(1)), "engine": s.get("engine", "v1")},
    ),
    (
        re.compile(rf"Maximum concurrency for\s*{_INT}\s*tokens per request:\s*{_NUM}\s*x"),
        lambda m, s: {
            "concurrency_len": _to_int(m.group(1)),
            "max_concurrency": float(m.group(2)),
        },
    ),
    (
        re.compile(rf"#?\s*GPU blocks:\s*{_INT}(?:,\s*#?\s*CPU blocks:\s*{_INT})?", re.I),
        lambda m, s: {
            "num_gpu_blocks": _to_int(m.group(1)),
            **({"num_cpu_blocks": _to_int(m.group(2))} if m.group(2) else {}),
        },
    ),
    (
        re.compile(rf"#\s*cpu blocks:\s*{_INT}", re.I),
        lambda m, s: {"num_cpu_blocks": _to_int(m.group(1))},
    ),
    (
        re.compile(rf"num_gpu_blocks is:\s*{_INT}"),
        lambda m, s: {"num_gpu_blocks": _to_int(m.group(1))},
    ),
    (
        re.compile(
            r"To serve at least one request with the models?'s max seq len \((\d+)\),\s*"
            rf"\(?\s*{_NUM}\s*GiB KV cache is needed, which is larger than the available "
            rf"KV cache memory \({_NUM}\s*GiB\)\.(?:\s*Based on the available memory,\s*"
            r"the estimated maximum model length is (\d+)\.)?"
        ),
        _failure,
    ),
    (
        re.compile(
            r"max seq len \((\d+)\) is larger than the maximum number of tokens that can be "
            r"stored in KV cache \((\d+)\)"
        ),
        lambda m, s: {
            "startup_failed": True,
            "engine": "v0",
            "max_model_len": int(m.group(1)),
            "v0_kv_token_capacity": int(m.group(2)),
        },
    ),
    (
        re.compile(
            rf"(?:Model loading took|Loading model weights took|model weights take|"
            rf"weights memory:)\s*{_NUM}\s*Gi?B"
        ),
        lambda m, s: {"weights_gib": float(m.group(1))},
    ),
    (
        re.compile(rf"Free memory on device \({_NUM}/{_NUM} GiB\)"),
        lambda m, s: {"total_gpu_gib": float(m.group(2))},
    ),
    (
        re.compile(rf"total_gpu_memory(?:=| \(){_NUM}\s*GiB"),
        lambda m, s: {"total_gpu_gib": float(m.group(1))},
    ),
    (
        re.compile(
            r"(?:Desired GPU memory utilization is \(|gpu_memory_utilization(?:=| \())"
            rf"{_NUM}"
        ),
        lambda m, s: {"gpu_memory_utilization": float(m.group(1))},
    ),
    (
        re.compile(
            rf"(?:{_NUM}\s*GiB for peak activation|PyTorch activation peak memory takes "
            rf"{_NUM}\s*GiB|torch peak memory increase:\s*{_NUM}\s*GiB)"
        ),
        lambda m, s: {"activation_gib": float(next(g for g in m.groups() if g is not None))},
    ),
    (
        re.compile(
            rf"(?:{_NUM}\s*GiB for CUDAGraph memory|Estimated CUDA graph memory:\s*{_NUM}\s*GiB"
            rf"|Graph capturing finished in \d+ secs?, took\s*{_NUM}\s*GiB)"
        ),
        lambda m, s: {"cuda_graph_gib": float(next(g for g in m.groups() if g is not None))},
    ),
    (
        re.compile(rf"(?:non_torch_memory takes|Total non-torch memory:)\s*{_NUM}\s*GiB"),
        lambda m, s: {"non_torch_gib": float(m.group(1))},
    ),
    (
        re.compile(rf"(?:kv_cache_size=|reserved for KV Cache is\s*){_NUM}\s*GiB"),
        lambda m, s: {"available_kv_gib": float(m.group(1)), "engine": "v0"},
    ),
    (
        re.compile(r"Add (\d+) padding layers"),
        lambda m, s: {"padding_layers": int(m.group(1))},
    ),
    (
        re.compile(r"Auto-fit max_model_len: reduced from \d+ to (\d+)"),
        lambda m, s: {"max_model_len": int(m.group(1))},
    ),
)


def parse_vllm_log(text: str) -> LogFacts:
    """Scan every line; later lines win, except the pool size (smallest rank wins)."""
    seen: dict[str, object] = {}
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        for pattern, handler in _RULES:
            for match in pattern.finditer(line):
                seen.update(handler(match, seen))
    if "max_model_len" not in seen and isinstance(seen.get("concurrency_len"), int):
        seen["max_model_len"] = seen["concurrency_len"]
    return LogFacts(**seen)  # type: ignore[arg-type]
