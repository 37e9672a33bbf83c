"""``parse_vllm_log(text)``: the KV-capacity facts a vLLM start-up log states.

Wordings recognised (any logger prefix: ``INFO 05-27 10:11:12 [kv_cache_utils.py:1087]``,
``(EngineCore_DP0 pid=1)``, ANSI colours, docker timestamps):

V1 engine (``vllm/v1``)
  ``Available KV cache memory: 19.25 GiB``                       (gpu_worker.py)
  ``reserved 8.0 GiB memory for KV Cache as specified by kv_cache_memory_bytes config``
  ``Explicitly set (1.0/8.71) GiB for KV cache on node 0.``      (cpu_worker.py: KV memory
  of the NUMA node's; ``Auto set (X/Y) GiB ...`` without --kv-cache-memory-bytes)
  ``GPU KV cache size: 157,648 tokens``                          (kv_cache_utils.py;
  thousands separators since 2025-02, PR #13596; newest releases append
  ``, Maximum concurrency for ...`` on the same line and name the device, ``CPU``,
  ``XPU``, ``GPU + host``; vLLM 0.32 logs ``int(max_concurrency x max_model_len)``)
  ``Maximum concurrency for 131,072 tokens per request: 1.20x``
  ``Overriding num_gpu_blocks=16384 with num_gpu_blocks_override=64`` (the pool is the
  override; the first figure is what the KV memory holds)
  ``kv cache group sizes (128, 128)`` (several KV-cache groups: one block size each)
  ``non-default args: {...}`` (the flags passed, a printed dict whose values may be
  config objects, ``KVEventsConfig(...)``, or enums, ``<CompilationMode.NONE: 0>``)
  ``# GPU blocks: 1381`` (early V1, before token counts were logged)
  ``To serve at least one request with the models's max seq len (N), (X GiB KV cache
  is needed, which is larger than the available KV cache memory (Y GiB). Based on the
  available memory, the estimated maximum model length is M.`` (the "models's" typo
  is vLLM's; older releases say "model's" and omit the parenthesis before X; from
  vLLM 0.32 M leaves the null block out)
  ``Initializing a V1 LLM engine (v0.11.1) with config: model='...', ...,
  max_seq_len=131072, ..., tensor_parallel_size=2, pipeline_parallel_size=1, ...,
  kv_cache_dtype=auto, device_config=cuda``, with ``speculative_config=SpeculativeConfig(
  method='eagle', model='...', num_spec_tokens=3)`` when a drafter is configured
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

import ast
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
    kv_device: str | None = None  # "GPU", "CPU", "XPU", "GPU + host"
    kv_memory_source: str | None = None  # "profiled" (GPU), "explicit" or "auto" (CPU)
    node_memory_gib: float | None = None  # CPU: the NUMA node's memory
    num_blocks_override: int | None = None  # --num-gpu-blocks-override: the pool's blocks
    profiled_num_blocks: int | None = None  # the blocks the KV memory would have held
    kv_group_block_sizes: tuple[int, ...] | None = None  # one per KV-cache group (hybrids)
    block_size: int | None = None  # --block-size as passed; None: the device's default
    max_num_seqs: int | None = None  # as passed

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) in (None, False) for f in fields(self))

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# (pattern, handler) pairs; a handler returns the fields a match sets.
_Handler = Callable[[re.Match[str], dict[str, object]], dict[str, object]]


def _kv_memory(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    """One worker's KV memory (a TP rank's, a NUMA node's): the smallest sizes the pool."""
    value = float(m.group(1))
    previous = seen.get("available_kv_gib")
    if isinstance(previous, float) and previous < value:
        return {}
    text = m.group(0)
    source = (
        "profiled" if text.startswith("Available") else "auto" if text[0] == "A" else "explicit"
    )
    found: dict[str, object] = {"available_kv_gib": value, "kv_memory_source": source}
    if m.lastindex == 2:  # CPU: "(KV/node) GiB"
        found["node_memory_gib"] = float(m.group(2))
    return found


# non-default args that size the pool, each setting the LogFacts field of its name.
_PASSED_INTS = ("block_size", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                "pipeline_parallel_size")  # fmt: skip


