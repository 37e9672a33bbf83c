"""The pure parts of a round: percentiles, ladders, stop rules, log and metrics parsing."""

from __future__ import annotations

from pathlib import Path

from kvgateway.commands.roundstats import (
    StepResult,
    cache_labels,
    counter_total,
    default_ladder,
    flags_from_log,
    percentile,
    stop_reason,
)

SAMPLE = Path(__file__).parents[2] / "data" / "vllm_metrics_sample.txt"


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    assert percentile([2.0, 1.0], 50) == 1.0


def test_default_ladder_goes_past_what_the_kv_cache_holds() -> None:
    # 38,224 tokens hold 14 requests of 2,560: climb to 32 (the first >= 28).
    assert default_ladder(38_224, 2_560) == (1, 2, 4, 8, 16, 32)
    assert default_ladder(1_000, 5_000) == (1, 2)
    assert default_ladder(10**9, 10)[-1] == 256


def _step(**kw: int) -> StepResult:
    base = {"concurrency": 8, "requests": 10, "completed": 8, "preemptions": 0}
    return StepResult(**{**base, **kw}, ttft_p50_s=1.0, ttft_p99_s=2.0, tokens_per_s=9.0,
                      peak_kv_usage=0.5)  # fmt: skip


def test_stop_rules() -> None:
    assert stop_reason(_step()) is None
    assert stop_reason(_step(preemptions=3)) == "the node preempted 3 time(s) at 8 concurrent"
    assert stop_reason(_step(timeouts=1)) == "1 request(s) timed out at 8 concurrent"
    assert stop_reason(_step(completed=0, bad_requests=10)) is not None
    assert stop_reason(_step(bad_requests=2)) is None  # some 400s among successes


def test_flags_from_the_non_default_args_line() -> None:
    log = (
        "INFO 05-27 10:11:12 [utils.py:326] non-default args: {'model_tag': 'Qwen/Qwen3-8B', "
        "'model': 'Qwen/Qwen3-8B', 'max_model_len': 26624, 'max_num_seqs': 14, "
        "'gpu_memory_utilization': 0.94}\nother line\n"
    )
    assert flags_from_log(log) == {
        "max_model_len": 26624,
        "max_num_seqs": 14,
        "gpu_memory_utilization": 0.94,
    }
    assert flags_from_log("non-default args: {broken") == {}


def test_flags_beside_config_objects_and_enums_are_kept() -> None:
    # vLLM prints the dict with str(): config objects by their repr, enums as <...>.
    log = (
        "(APIServer pid=7076) INFO 12-02 16:14:09 [api_utils.py:286] non-default args: "
        "{'host': '127.0.0.1', 'model': '/m', 'max_model_len': 4096, 'enforce_eager': True, "
        "'num_gpu_blocks_override': 48, 'kv_events_config': KVEventsConfig("
        "enable_kv_cache_events=True, publisher='zmq', endpoint='tcp://*:42979', "
        "replay_endpoint=None, topic='a,}'), 'compilation_config': {'mode': "
        "<CompilationMode.NONE: 0>, 'backend': 'inductor'}, 'max_num_seqs': 16}"
    )
    flags = flags_from_log(log)
    assert flags["max_model_len"] == 4096 and flags["max_num_seqs"] == 16
    assert flags["num_gpu_blocks_override"] == 48 and flags["enforce_eager"] is True
    assert flags["kv_events_config"] == (
        "KVEventsConfig(enable_kv_cache_events=True, publisher='zmq', "
        "endpoint='tcp://*:42979', replay_endpoint=None, topic='a,}')"
    )
    assert flags["compilation_config"] == {
        "mode": "<CompilationMode.NONE: 0>",
        "backend": "inductor",
    }
    # A line cut short keeps its whole items.
    assert flags_from_log(log[: log.index("'compilation_config'") + 5]) == {
        "host": "127.0.0.1",
        "max_model_len": 4096,
        "enforce_eager": True,
        "num_gpu_blocks_override": 48,
        "kv_events_config": flags["kv_events_config"],
    }


def test_metrics_counters_and_cache_labels_from_vllms_page() -> None:
    text = SAMPLE.read_text()
    assert counter_total(text, "vllm:generation_tokens") is not None
    assert counter_total(text, "vllm:no_such_thing") is None
    labels = cache_labels(text)
    assert labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0
