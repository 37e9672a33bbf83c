"""Simulated nodes sized from a preset, a GPU and vLLM's flags, with the planner's maths."""

from __future__ import annotations

import pytest

from kvgateway.capacity.advice import make_plan
from kvgateway.capacity.logparse import parse_vllm_log
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.cli import build_parser
from kvgateway.simulator.cli import build_specs
from kvgateway.simulator.settings import SettingsError
from kvgateway.simulator.sizing import ServeFlags, StartupError, size_node


def plan_tokens(**extra: object) -> int:
    spec = CapacitySpec.from_mapping({"preset": "qwen3-8b", "gpu_memory_gib": 24, **extra}, "")
    return make_plan(spec).estimate.kv_cache_tokens


def test_the_24_gib_qwen3_node_has_the_planners_kv_tokens() -> None:
    node = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624))
    s = node.settings
    assert s.kv_tokens == plan_tokens(max_model_len=26624) == 38_224
    assert (s.num_gpu_blocks, s.block_size, s.max_model_len) == (2390, 16, 26624)
    assert s.max_num_seqs == 256 and s.max_num_batched_tokens == 2048
    assert s.model == "Qwen/Qwen3-8B" and s.cache_dtype == "auto"
    # Decode reads 15.26 GiB of weights at 1 TB/s; KV 147,456 B per context token.
    assert s.weight_read_s == pytest.approx(0.01638, rel=1e-3)
    assert s.kv_read_s_per_token == pytest.approx(147_456 / 1e12)


@pytest.mark.parametrize(
    ("flags", "plan_extra"),
    [
        (ServeFlags(max_model_len=26624, kv_cache_dtype="fp8"), {"kv_cache_dtype": "fp8"}),
        (ServeFlags(max_model_len=26624, gpu_memory_utilization=0.94),
         {"gpu_memory_utilization": 0.94}),
        (ServeFlags(max_model_len=26624, max_num_seqs=12), {"max_num_seqs": 12}),
        (ServeFlags(max_model_len=26624, max_num_batched_tokens=1024),
         {"max_num_batched_tokens": 1024}),
    ],
)  # fmt: skip
def test_each_flag_resizes_the_pool_like_the_planner(
    flags: ServeFlags, plan_extra: dict[str, object]
) -> None:
    node = size_node("qwen3-8b", 24, flags)
    assert node.settings.kv_tokens == plan_tokens(max_model_len=26624, **plan_extra)
    assert node.settings.kv_tokens != 38_224


def test_fp8_halves_the_kv_bytes_read_per_token() -> None:
    bf16 = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624)).settings
    fp8 = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624, kv_cache_dtype="fp8"))
    assert fp8.settings.kv_read_s_per_token == pytest.approx(bf16.kv_read_s_per_token / 2)
    assert fp8.settings.cache_dtype == "fp8"


def test_cpu_offload_frees_gpu_memory_and_costs_pcie_time() -> None:
    base = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624)).settings
    off = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624, cpu_offload_gb=4)).settings
    # 4 GiB more pool at 147,456 B per token, in blocks of 16.
    assert off.kv_tokens - base.kv_tokens == pytest.approx(4 * 2**30 / 147_456, abs=16)
    assert off.offload_s == pytest.approx(4 * 2**30 / 34e9)
    assert off.weight_read_s < base.weight_read_s


def test_refuses_to_start_like_vllm_and_logs_why() -> None:
    with pytest.raises(StartupError) as info:
        size_node("qwen3-8b", 24, ServeFlags())  # the model's 40,960 does not fit
    assert "estimated maximum model length is 38224" in str(info.value)
    facts = parse_vllm_log("\n".join(info.value.log))
    assert facts.startup_failed and facts.estimated_max_model_len == 38224
    assert facts.max_model_len == 40960 and facts.needed_kv_gib == 5.62


def test_a_sliding_window_models_refusal_states_what_vllm_would_need() -> None:
    """vLLM sizes one full-length request by its groups (a sliding-window group capped by
    its window): 3.05 GiB for gpt-oss-20b at 131,072 tokens, not the 6.00 GiB that counting
    every group as full attention gives (and `plan --from-log` would read as the need)."""
    with pytest.raises(StartupError) as info:
        size_node(
            "gpt-oss-20b", 24.0, ServeFlags(gpu_memory_utilization=0.70, max_model_len=131072)
        )
    facts = parse_vllm_log("\n".join(info.value.log))
    assert facts.needed_kv_gib == 3.05, str(info.value)


def test_a_gpu_too_small_for_the_weights_has_no_memory_for_blocks() -> None:
    with pytest.raises(StartupError) as info:
        size_node("qwen3-8b", 16, ServeFlags(max_model_len=4096))
    assert str(info.value).startswith("No available memory for the cache blocks.")
    assert info.value.log[-1].startswith("ERROR [core.py] ValueError: No available memory")


