"""`gateway rounds` on vLLM 0.32 CPU nodes and on noisy measurements: verdicts need a
noise estimate (repeats or --noise), the next step is in the node's own flags, and a
flag already at its advised value is not advised again."""

from __future__ import annotations

import itertools
import json
from typing import Any

from kvgateway.capacity.logparse import parse_vllm_log
from kvgateway.cli import main
from kvgateway.commands.roundsnext import next_step
from kvgateway.commands.roundsreport import changed_flags, render, verdict
from kvgateway.commands.roundstats import flags_from_log, log_summary, rounds_from_json
from tests.support.capacity_data import read_data

QWEN_CPU = "v1_032_cpu_qwen2_override.log"


def step(c: int, tok: float, preempt: int = 0) -> dict[str, Any]:
    return {
        "concurrency": c, "requests": 10 * c, "completed": 9 * c, "ttft_p50_s": 0.2,
        "ttft_p99_s": 0.5, "tokens_per_s": tok, "preemptions": preempt, "peak_kv_usage": 0.5,
    }  # fmt: skip


def rnd(name: str, best: float, flags: dict[str, Any], **extra: Any) -> dict[str, Any]:
    limits = {"model": "qwen", "max_model_len": flags.get("max_model_len", 4096),
              "num_gpu_blocks": 64, "block_size": 128, "kv_tokens": 8064}  # fmt: skip
    limits |= extra.pop("limits", {})
    return {
        "name": name, "limits": limits, "flags": flags, "prompt_tokens": 512,
        "output_tokens": 128, "duration_s": 30, "steps": [step(1, best / 4), step(4, best)],
        **extra,
    }  # fmt: skip


BASE = {"max_model_len": 4096, "max_num_seqs": 16}
MORE = {**BASE, "max_num_seqs": 8}


def load(*rounds: dict[str, Any]) -> list[Any]:
    return rounds_from_json({"rounds": list(rounds)})


def test_one_disturbed_baseline_gives_no_verdict() -> None:
    # The baseline ran beside another load: 100 tokens/s where the node does ~700.
    r1, r2 = load(rnd("r1", 100, BASE), rnd("r2", 789, MORE))
    v = verdict(r1, r2)
    assert v.kind == "inconclusive" and v.noise is None
    assert "Inconclusive: +689%" in v.sentence
    assert "Repeat r1 and r2 with the same flags and load" in v.sentence
    assert "or give --noise" in v.sentence
    assert "Better" not in v.sentence


def test_repeats_measure_the_noise_the_verdict_is_weighed_against() -> None:
    rounds = load(rnd("r1", 100, BASE), rnd("r1b", 700, BASE), rnd("r2", 789, MORE))
    first, second = (verdict(a, b, rounds) for a, b in itertools.pairwise(rounds))
    assert first.kind == "repeat" and "150% apart, is run-to-run noise" in first.sentence
    # Against the median of r1's two runs (400), r2's +97% is inside their 150% spread.
    assert second.kind == "flat" and second.noise is not None
    assert second.noise.source == "repeats of r1, r1b"
    assert "medians of 2 and 1 runs 400 -> 789" in second.sentence
    assert "within the 150% run-to-run noise (repeats of r1, r1b)" in second.sentence
    # Steady repeats: a real gain stands out.
    rounds = load(rnd("r1", 700, BASE), rnd("r1b", 720, BASE), rnd("r2", 1000, MORE))
    v = verdict(rounds[1], rounds[2], rounds)
    assert v.kind == "better" and "+41%, beyond the 5% noise" in v.sentence
    text = " ".join(render(rounds).split())
    assert "A repeat (no recorded setting" in text and "Better: best tokens/s" in text


