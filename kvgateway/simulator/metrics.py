"""vLLM's /metrics families for a simulated node, on a per-node registry.

Names, help texts, types, label names and buckets are vLLM's own (``vllm/v1/metrics/
loggers.py``; compare ``tests/data/vllm_metrics_sample.txt``). Only the families a
gateway reads are exposed. Gauges are set from the engine state at scrape time, so they
cost nothing per step; counters and histograms are fed by the engine driver.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvgateway.capacity.layout import KVGroup, KVLayout, blocks_per_request
from kvgateway.simulator.engine import EngineCore, Sequence
from kvgateway.simulator.settings import NodeSettings

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def cache_config_labels(s: NodeSettings) -> dict[str, str]:
    """vLLM 0.32's CacheConfig as label strings (``CacheConfig.metrics_info``), as a GPU
    node started without ``--num-gpu-blocks-override`` and ``--kv-cache-memory`` shows
    them. ``kv_cache_size_tokens`` is the context tokens the pool holds at full-length
    concurrency, ``kv_cache_max_concurrency`` that concurrency (``get_kv_cache_capacity``:
    every block, the null block included, over the blocks one max_model_len request
    takes in all its KV-cache groups)."""
    layout = KVLayout(0, 1, tuple(KVGroup(1, w) for w in s.kv_windows))
    per_request = blocks_per_request(
        layout, s.max_model_len, s.block_size, s.max_num_batched_tokens
    )
    concurrency = s.num_gpu_blocks / per_request
    return {
        "_block_size_resolved": "True",
        "block_size": str(s.block_size),
        "cache_dtype": s.cache_dtype,
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(s.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(s.enable_prefix_caching),
        "gpu_memory_utilization": str(s.gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(concurrency),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(int(concurrency * s.max_model_len)),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(s.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": str(s.sliding_window) if s.num_sliding_window_groups else "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }


class NodeMetrics:
    def __init__(self, settings: NodeSettings, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        names = ["model_name", "engine"]
        values = (settings.model, settings.engine_label)

        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            names,
            registry=reg,
        ).labels(*values)
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            names,
            registry=reg,
        ).labels(*values)
        if settings.legacy_metric_names:
            usage_name, usage_help = (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
            )
        else:
            usage_name, usage_help = (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            )
        self._usage = Gauge(usage_name, usage_help, names, registry=reg).labels(*values)
        self._preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            names,
            registry=reg,
        ).labels(*values)
        # Fed from the engine's PrefixCacheStats at scrape time (preempted requests'
        # lookups are kept apart, as in vLLM).
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            names,
            registry=reg,
        ).labels(*values)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            names,
            registry=reg,
        ).labels(*values)
        self._seen_queries = 0
        self._seen_hits = 0
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=reg
        ).labels(*values)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            names,
            registry=reg,
        ).labels(*values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self._success = {r: success.labels(*values, r) for r in FINISHED_REASONS}
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(*values)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(*values)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(*values)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            names,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(*values)
        info_labels = {**cache_config_labels(settings), "engine": settings.engine_label}
        info_names = sorted(info_labels)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            info_names,
            registry=reg,
        ).labels(*(info_labels[n] for n in info_names)).set(1)

    # -- fed by the driver ---------------------------------------------------------

    def record_step(
        self,
        *,
        preemptions: int,
        prompt_tokens: int,
        generation_tokens: int,
        ttfts: Iterable[float],
        itls: Iterable[float],
    ) -> None:
        if preemptions:
            self._preemptions.inc(preemptions)
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self._generation_tokens.inc(generation_tokens)
        for value in ttfts:
            self._ttft.observe(value)
        observe_itl = self._itl.observe
        for value in itls:
            observe_itl(value)

    def record_finished(self, seq: Sequence) -> None:
        reason = seq.finish_reason or "error"
        self._success[reason if reason in self._success else "error"].inc()
        if reason == "abort" or seq.finished_at is None:
            return
        self._e2e.observe(seq.finished_at - seq.arrival)
        if seq.scheduled_at is not None:
            self._queue.observe(seq.scheduled_at - seq.arrival)

    # -- scraped -------------------------------------------------------------------

    def render(self, core: EngineCore) -> bytes:
        self._running.set(len(core.running))
        self._waiting.set(len(core.waiting))
        self._usage.set(core.usage)
        stats = core.kv.stats
        if stats.queries > self._seen_queries:
            self._prefix_queries.inc(stats.queries - self._seen_queries)
            self._seen_queries = stats.queries
        if stats.hits > self._seen_hits:
            self._prefix_hits.inc(stats.hits - self._seen_hits)
            self._seen_hits = stats.hits
        return generate_latest(self.registry)