def _passed(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    args = _dict_items(m.group(1))[0]
    found: dict[str, object] = {k: v for k in _PASSED_INTS if type(v := args.get(k)) is int}
    if type(blocks := args.get("num_gpu_blocks_override")) is int:
        found["num_blocks_override"] = blocks
    if isinstance(util := args.get("gpu_memory_utilization"), int | float):
        found["gpu_memory_utilization"] = float(util)
    if isinstance(dtype := args.get("kv_cache_dtype"), str):
        found["kv_cache_dtype"] = dtype
    return found


def _override(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    blocks = int(m.group(2))
    return {"profiled_num_blocks": int(m.group(1)), "num_blocks_override": blocks,
            "num_gpu_blocks": blocks}  # fmt: skip


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
        ("kv_device", r"\bdevice_config=(\w+)", _device),
    ):
        hit = re.search(pattern, body)
        if hit:
            found[key] = convert(hit.group(1))
    if found.get("quantization") == "None":
        del found["quantization"]
    return found


def _device(name: str) -> str:
    """vLLM's own naming (kv_cache_utils._kv_cache_device_name): cuda is "GPU"."""
    return "GPU" if name.lower() == "cuda" else name.upper()


def _failure(m: re.Match[str], seen: dict[str, object]) -> dict[str, object]:
    found: dict[str, object] = {
        "startup_failed": True,
        "max_model_len": int(m.group(1)),
        "needed_kv_gib": float(m.group(2)),
    }
    if "available_kv_gib" not in seen:  # under an override: the override's blocks, not
        found["available_kv_gib"] = float(m.group(3))  # the worker's memory line before it
    if m.group(4):
        found["estimated_max_model_len"] = int(m.group(4))
    return found


_RULES: tuple[tuple[re.Pattern[str], _Handler], ...] = (
    (
        re.compile(r"Initializing an? (V1 )?LLM engine \(v([^)\s]+)\) with config: (.*)"),
        _engine_config,
    ),
    (re.compile(rf"Available KV cache memory:\s*{_NUM}\s*GiB"), _kv_memory),
    (re.compile(rf"reserved {_NUM} GiB memory for KV Cache as specified by kv_"), _kv_memory),
    (re.compile(rf"(?:Explicitly|Auto) set \({_NUM}/{_NUM}\) GiB for KV cache on"), _kv_memory),
    (
        # An open PR (#54840) may label the figure "(max_concurrency x max_model_len)".
        re.compile(rf"\b([A-Z]\w*(?: \+ host)?) KV cache size(?:\s*\([^)]*\))?:\s*{_INT}\s*tok"),
        lambda m, s: (
            {"kv_cache_tokens": _to_int(m.group(2)), "kv_device": m.group(1)}
            | {"engine": s.get("engine", "v1")}
        ),
    ),
    (re.compile(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)"), _override),
    (
        re.compile(r"kv cache group sizes \(([\d,\s]+)\)"),
        lambda m, s: {
            "kv_group_block_sizes": tuple(map(int, m.group(1).replace(",", " ").split()))
        },
    ),
    (re.compile(r"non-default args: (\{.*)"), _passed),
    (
        re.compile(rf"Maximum concurrency for\s*{_INT}\s*tokens per request:\s*{_NUM}\s*x"),
        lambda m, s: {"concurrency_len": _to_int(m.group(1)), "max_concurrency": float(m.group(2))},
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


_CLOSERS = {"(": ")", "[": "]", "{": "}", "<": ">"}
_KEY = re.compile(r"""\s*('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\s*:\s*(.*)""", re.S)


def _dict_items(text: str) -> tuple[dict[str, object], bool]:
    """A printed Python dict (``text`` starts at its ``{``), read item by item.

    Quotes and brackets are balanced, so a value holding commas (``KVEventsConfig(a=1,
    b='x,}')``, ``<CompilationMode.NONE: 0>``, a nested dict) stays one item. A value that
    is not a literal is kept as its text (a nested dict is read the same way). Returns the
    items and whether the dict was closed: a cut-off line keeps its whole items.
    """
    items: dict[str, object] = {}
    stack: list[str] = []
    quote, start, i = "", 1, 1
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{" or (ch == "<" and text[i + 1 : i + 2].isalpha()):
            stack.append(_CLOSERS[ch])
        elif stack:
            if ch == stack[-1]:
                stack.pop()
        elif ch in ",}":
            hit = _KEY.fullmatch(text[start:i])
            if hit:
                items[ast.literal_eval(hit.group(1))] = _arg_value(hit.group(2).strip())
            if ch == "}":
                return items, True
            start = i + 1
        i += 1
    return items, False


def _arg_value(text: str) -> object:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = None
    else:
        if _plain(value):
            return value
    if text.startswith("{"):
        nested, closed = _dict_items(text)
        if closed:
            return nested
    return text


def _plain(value: object) -> bool:
    """JSON's kinds of value, so a rounds file can hold what was passed."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, str | int | float | bool)


def non_default_args(text: str) -> dict[str, object]:
    """The flags of vLLM's last ``non-default args: {...}`` line; {} without one."""
    found: dict[str, object] = {}
    for raw in text.splitlines():
        at = raw.find("non-default args: {")
        if at >= 0:
            found = _dict_items(_ANSI.sub("", raw[at + len("non-default args: ") :]))[0]
    return found


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
