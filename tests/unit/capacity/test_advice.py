"""make_plan: the ordered recommendations and the settings to paste."""

from __future__ import annotations

import re

from kvgateway.capacity import CapacitySpec, Plan, make_plan
from kvgateway.capacity.advice import len_for_concurrency, suggested_max_num_seqs


def plan_for(**data: object) -> Plan:
    return make_plan(CapacitySpec.from_mapping(data, "capacity"))


def test_steps_always_come_in_the_same_order() -> None:
    for data in (
        {"preset": "qwen3-8b", "gpu_memory_gib": 24},
        {"preset": "llama-3.1-70b", "gpu_memory_gib": 79.25, "tp": 4},
        {"preset": "deepseek-v3", "gpu_memory_gib": 139.8, "tp": 8},
        {"preset": "gpt-oss-20b", "kv_cache_memory_gib": 6},
    ):
        plan = plan_for(**data)
        assert [r.step for r in plan.recommendations] == [1, 2, 3, 4, 5]
        assert "--max-model-len" in plan.recommendations[0].title
        assert "--cpu-offload-gb" in plan.recommendations[4].detail


def test_target_with_headroom_is_kept() -> None:
    plan = plan_for(preset="llama-3.1-70b", gpu_memory_gib=79.25, tp=4)
    assert plan.settings is not None and plan.settings.max_model_len == 131_072
    assert "keep it" in plan.recommendations[0].detail


def test_target_that_does_not_fit_gets_70_percent_of_the_maximum() -> None:
    plan = plan_for(preset="qwen3-8b", kv_cache_memory_gib=4.47, max_model_len=32768)
    est = plan.estimate
    assert not est.fits_target and est.max_model_len_fit == (2034 - 1) * 16
    assert plan.settings is not None
    assert plan.settings.max_model_len == 22_528  # 0.7 x 32,528 rounded down to 1024
    assert "does not fit" in plan.recommendations[0].detail
    assert plan.settings.kv_cache_tokens == est.kv_cache_tokens


def test_len_for_concurrency_is_the_longest_that_still_fits_n() -> None:
    est = plan_for(preset="qwen3-8b", kv_cache_memory_gib=39.84).estimate
    usable_blocks = est.num_gpu_blocks - 1
    for n in (1, 2, 3, 7):
        length = len_for_concurrency(est, n)
        assert est.concurrency_at(length) >= n
        assert length == usable_blocks // n * 16 or length == 40_960


def test_max_num_seqs_suggestion() -> None:
    assert suggested_max_num_seqs(38_224, 26_624) == 5
    assert suggested_max_num_seqs(10**9, 4096) == 256
    assert suggested_max_num_seqs(0, 4096) == 1


def test_model_that_does_not_load_gets_no_settings_but_real_alternatives() -> None:
    plan = plan_for(preset="llama-3.1-70b", gpu_memory_gib=48, max_model_len=32768)
    assert plan.settings is None
    last = plan.recommendations[4].detail
    assert "--tensor-parallel-size 4 over 4 such GPUs" in last
    match = re.search(r"--cpu-offload-gb (\d+)", last)
    assert match is not None and int(match.group(1)) <= 131  # never more than all the weights


def test_measured_pool_what_ifs_add_memory_to_the_given_pool() -> None:
    plan = plan_for(preset="qwen3-8b", kv_cache_memory_gib=8.6, gpu_memory_gib=23.5)
    util = plan.recommendations[2].detail
    assert "0.94 adds 0.47 GiB" in util
    assert re.search(r"--cpu-offload-gb 4 moves 4 GiB", plan.recommendations[4].detail)


def test_fp8_step_is_skipped_when_already_fp8() -> None:
    plan = plan_for(preset="qwen3-8b", gpu_memory_gib=24, kv_cache_dtype="fp8_e4m3")
    assert plan.recommendations[3].detail.startswith("already fp8_e4m3")


def test_alternatives_really_fit_and_are_the_smallest_change() -> None:
    plan = plan_for(preset="llama-3.1-70b", gpu_memory_gib=24)
    assert not plan.fits and plan.settings is None
    by_kind = {a.kind: a for a in plan.alternatives}
    tp = by_kind["tensor_parallel"].estimate
    assert tp.tp == 8 and tp.max_model_len_fit >= 8192
    # tp 4 is one step short: the smallest that fits is offered.
    assert plan_for(preset="llama-3.1-70b", gpu_memory_gib=24, tp=4).settings is None
    card = by_kind["larger_gpu"]
    assert (
        "141 GB" not in card.change
        and plan_for(preset="llama-3.1-70b", gpu_memory_gib=139.8).settings is None
    )


def test_a_model_that_fits_has_no_alternatives() -> None:
    plan = plan_for(preset="llama-3.1-8b", gpu_memory_gib=24)
    assert plan.fits and plan.alternatives == ()