def test_the_noise_given_on_the_command_line(tmp_path, capsys) -> None:
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"rounds": [rnd("r1", 700, BASE), rnd("r2", 1000, MORE)]}))
    assert main(["rounds", str(path)]) == 0
    assert "Inconclusive: +43%" in " ".join(capsys.readouterr().out.split())
    assert main(["rounds", str(path), "--noise", "0.08"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "Better: best tokens/s 700 (4 concurrent) -> 1,000 (4 concurrent), +43%" in flat


def test_max_model_len_already_at_the_advice_is_not_advised_again() -> None:
    # 70% of 40,000 KV tokens is 27,648: --max-model-len 8192 is well below, nothing to lower.
    (r,) = load(rnd("r", 700, {"max_model_len": 8192}, limits={"kv_tokens": 40_000}))
    nxt = next_step([r])
    assert nxt is not None and nxt.step.step == 2 and nxt.flag == "--max-num-seqs"
    assert "--max-model-len 8192" not in nxt.advice
    # Still advised where it binds.
    (r,) = load(rnd("r", 700, {"max_model_len": 32768}, limits={"kv_tokens": 40_000}))
    nxt = next_step([r])
    assert nxt is not None and nxt.advice.startswith("--max-model-len 27648:")


def _cpu_log() -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(log_summary(parse_vllm_log(read_data(QWEN_CPU))))


def test_a_cpu_node_is_advised_in_its_own_flags() -> None:
    log = _cpu_log()
    assert log["device"] == "CPU" and log["num_blocks_override"] == 64
    assert log["profiled_num_blocks"] == 16_384 and log["kv_memory_source"] == "explicit"
    passed = {"max_model_len": 4096, "max_num_seqs": 16}
    # Under the override, the override sizes the pool: raise it (not GPU memory, not fp8).
    (r,) = load(rnd("r", 700, {**BASE, "num_gpu_blocks_override": 64}, log=log,
                    passed_flags={**passed, "num_gpu_blocks_override": 64}))  # fmt: skip
    nxt = next_step([r])
    assert nxt is not None and nxt.step.step == 3 and nxt.flag == "--num-gpu-blocks-override"
    assert nxt.title == "Raise --num-gpu-blocks-override (it sets the pool)"
    assert nxt.advice.startswith("--num-gpu-blocks-override 128 (now 64)")
    assert "128 blocks hold 16,256 tokens instead of 8,064" in nxt.advice
    assert "gpu-memory-utilization" not in nxt.advice + nxt.title
    # Without it, a CPU node's KV memory is --kv-cache-memory-bytes.
    cpu = {**log, "num_blocks_override": None, "profiled_num_blocks": None}
    (r,) = load(rnd("r", 700, BASE, log=cpu, passed_flags=passed))
    nxt = next_step([r])
    assert nxt is not None and nxt.flag == "--kv-cache-memory-bytes"
    assert nxt.advice.startswith("--kv-cache-memory-bytes 2G (now 1.00 GiB of the NUMA node's")
    assert "gpu-memory-utilization" not in nxt.advice + nxt.title
    # Once raised, the next is no GPU's offload: fp8 does not apply under an override.
    raised = {**BASE, "num_gpu_blocks_override": 128}
    rounds = load(
        rnd("a", 700, {**BASE, "num_gpu_blocks_override": 64}, log=log, passed_flags=passed),
        rnd("b", 900, raised, log=log, passed_flags={**passed, "num_gpu_blocks_override": 128}),
    )
    nxt = next_step(rounds)
    assert nxt is not None and nxt.step.step == 5
    assert "--cpu-offload-gb does not apply on CPU" in nxt.advice


def test_a_real_start_up_lines_flags_survive_a_config_object() -> None:
    text = read_data("v1_032_cpu_gemma3_hybrid.log")
    flags = flags_from_log(text)
    assert flags["max_model_len"] == 4096 and flags["num_gpu_blocks_override"] == 64
    assert flags["max_num_seqs"] == 16 and flags["served_model_name"] == ["gemma"]
    assert str(flags["kv_events_config"]).startswith("KVEventsConfig(enable_kv_cache_events=")
    assert "model" not in flags
    json.dumps(flags)  # the rounds file can hold them


def test_where_a_node_listens_is_no_change() -> None:
    a_flags = {**BASE, "port": 41027, "host": "127.0.0.1", "kv_events_config": "KVEventsConfig(x)"}
    b_flags = {**MORE, "port": 55765, "host": "127.0.0.1", "kv_events_config": "KVEventsConfig(y)"}
    a, b = load(rnd("a", 700, a_flags), rnd("b", 700, b_flags))
    assert changed_flags(a, b) == ("--max-num-seqs 16 -> 8",)
    text = render([a, b], noise=0.05)
    assert "--port" not in text and "--kv-events-config" not in text


def test_repeats_share_a_colour_in_the_plot(tmp_path) -> None:
    import pytest

    pytest.importorskip("matplotlib")
    from kvgateway.commands.roundsplot import plot_rounds

    png = tmp_path / "rounds.png"
    plot_rounds(load(rnd("r1", 700, BASE), rnd("r1b", 720, BASE), rnd("r2", 1000, MORE)), png)
    assert png.read_bytes().startswith(b"\x89PNG")
