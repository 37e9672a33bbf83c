"""`gateway rounds`: comparison, verdicts and next steps from hand-made round files."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgateway.capacity.advice import PLAN_ORDER
from kvgateway.cli import main
from kvgateway.commands.roundsnext import next_step
from kvgateway.commands.roundsreport import render, verdict
from kvgateway.commands.roundstats import RoundsFileError, rounds_from_json


def step(c: int, tok: float, p99: float, preempt: int = 0, kv: float = 0.5) -> dict[str, Any]:
    return {
        "concurrency": c, "requests": 10 * c, "completed": 9 * c, "ttft_p50_s": p99 / 2,
        "ttft_p99_s": p99, "tokens_per_s": tok, "preemptions": preempt, "peak_kv_usage": kv,
    }  # fmt: skip


def rnd(
    name: str, kv: int, steps: list[dict[str, Any]], flags: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "limits": {
            "model": "m", "max_model_len": flags.get("max_model_len", 26624),
            "num_gpu_blocks": kv // 16 + 1, "block_size": 16, "kv_tokens": kv,
            "gpu_memory_utilization": flags.get("gpu_memory_utilization", 0.92),
        },
        "flags": flags, "prompt_tokens": 2048, "output_tokens": 512, "duration_s": 60,
        "steps": steps, **extra,
    }  # fmt: skip


BASE = {"max_model_len": 26624, "kv_cache_dtype": "auto", "gpu_memory_utilization": 0.92}
R1 = rnd(
    "r1",
    38224,
    [
        step(1, 50, 0.5),
        step(2, 95, 0.9),
        step(4, 170, 1.9),
        step(8, 1000, 3.4),
        step(16, 400, 7, 9),
    ],
    BASE,
    passed_flags={"max_model_len": 26624},
    stopped="the node preempted 9 time(s) at 8 concurrent",
)
R2 = rnd(
    "r2",
    76464,
    [step(1, 50, 0.5), step(2, 96, 0.9), step(4, 172, 1.8), step(8, 1380, 3.0),
     step(16, 1500, 5.0), step(32, 900, 9.0, 4)],
    {**BASE, "kv_cache_dtype": "fp8"},
)  # fmt: skip


def load(*rounds: dict[str, Any]):
    return rounds_from_json({"rounds": list(rounds)})


def test_verdict_names_the_change_the_gain_and_where_preemptions_start() -> None:
    r1, r2 = load(R1, R2)
    # r1 preempts at 16 (not at 8): make it preempt at 8 for the sentence.
    r1_8 = load(rnd("r1", 38224, [*R1["steps"][:3], step(8, 1000, 3.4, 2)], BASE))[0]
    v = verdict(r1_8, r2, noise=0.03)
    assert v.changed == ("--kv-cache-dtype auto -> fp8",)
    assert "+38% tokens/s at 8 concurrent (1,000 -> 1,380)" in v.sentence
    assert "preemptions start at 32 instead of 8" in v.sentence
    assert "KV 38,224 -> 76,464 tokens (+100%)" in v.sentence
    assert v.kind == "better" and "beyond the 5% noise" in v.sentence
    # Compared at the highest concurrency both rounds ran.
    assert "at 16 concurrent (400 -> 1,500)" in verdict(r1, r2).sentence


def test_verdict_only_moved_the_preemptions() -> None:
    before = load(rnd("a", 38224, [step(4, 170, 2), step(8, 250, 3, 3)], BASE))[0]
    after = load(
        rnd("b", 41712, [step(4, 171, 2), step(8, 255, 3), step(16, 258, 6, 5)],
            {**BASE, "gpu_memory_utilization": 0.94})
    )[0]  # fmt: skip
    v = verdict(before, after, noise=0.02)
    assert v.kind == "moved"
    assert "Only moved the preemptions to a higher concurrency" in v.sentence
    assert "within the 5% run-to-run noise (--noise)" in v.sentence
    assert "preemptions start at 16 instead of 8" in v.sentence
    assert v.changed == ("--gpu-memory-utilization 0.92 -> 0.94",)


def test_verdict_worse_and_flat() -> None:
    seqs = {**BASE, "max_num_seqs": 8}
    a = load(rnd("a", 38224, [step(4, 200, 2), step(8, 300, 3)], BASE))[0]
    worse = load(rnd("b", 38224, [step(4, 150, 2), step(8, 200, 3)], seqs))[0]
    flat = load(rnd("c", 38224, [step(4, 201, 2), step(8, 302, 3)], seqs))[0]
    assert verdict(a, worse, noise=0.05).kind == "worse"
    assert verdict(a, flat, noise=0.05).kind == "flat"
    assert "no preemptions in either round" in verdict(a, flat, noise=0.05).sentence
    other = load(rnd("d", 38224, [step(4, 201, 2)], BASE, prompt_tokens=1024))[0]
    assert (
        "Caution: the requests differ (2048+512 vs 1024+512 tokens)" in verdict(a, other).sentence
    )
    assert "Caution" not in verdict(a, flat).sentence
    # Nothing recorded differs: a repeat, whose gap is the noise, not a verdict.
    same = load(rnd("e", 38224, [step(4, 150, 2), step(8, 200, 3)], BASE))[0]
    v = verdict(a, same)
    assert v.kind == "repeat" and "no flag change recorded" in v.sentence
    assert "best tokens/s 300 and 200, 40% apart, is run-to-run noise" in v.sentence


def test_next_step_follows_the_plans_order() -> None:
    (r1,) = load(R1)
    nxt = next_step([r1])  # step 1 was passed in the log: step 2 is next
    assert nxt is not None and nxt.step == PLAN_ORDER[1] and nxt.flag == "--max-num-seqs"
    # The highest concurrency that did not preempt.
    assert nxt.advice.startswith("--max-num-seqs 8:")
    r1b, r2 = load(R1, {**R2, "flags": {**R2["flags"], "max_num_seqs": 8}})
    nxt = next_step([r1b, r2])  # steps 1, 2 and 4 touched: 3 is the first left
    assert nxt is not None and nxt.step.step == 3
    assert nxt.advice.startswith("--gpu-memory-utilization 0.94")
    flags = {**BASE, "gpu_memory_utilization": 0.95, "kv_cache_dtype": "fp8", "max_num_seqs": 8}
    last = load(R1, rnd("r3", 80000, R2["steps"], flags))
    nxt = next_step(last)
    assert nxt is not None and nxt.step.step == 5 and nxt.flag == "--cpu-offload-gb"


def test_next_step_raises_a_cap_that_limited_the_round() -> None:
    capped = rnd(
        "capped", 38224, [step(4, 170, 2, kv=0.3), step(8, 180, 4, kv=0.35),
                          step(16, 181, 9, kv=0.35)],
        {**BASE, "max_num_seqs": 5}, passed_flags={"max_model_len": 26624, "max_num_seqs": 5},
    )  # fmt: skip
    nxt = next_step(load(capped))
    assert nxt is not None and nxt.step.step == 2
    assert nxt.advice.startswith("--max-num-seqs 14: the cap of 5 limited this round")
    assert "peak KV usage 35%" in nxt.advice


def test_plan_order_is_the_planners() -> None:
    from kvgateway.capacity.advice import make_plan
    from kvgateway.capacity.spec import CapacitySpec

    plan = make_plan(CapacitySpec.from_mapping({"preset": "qwen3-8b", "gpu_memory_gib": 24}, ""))
    assert [r.title for r in plan.recommendations] == [p.title for p in PLAN_ORDER]


def test_render_side_by_side() -> None:
    text = render(load(R1, R2))
    lines = text.splitlines()
    assert lines[0].split() == ["round", "r1", "r2"]
    assert any(line.split() == ["KV", "tokens", "38,224", "76,464"] for line in lines)
    assert any(line.split() == ["--kv-cache-dtype", "auto", "fp8"] for line in lines)
    assert any(line.split() == ["32", "concurrent", "-", "900"] for line in lines)
    assert "r1: ladder stopped: the node preempted 9 time(s) at 8 concurrent" in text
    # Steps 1 (passed) and 4 (changed) were touched: step 2 is next.
    assert "Verdicts:" in text and "Next (plan step 2," in text


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"round": []}, 'rounds: expected {"rounds": [...]}'),
        ({"rounds": [{**R1, "steps": [{**R1["steps"][0], "tokens_per_s": "fast"}]}]},
         "rounds[0].steps[0].tokens_per_s: expected a number, got 'fast'"),
        ({"rounds": [R1, {**R2, "limits": None}]}, "rounds[1].limits: expected an object"),
    ],
)  # fmt: skip
def test_bad_files_name_the_path(data: Any, message: str) -> None:
    with pytest.raises(RoundsFileError) as info:
        rounds_from_json(data)
    assert str(info.value).startswith(message)


def test_cli_json_and_errors(tmp_path, capsys) -> None:
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"rounds": [R1, R2]}))
    assert main(["rounds", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out["rounds"]] == ["r1", "r2"]
    assert out["verdicts"][0]["kind"] == "inconclusive" and out["next"]["step"] == 2
    assert main(["rounds", str(path), "--json", "--noise", "0.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdicts"][0]["kind"] == "better"
    assert out["verdicts"][0]["noise"] == {"fraction": 0.1, "source": "--noise"}
    with pytest.raises(SystemExit) as exited:
        main(["rounds", str(path), "--noise", "2"])
    assert exited.value.code == 2
    assert "expected a fraction in [0, 1), got '2'" in capsys.readouterr().err
    path.write_text("{}")
    assert main(["rounds", str(path)]) == 2
    assert 'rounds: expected {"rounds": [...]}' in capsys.readouterr().err


def test_plot_is_written(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"rounds": [R1, R2]}))
    png = tmp_path / "rounds.png"
    assert main(["rounds", str(path), "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert f"plot written to {png}" in capsys.readouterr().err