def test_startup_log_parses_to_the_pool() -> None:
    node = size_node("qwen3-8b", 24, ServeFlags(max_model_len=26624, max_num_seqs=12))
    facts = parse_vllm_log("\n".join(node.log))
    assert facts.available_kv_gib == round(node.estimate.kv_pool_bytes / 2**30, 2)
    assert facts.kv_cache_tokens == node.estimate.vllm_logged_tokens
    assert facts.max_model_len == 26624 and facts.kv_cache_dtype == "auto"
    assert facts.weights_gib is not None and facts.non_torch_gib == 1.0
    assert "non-default args: {'model': 'Qwen/Qwen3-8B', 'max_model_len': 26624, " in node.log[0]


@pytest.mark.parametrize(
    ("preset", "gib", "flags", "message"),
    [
        ("nope", 24, ServeFlags(), "--preset: unknown preset 'nope'"),
        ("qwen3-8b", 24, ServeFlags(cpu_offload_gb=40), "--cpu-offload-gb: 40 GiB is all"),
        (
            "qwen3-8b",
            24,
            ServeFlags(kv_cache_dtype="int3"),
            "--kv-cache-dtype: unknown KV cache dtype 'int3'",
        ),
        ("qwen3-8b", -1, ServeFlags(), "--gpu-memory-gib: expected a positive number"),
        ("qwen3-8b", 24, ServeFlags(gpu_memory_utilization=1.5), "--gpu-memory-utilization: "),
        ("qwen3-8b", 24, ServeFlags(max_num_seqs=0), "--max-num-seqs: expected a positive"),
    ],
)
def test_bad_flags_name_the_flag(preset: str, gib: float, flags: ServeFlags, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        size_node(preset, gib, flags)
    assert str(info.value).startswith(message)


def test_simulate_cli_builds_a_sized_node(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["simulate", "--preset", "qwen3-8b", "--gpu-memory-gib", "24", "--max-model-len",
         "26624", "--max-num-seqs", "14", "--time-scale", "20", "--port", "0"]
    )  # fmt: skip
    (spec,) = build_specs(args)
    assert spec.settings.max_num_seqs == 14 and spec.settings.time_scale == 20
    assert spec.settings.kv_tokens == plan_tokens(max_model_len=26624, max_num_seqs=14)
    assert "Available KV cache memory:" in capsys.readouterr().out
    args = build_parser().parse_args(["simulate", "--profile", "tiny", "--kv-cache-dtype", "fp8"])
    with pytest.raises(SettingsError, match="--kv-cache-dtype applies only to a --preset node"):
        build_specs(args)


def _config(simulate: dict[str, object]) -> dict[str, object]:
    backend = {"name": "n1", "url": "http://127.0.0.1:9101", "simulate": simulate}
    return {"models": [{"name": "qwen"}], "tiers": [{"name": "t", "backends": [backend]}]}


def test_a_config_backend_can_be_a_sized_node() -> None:
    from kvgateway.simulator.fleetconfig import parse_fleet_config

    sim = {"preset": "qwen3-8b", "gpu_memory_gib": 24, "max_model_len": 26624,
           "kv_cache_dtype": "fp8", "time_scale": 20}  # fmt: skip
    (spec,) = parse_fleet_config(_config(sim))
    s = spec.settings
    assert s.kv_tokens == plan_tokens(max_model_len=26624, kv_cache_dtype="fp8")
    assert (s.name, s.model, s.cache_dtype, s.time_scale) == ("n1", "qwen", "fp8", 20)


@pytest.mark.parametrize(
    ("simulate", "message"),
    [
        ({"preset": "qwen3-8b", "profile": "tiny", "gpu_memory_gib": 24},
         "tiers[0].backends[0].simulate.preset: give profile or preset, not both"),
        ({"preset": "qwen3-8b"}, "tiers[0].backends[0].simulate.gpu_memory_gib: required"),
        ({"preset": "qwen3-8b", "gpu_memory_gib": 24, "max_num_seqs": "many"},
         "tiers[0].backends[0].simulate.max_num_seqs: expected a positive integer"),
        ({"preset": "qwen3-8b", "gpu_memory_gib": 24},
         "tiers[0].backends[0].simulate: To serve at least one request"),
    ],
)  # fmt: skip
def test_sized_config_errors_name_the_yaml_path(simulate: dict[str, object], message: str) -> None:
    from kvgateway.simulator.fleetconfig import parse_fleet_config

    with pytest.raises(SettingsError) as info:
        parse_fleet_config(_config(simulate))
    assert str(info.value).startswith(message)
