"""One tuning round as data: what a node was, what each load step measured, when to stop.

Pure: no sockets, no clock, no files. ``gateway round`` (``round.py``) does the I/O and
feeds this module; ``gateway rounds`` reads the JSON it writes. A rounds file is
``{"rounds": [round, ...]}``; hand-made ones are read with :func:`rounds_from_json`,
whose errors name the JSON path (``rounds[1].steps[0].tokens_per_s: expected a number``).

Times are in the node's seconds: for a simulated node running ``time_scale`` times faster
than the hardware it models, wall-clock figures are multiplied by it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families

from kvgateway.capacity.logparse import LogFacts, non_default_args

GENERATION_TOKENS = "vllm:generation_tokens"
CACHE_INFO = "vllm:cache_config_info"
MAX_LADDER = 256
NOT_TUNING = frozenset(
    {"host", "port", "uds", "api_key", "served_model_name", "disable_uvicorn_access_log",
     "disable_log_stats", "enable_log_requests", "uvicorn_log_level", "ssl_keyfile",
     "ssl_certfile", "ssl_ca_certs", "allowed_origins", "root_path", "kv_events_config"}
)  # fmt: skip


class RoundsFileError(ValueError):
    """A rounds file is not what ``gateway round`` writes; the message names the path."""


@dataclass(frozen=True, slots=True)
class NodeLimits:
    model: str
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    kv_tokens: int  # usable: (num_gpu_blocks - 1) x block_size
    cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True, slots=True)
class LogSummary:
    """What the node's start-up log says about memory (GiB) and length."""

    kv_cache_memory_gib: float | None = None
    peak_memory_gib: float | None = None  # weights + activation peak + non-torch (+ graphs)
    estimated_max_model_len: int | None = None
    startup_failed: bool = False
    device: str | None = None  # "GPU", "CPU", ...: the KV cache size line's
    kv_memory_source: str | None = None  # "profiled" (GPU), "explicit" or "auto" (CPU)
    node_memory_gib: float | None = None  # CPU: the NUMA node's memory
    num_blocks_override: int | None = None  # the pool's blocks under --num-gpu-blocks-override
    profiled_num_blocks: int | None = None  # the blocks the KV memory holds


@dataclass(frozen=True, slots=True)
class StepResult:
    concurrency: int
    requests: int  # started during the step
    completed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens_per_s: float
    preemptions: int
    peak_kv_usage: float | None  # 0..1, highest sampled
    bad_requests: int = 0  # HTTP 400
    errors: int = 0  # other HTTP errors, broken streams
    timeouts: int = 0  # no token for --timeout seconds


@dataclass(frozen=True, slots=True)
class Round:
    name: str
    url: str
    started_at: str
    limits: NodeLimits
    # The vLLM settings known for this round: what the node reports (max_model_len,
    # kv_cache_dtype, gpu_memory_utilization) over the log's non-default args.
    flags: Mapping[str, Any]
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    steps: tuple[StepResult, ...]
    log: LogSummary | None = None
    stopped: str | None = None  # why the ladder ended early
    notes: tuple[str, ...] = field(default_factory=tuple)
    passed_flags: Mapping[str, Any] = field(default_factory=dict)  # the log's non-default args
    time_scale: float = 1.0  # > 1: a simulated node; times are the modelled hardware's

    def step_at(self, concurrency: int) -> StepResult | None:
        return next((s for s in self.steps if s.concurrency == concurrency), None)

    @property
    def first_preempting(self) -> int | None:
        return next((s.concurrency for s in self.steps if s.preemptions > 0), None)


# -- measuring --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def stop_reason(step: StepResult) -> str | None:
    """Why the ladder should not climb past ``step``, or None to go on."""
    c = step.concurrency
    if step.preemptions > 0:
        return f"the node preempted {step.preemptions} time(s) at {c} concurrent"
    if step.timeouts > 0:
        return f"{step.timeouts} request(s) timed out at {c} concurrent"
    if step.completed == 0 and step.bad_requests + step.errors > 0:
        return f"no request succeeded at {c} concurrent (400s or errors)"
    return None


