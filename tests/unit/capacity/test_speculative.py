"""Speculative decoding: a drafter's KV layers and weights, parsed and estimated."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from kvgateway.capacity import CapacityConfigError, CapacitySpec, estimate
from kvgateway.capacity.advice import make_plan
from kvgateway.capacity.cli import register
from kvgateway.capacity.hf_config import arch_from_hf_config
from kvgateway.capacity.report import serve_command
from kvgateway.capacity.speculative import draft_weights_bytes
from tests.support.capacity_data import DATA

GIB = 1 << 30


def _spec(speculative: Any, **extra: Any) -> CapacitySpec:
    data = {"preset": "llama-3.1-8b", "kv_cache_memory_gib": 20, **extra}
    if speculative is not None:
        data["speculative"] = speculative
    return CapacitySpec.from_mapping(data, "tiers[0].backends[0].capacity")


def test_no_drafter_and_ngram_leave_the_pool_alone() -> None:
    plain = estimate(_spec(None))
    ngram = estimate(_spec({"method": "ngram", "num_speculative_tokens": 4}))
    assert ngram.num_gpu_blocks == plain.num_gpu_blocks == int(20 * GIB) // 65_536 // 32
    assert ngram.draft_layers == 0


@pytest.mark.parametrize(("method", "layers"), [("eagle", 1), ("eagle3", 1)])
def test_eagle_heads_add_one_target_shaped_layer(method: str, layers: int) -> None:
    est = estimate(_spec({"method": method, "num_speculative_tokens": 5}))
    assert est.draft_layers == layers
    assert est.num_gpu_blocks == int(20 * GIB) // 65_536 // 33
    assert est.layout.num_groups == 1  # the drafter joins the target's group


def test_num_speculative_tokens_does_not_multiply_layers() -> None:
    one = estimate(_spec({"method": "eagle", "num_speculative_tokens": 1}))
    seven = estimate(_spec({"method": "eagle", "num_speculative_tokens": 7}))
    assert one.num_gpu_blocks == seven.num_gpu_blocks
    assert any("7 lookahead slots" in note for note in seven.notes)


def test_draft_layers_override() -> None:
    est = estimate(_spec({"method": "eagle3", "draft_layers": 2}))
    assert est.num_gpu_blocks == int(20 * GIB) // 65_536 // 34


def test_mtp_takes_the_checkpoints_nextn_layers() -> None:
    config = json.loads((DATA / "deepseek_v3_config.json").read_text())
    arch = arch_from_hf_config(config, name="dsv3")
    assert arch.num_nextn_predict_layers == 1 and not arch.tied_embeddings
    spec = CapacitySpec.from_mapping(
        {"preset": "deepseek-v3", "tp": 8, "kv_cache_memory_gib": 20, "block_size": 64,
         "speculative": {"method": "mtp", "num_speculative_tokens": 3}},
        "c",
    )  # fmt: skip
    est = estimate(spec)
    assert est.draft_layers == 1
    assert est.num_gpu_blocks == int(20 * GIB) // (64 * 1_152) // 62


def test_draft_model_with_the_same_kv_shape_joins_the_group() -> None:
    # Llama-3.2-1B-like drafter: 16 layers, 8 KV heads x 64 -> 2,048 B per layer: half the
    # target's 4,096, so 16 layers weigh as 8 target layers (by bytes; vLLM unifies page
    # sizes and may pad more, hence "exact=False" and the note).
    draft = {"num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
             "hidden_size": 2048, "num_attention_heads": 32, "intermediate_size": 8192,
             "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": True}  # fmt: skip
    est = estimate(_spec({"method": "draft_model", "draft_model_config": draft}))
    assert est.draft_layers == 8
    assert est.num_gpu_blocks == int(20 * GIB) // 65_536 // 40
    assert any("converted to target-shaped layers" in note for note in est.notes)
    same = {**draft, "head_dim": 128}
    est = estimate(_spec({"method": "draft_model", "draft_model_config": same}))
    assert est.draft_layers == 16 and not any("converted" in n for n in est.notes)


def test_draft_model_by_preset_sizes_its_weights() -> None:
    spec = _spec(
        {"method": "draft_model", "draft_preset": "qwen2.5-7b"},
        kv_cache_memory_gib=None,
        gpu_memory_gib=79.25,
        overhead_gib=2,
    )
    assert spec.speculative is not None and spec.speculative.draft_model is not None
    draft = draft_weights_bytes(spec.speculative, spec.model, 1)
    assert draft == int(7_615_616_512 * 2.0)
    est = estimate(spec)
    assert est.pool.weights_bytes == int(8_030_261_248 * 2.0) + draft


def test_eagle_weights_estimate_and_override() -> None:
    # One average Llama-3.1-8B layer + fc (2 x 4,096 x 4,096) in bf16:
    # (8,030,261,248 - 2 x 525,336,576) / 32 = 218,112,128; + 33,554,432 = 251,666,560
    # params x 2 B = 503,333,120 B (0.47 GiB; the field log's loading figure grew 0.48 GiB).
    spec = _spec({"method": "eagle"})
    assert draft_weights_bytes(spec.speculative, spec.model, 1) == 503_333_120
    given = _spec({"method": "eagle", "draft_weights_gib": 0.5})
    assert draft_weights_bytes(given.speculative, given.model, 1) == GIB // 2
    # a measured weights_gib already includes the drafter (vLLM loads it with the model)
    est = estimate(
        _spec({"method": "eagle"}, kv_cache_memory_gib=None, gpu_memory_gib=79.25,
              weights_gib=15.48, overhead_gib=1.64)
    )  # fmt: skip
    assert est.pool.weights_bytes == int(15.48 * GIB)


def test_hybrid_target_gets_the_drafter_in_its_full_attention_group() -> None:
    # gpt-oss-20b + EAGLE: 12 sliding + 13 full layers; 13 < 1.5 x 12, so vLLM pads to
    # groups of 13 (one padding layer) instead of doubling the groups.
    spec = CapacitySpec.from_mapping(
        {"preset": "gpt-oss-20b", "kv_cache_memory_gib": 10, "speculative": {"method": "eagle"}},
        "c",
    )
    layout = estimate(spec).layout
    assert (layout.group_size, layout.num_groups, layout.padding_layers) == (13, 2, 1)


@pytest.mark.parametrize(
    ("speculative", "path", "message"),
    [
        ({"method": "medusa"}, "speculative.method", "expected one of eagle, eagle3"),
        ({"method": "eagle", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens",
         "positive integer"),
        ({"method": "eagle", "draft_layers": -1}, "speculative.draft_layers", ">= 0"),
        ({"method": "eagle", "draft_weights_gib": "1"}, "speculative.draft_weights_gib",
         "number >= 0"),
        ({"method": "draft_model"}, "speculative.draft_model_config", "missing"),
        ({"method": "ngram", "draft_layers": 1}, "speculative.method", "no drafter"),
        ({"method": "eagle", "k": 3}, "speculative.k", "unknown key"),
        ({"method": "draft_model", "draft_preset": "nope"}, "speculative.draft_preset", ""),
        ({"method": "draft_model", "draft_model_config": "missing.json"},
         "speculative.draft_model_config", "cannot read"),
        ("eagle", "speculative", "expected a mapping"),
    ],
)  # fmt: skip
def test_errors_name_the_yaml_path(speculative: Any, path: str, message: str) -> None:
    with pytest.raises(CapacityConfigError) as info:
        _spec(speculative)
    assert info.value.path == f"tiers[0].backends[0].capacity.{path}"
    assert message in info.value.detail


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="gateway")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_accepts_pp_and_a_drafter(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        ["--preset", "llama-3.1-70b", "--gpu-memory-gib", "79.25", "--overhead-gib", "3",
         "--tp", "4", "--pp", "2", "--speculative-method", "eagle3",
         "--num-speculative-tokens", "3", "--draft-weights-gib", "0.8", "--json"],
        capsys,
    )  # fmt: skip
    assert code == 0
    plan = json.loads(out)
    assert plan["pp"] == 2 and plan["speculative_method"] == "eagle3"
    assert plan["draft_kv_layers"] == 1
    assert [(s["layers"], s["draft_layers"]) for s in plan["stages"]] == [(40, 0), (40, 1)]
    # the last stage holds 41 layers and the drafter's 0.8 GiB: it sets the node's blocks
    assert plan["stages"][1]["num_gpu_blocks"] < plan["stages"][0]["num_gpu_blocks"]
    code, text, _ = _run(
        ["--preset", "llama-3.1-70b", "--gpu-memory-gib", "79.25", "--tp", "4", "--pp", "2"],
        capsys,
    )
    assert (
        "--pipeline-parallel-size 2" in text
        and "(40 layers x 1,024 B; stage 1 of 2 holds the most)" in text
    )


def test_plan_drafter_flags_need_a_method(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--preset", "llama-3.1-8b", "--gpu-memory-gib", "24",
                         "--num-speculative-tokens", "3"], capsys)  # fmt: skip
    assert code == 2 and "--speculative-method" in err
    code, _, err = _run(["--preset", "llama-3.1-8b", "--gpu-memory-gib", "24",
                         "--speculative-method", "ngram", "--draft-layers", "2"], capsys)  # fmt: skip
    assert code == 2 and "--speculative-method: ngram has no drafter" in err


def test_serve_command_carries_the_drafter() -> None:
    plan = make_plan(_spec({"method": "mtp", "num_speculative_tokens": 2}, pp=1))
    assert plan.settings is not None
    command = serve_command(plan.spec, plan.settings)
    assert """--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'""" in command