def default_ladder(kv_tokens: int, per_request_tokens: int) -> tuple[int, ...]:
    """Powers of two up to the first at least twice what the KV pool holds at once."""
    fits = max(1, kv_tokens // max(1, per_request_tokens))
    ladder = [1]
    while ladder[-1] < min(2 * fits, MAX_LADDER):
        ladder.append(ladder[-1] * 2)
    return tuple(ladder)


def default_prompt_tokens(max_model_len: int) -> int:
    return max(16, min(2048, max_model_len // 8))


def default_output_tokens(max_model_len: int, prompt_tokens: int) -> int:
    return max(1, min(512, max_model_len - prompt_tokens))


def counter_total(metrics_text: str, family: str) -> float | None:
    """Sum of a counter family's ``_total`` samples over all engines; None if absent."""
    name = family + "_total"
    kept = "\n".join(line for line in metrics_text.splitlines() if line.startswith(name))
    if not kept:
        return None
    total = 0.0
    for fam in text_string_to_metric_families(kept + "\n"):
        total += sum(s.value for s in fam.samples if s.name == name)
    return total


def cache_labels(metrics_text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (the first engine's)."""
    kept = "\n".join(line for line in metrics_text.splitlines() if line.startswith(CACHE_INFO))
    for fam in text_string_to_metric_families(kept + "\n"):
        for s in fam.samples:
            return dict(s.labels)
    return {}


def flags_from_log(text: str) -> dict[str, Any]:
    """vLLM's ``non-default args: {...}`` start-up line (the last one), without the model.

    A value that is no literal (a ``KVEventsConfig(...)``, an enum) is kept as its text.
    """
    args = non_default_args(text)
    return {k: v for k, v in args.items() if k not in ("model", "model_tag")}


def log_summary(facts: LogFacts) -> LogSummary:
    peak = None
    if facts.weights_gib is not None and facts.activation_gib is not None:
        peak = (
            facts.weights_gib
            + facts.activation_gib
            + (facts.non_torch_gib or 0.0)
            + (facts.cuda_graph_gib or 0.0)
        )
    return LogSummary(
        kv_cache_memory_gib=facts.available_kv_gib,
        peak_memory_gib=None if peak is None else round(peak, 2),
        estimated_max_model_len=facts.estimated_max_model_len,
        startup_failed=facts.startup_failed,
        device=facts.kv_device,
        kv_memory_source=facts.kv_memory_source,
        node_memory_gib=facts.node_memory_gib,
        num_blocks_override=facts.num_blocks_override,
        profiled_num_blocks=facts.profiled_num_blocks,
    )


def describe_step(step: StepResult) -> str:
    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    usage = "-" if step.peak_kv_usage is None else f"{step.peak_kv_usage:.0%}"
    failed = step.bad_requests + step.errors + step.timeouts
    return (
        f"{step.concurrency:>4} concurrent: {step.requests} requests ({step.completed} done), "
        f"TTFT p50 {secs(step.ttft_p50_s)} p99 {secs(step.ttft_p99_s)}, "
        f"{step.tokens_per_s:,.0f} tok/s, {step.preemptions} preemptions, KV peak {usage}"
        + (f", {failed} failed" if failed else "")
    )


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def tuning_flags(r: Round) -> dict[str, Any]:
    """The round's flags but those that say where a node listens or what it logs: two
    nodes of one fleet differ in them (kv_events_config holds each node's event ports)."""
    return {k: v for k, v in r.flags.items() if k not in NOT_TUNING}


def changed_keys(before: Round, after: Round) -> list[str]:
    a, b = tuning_flags(before), tuning_flags(after)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def effective_flags(limits: NodeLimits, logged: dict[str, Any]) -> dict[str, Any]:
    """What the node says it runs with, over what its log says was passed."""
    flags = dict(logged)
    flags["max_model_len"] = limits.max_model_len
    if limits.cache_dtype is not None:
        flags["kv_cache_dtype"] = limits.cache_dtype
    if limits.gpu_memory_utilization is not None:
        flags["gpu_memory_utilization"] = limits.gpu_memory_utilization
    return flags


# -- the file ---------------------------------------------------------------------------


def rounds_to_json(rounds: Sequence[Round]) -> dict[str, Any]:
    return {
        "rounds": [
            asdict(r) | {"flags": dict(r.flags), "passed_flags": dict(r.passed_flags)}
            for r in rounds
        ]
    }


def rounds_from_json(data: Any) -> list[Round]:
    if not isinstance(data, Mapping) or not isinstance(data.get("rounds"), list):
        raise RoundsFileError('rounds: expected {"rounds": [...]}')
    return [_round(r, f"rounds[{i}]") for i, r in enumerate(data["rounds"])]


def _get(data: Mapping[str, Any], key: str, path: str, kind: str, *, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        article = "an" if kind == "int" else "a"
        raise RoundsFileError(f"{path}.{key}: expected {article} {kind}, got {value!r}")
    return float(cast(float, value)) if kind == "number" else value


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RoundsFileError(f"{path}: expected an object, got {value!r}")
    return value


def _round(value: Any, path: str) -> Round:
    data = _mapping(value, path)
    lim = _mapping(data.get("limits"), f"{path}.limits")
    lp = f"{path}.limits"
    limits = NodeLimits(
        model=_get(lim, "model", lp, "str"),
        max_model_len=_get(lim, "max_model_len", lp, "int"),
        num_gpu_blocks=_get(lim, "num_gpu_blocks", lp, "int"),
        block_size=_get(lim, "block_size", lp, "int"),
        kv_tokens=_get(lim, "kv_tokens", lp, "int"),
        cache_dtype=_get(lim, "cache_dtype", lp, "str", optional=True),
        gpu_memory_utilization=_get(lim, "gpu_memory_utilization", lp, "number", optional=True),
    )
    log = None
    if data.get("log") is not None:
        lg = _mapping(data["log"], f"{path}.log")
        gp = f"{path}.log"
        log = LogSummary(
            kv_cache_memory_gib=_get(lg, "kv_cache_memory_gib", gp, "number", optional=True),
            peak_memory_gib=_get(lg, "peak_memory_gib", gp, "number", optional=True),
            estimated_max_model_len=_get(lg, "estimated_max_model_len", gp, "int", optional=True),
            startup_failed=bool(lg.get("startup_failed", False)),
            device=_get(lg, "device", gp, "str", optional=True),
            kv_memory_source=_get(lg, "kv_memory_source", gp, "str", optional=True),
            node_memory_gib=_get(lg, "node_memory_gib", gp, "number", optional=True),
            num_blocks_override=_get(lg, "num_blocks_override", gp, "int", optional=True),
            profiled_num_blocks=_get(lg, "profiled_num_blocks", gp, "int", optional=True),
        )
    steps = data.get("steps")
    if not isinstance(steps, list):
        raise RoundsFileError(f"{path}.steps: expected a list")
    return Round(
        name=_get(data, "name", path, "str"),
        url=_get(data, "url", path, "str", optional=True) or "",
        started_at=_get(data, "started_at", path, "str", optional=True) or "",
        limits=limits,
        flags=dict(_mapping(data.get("flags") or {}, f"{path}.flags")),
        prompt_tokens=_get(data, "prompt_tokens", path, "int"),
        output_tokens=_get(data, "output_tokens", path, "int"),
        duration_s=_get(data, "duration_s", path, "number"),
        steps=tuple(_step(s, f"{path}.steps[{i}]") for i, s in enumerate(steps)),
        log=log,
        stopped=_get(data, "stopped", path, "str", optional=True),
        notes=tuple(str(n) for n in data.get("notes") or ()),
        passed_flags=dict(_mapping(data.get("passed_flags") or {}, f"{path}.passed_flags")),
        time_scale=_get(data, "time_scale", path, "number", optional=True) or 1.0,
    )


def _step(value: Any, path: str) -> StepResult:
    data = _mapping(value, path)
    usage = _get(data, "peak_kv_usage", path, "number", optional=True)
    return StepResult(
        concurrency=_get(data, "concurrency", path, "int"),
        requests=_get(data, "requests", path, "int"),
        completed=_get(data, "completed", path, "int"),
        ttft_p50_s=_get(data, "ttft_p50_s", path, "number", optional=True),
        ttft_p99_s=_get(data, "ttft_p99_s", path, "number", optional=True),
        tokens_per_s=_get(data, "tokens_per_s", path, "number"),
        preemptions=_get(data, "preemptions", path, "int"),
        peak_kv_usage=usage,
        bad_requests=_get(data, "bad_requests", path, "int", optional=True) or 0,
        errors=_get(data, "errors", path, "int", optional=True) or 0,
        timeouts=_get(data, "timeouts", path, "int", optional=True) or 0,
    )
