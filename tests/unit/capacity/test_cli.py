"""`gateway plan`: text, JSON, errors, presets, and --from-log."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgateway.capacity.cli import register

DATA = Path(__file__).parent / "data"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    # Only this command's parser: the test does not depend on the other subcommands.
    parser = argparse.ArgumentParser(prog="gateway")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, _ = run([*argv, "--json"], capsys)
    assert code == 0
    loaded: dict[str, Any] = json.loads(out)
    return loaded


def test_qwen3_8b_on_24_gib_walks_the_fixes_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["--preset", "qwen3-8b", "--gpu-memory-gib", "24", "--max-model-len", "32768"], capsys
    )
    assert code == 0
    assert "KV bytes per token   147,456 B per GPU" in out
    recs = out[out.index("Recommendations") : out.index("Serve with:")]
    steps = [
        recs.index("1. Lower --max-model-len"),
        recs.index("2. Cap --max-num-seqs and --max-num-batched-tokens"),
        recs.index("3. Raise --gpu-memory-utilization"),
        recs.index("4. fp8 KV cache"),
        recs.index("5. Larger-memory node, or a CPU-offload node"),
    ]
    assert steps == sorted(steps)
    flat = " ".join(recs.split())
    step1 = flat[: flat.index("2. Cap")]
    # concrete numbers for this case: the 60-80% range and what fits at the suggestion
    assert re.search(r"60-80% of the 38224-token maximum \(22928-30576\)", step1)
    assert re.search(r"at --max-model-len 26624, 1 concurrent request fits \(1\.44x\)", step1)
    assert "to run 2 at once, --max-model-len 19104" in step1
    assert "cap --max-num-seqs at 5" in flat
    assert re.search(r"0\.94 adds 0\.48 GiB: [\d,]+ tokens", flat)
    assert "147,456 -> 73,728 B/token" in flat
    assert "accuracy" in flat and "scales" in flat and "Hopper" in flat
    assert re.search(r"--cpu-offload-gb \d+ moves \d+ GiB", flat)
    assert "ms more per step" in flat
    # ends with what to paste
    assert "vllm serve Qwen/Qwen3-8B" in out and "--max-model-len 26624" in out
    entry = out[out.index("Gateway backend entry:") :]
    for field in ("name:", "url:", "model: Qwen/Qwen3-8B", "max_model_len: 26624",
                  "max_num_seqs: 5"):  # fmt: skip
        assert field in entry
    # The estimate is shown, commented out: pinned, it would override the node's own number.
    assert "\n    # kv_cache_tokens: 38224  # expected;" in entry
    assert "\n    kv_cache_tokens:" not in entry


def test_json_carries_the_key_figures(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["--preset", "qwen3-8b", "--kv-cache-memory-gib", "39.84"], capsys)
    assert data["bytes_per_token"] == 147_456
    assert data["kv_cache_tokens"] == 290_080
    assert data["vllm_logged_tokens"] == 290_096
    assert data["max_model_len_fit"] == 40_960
    assert data["max_concurrency"] == pytest.approx(18_130 / 2560, abs=1e-4)
    assert set(data["concurrency"]) == {"4096", "8192", "16384", "32768"}
    assert [r["step"] for r in data["recommendations"]] == [1, 2, 3, 4, 5]
    assert "kv_cache_tokens" not in data["gateway_backend"]
    assert data["settings"]["kv_cache_tokens"] == 290_080
    assert data["fits"] is True and data["what_would_fit"] == []
    assert data["vllm_serve"].startswith("vllm serve Qwen/Qwen3-8B")


def test_tp_and_fp8_flags_reach_the_serve_command(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["--preset", "llama-3.1-70b", "--gpu-memory-gib", "79.25", "--tp", "4",
                     "--kv-cache-dtype", "fp8"], capsys)  # fmt: skip
    assert data["bytes_per_token"] == 40_960
    assert "--tensor-parallel-size 4" in data["vllm_serve"]
    assert "--kv-cache-dtype fp8" in data["vllm_serve"]
    assert data["recommendations"][3]["detail"].startswith("already fp8")


def test_model_config_file_and_mla(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["--model-config", str(DATA / "deepseek_v3_config.json"),
                     "--gpu-memory-gib", "139.8", "--tp", "8"], capsys)  # fmt: skip
    assert data["bytes_per_token"] == 70_272
    assert any("MLA" in n for n in data["notes"])


def test_explicit_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(["--num-layers", "36", "--num-kv-heads", "8", "--head-dim", "128",
                     "--kv-cache-memory-gib", "39.84"], capsys)  # fmt: skip
    assert data["bytes_per_token"] == 147_456 and data["vllm_logged_tokens"] == 290_096
    mla = run_json(["--num-layers", "61", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64",
                    "--kv-cache-memory-gib", "40"], capsys)  # fmt: skip
    assert mla["bytes_per_token"] == 70_272
    sized = run_json(["--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128",
                      "--params-billion", "8", "--gpu-memory-gib", "24"], capsys)  # fmt: skip
    assert sized["kv_pool_bytes"] > 0


def test_hybrid_preset_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--preset", "gemma-3-27b", "--gpu-memory-gib", "79.25"], capsys)
    assert code == 0 and "in 7 groups" in out and "hybrid layout" in out


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--list-presets"], capsys)
    assert code == 0
    assert re.search(r"qwen3-8b\s+147,456", out) and "deepseek-v3" in out and "gpt-oss-20b" in out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--preset", "qwen3-8b", "--gpu-memory-gib", "24", "--tp", "four"], "--tp"),
        (["--preset", "qwen3-8b", "--gpu-memory-gib", "lots"], "--gpu-memory-gib"),
        (["--preset", "qwen3-8b", "--gpu-memory-gib", "24", "--gpu-memory-utilization", "92"],
         "--gpu-memory-utilization"),
        (["--preset", "qwen3-8b", "--gpu-memory-gib", "24", "--kv-cache-dtype", "int4"],
         "--kv-cache-dtype"),
        (["--preset", "qwen3-8b", "--gpu-memory-gib", "24", "--max-model-len", "-1"],
         "--max-model-len"),
    ],
)  # fmt: skip
def test_bad_flag_values_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run(argv, capsys)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpu-memory-gib", "24"], "--preset"),
        (["--preset", "qwen3-8b"], "--gpu-memory-gib: missing"),
        (["--preset", "nope", "--gpu-memory-gib", "24"], "--preset: unknown preset"),
        (["--preset", "qwen3-8b", "--model-config", "x.json", "--gpu-memory-gib", "24"],
         "--preset: give either"),
        (["--model-config", "/nonexistent/config.json", "--gpu-memory-gib", "24"],
         "--model-config: cannot read"),
        (["--model-config", str(DATA / "nemotron_h_config.json"), "--gpu-memory-gib", "24"],
         "--model-config (nemotron_h_config.json: model_type): nemotron_h mixes attention"),
        (["--num-layers", "32", "--num-kv-heads", "8", "--gpu-memory-gib", "24"],
         "--head-dim"),
        (["--num-layers", "32", "--preset", "qwen3-8b", "--gpu-memory-gib", "24"],
         "--num-layers: explicit numbers replace"),
        (["--from-log", "/nonexistent.log"], "--from-log: cannot read"),
        (["--from-log", str(DATA / "qwen3_8b_config.json")], "--from-log: no vLLM KV-cache lines"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_a_message(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("gateway plan: error: ")
    assert words in err


def test_from_log_alone_explains_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--from-log", str(DATA / "v1_qwen25_14b_too_long.log")], capsys)
    assert code == 0
    flat = " ".join(out.split())
    assert "vLLM refused to start: one request of max_model_len 131072 needs 24.00 GiB" in flat
    assert "the schedulable maximum is 59568" in flat
    assert "at --max-model-len 40960, 1 concurrent request fits (1.45x)" in flat
    assert "# kv_cache_tokens: 59568" in out


def test_from_log_v0_wording(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--from-log", str(DATA / "v0_llama31_8b_3090_29k_too_long.log")], capsys)
    flat = " ".join(out.split())
    assert code == 0 and "The V0 engine refused to start" in flat and "23,648 tokens" in flat


def test_from_log_with_preset_cross_checks(capsys: pytest.CaptureFixture[str]) -> None:
    log = str(DATA / "v1_llama31_8b_h100_one_line.log")
    code, out, _ = run(["--from-log", log, "--preset", "llama-3.1-8b"], capsys)
    assert code == 0 and "Cross-check against the model: matches" in out
    assert "# kv_cache_tokens: 460480" in out  # the node's own count, less the null block
    data = run_json(["--from-log", log, "--preset", "llama-3.1-8b"], capsys)
    assert data["cross_check"]["ok"] and data["cross_check"]["logged_tokens"] == 460_496
    assert data["kv_cache_tokens"] == 460_480
    assert data["bytes_per_token"] == 131_072 and data["max_model_len_fit"] == 131_072
    assert data["log"]["total_gpu_gib"] == 79.25
    assert data["plan"]["bytes_per_token"] == 131_072


def test_from_log_wrong_model_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    log = str(DATA / "v1_qwen3_8b_h100.log")
    code, out, _ = run(["--from-log", log, "--preset", "llama-3.1-70b"], capsys)
    assert code == 0 and "DOES NOT MATCH" in out


def test_from_log_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO((DATA / "v1_qwen3_8b_h100.log").read_text()))
    data = run_json(["--from-log", "-"], capsys)
    assert data["log"]["kv_cache_tokens"] == 290_096
    assert data["kv_cache_tokens"] == 290_080
    # The log names Qwen/Qwen3-8B, a built-in preset: its 40,960-token limit applies.
    assert data["max_model_len_fit"] == 40_960
    assert data["max_concurrency"] == pytest.approx(290_080 / 40_960, abs=1e-3)
    assert data["bytes_per_token"] == 147_456


GEMMA_LOG = """\
INFO [core.py] Initializing a V1 LLM engine ({version}) with config: model='{model}', \
tokenizer='{model}', dtype=torch.bfloat16, max_seq_len=131072, tensor_parallel_size=2, \
pipeline_parallel_size=1, quantization=None, kv_cache_dtype=auto
INFO [gpu_worker.py] Available KV cache memory: 20.0 GiB
INFO [kv_cache_utils.py] GPU KV cache size: {tokens} tokens
INFO [kv_cache_utils.py] Maximum concurrency for 131,072 tokens per request: 2.81x
"""


def test_a_hybrid_models_log_is_read_in_either_wording(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Gemma 3 (sliding window + full attention, 7 groups) on a 32,768-block pool: vLLM
    logs 74,896 tokens (blocks // groups x 16), and the newest releases 368,540 (2.81x
    131,072, tokens at full-length concurrency). Both read as 74,880 tokens: taken for a
    one-group pool, the newest wording would budget 368,524, 4.9x what short requests
    can hold."""
    for version, tokens in (("v0.21.0", "74,896"), ("v0.31.0", "368,540")):
        log = tmp_path / f"{version}.log"
        log.write_text(
            GEMMA_LOG.format(version=version, model="google/gemma-3-27b-it", tokens=tokens)
        )
        code, out, err = run(["--from-log", str(log)], capsys)
        assert "read with the built-in preset gemma-3-27b" in err  # named by the log
        assert code == 0 and "Cross-check against the model: matches" in out, out
        assert "# kv_cache_tokens: 74880" in out, out
        # A model the gateway does not know: the old wording shows it is not one group.
        log.write_text(GEMMA_LOG.format(version=version, model="acme/unknown", tokens=tokens))
        code, out, _ = run(["--from-log", str(log)], capsys)
        flat = " ".join(out.split())
        if tokens == "74,896":
            assert "This model has several KV-cache groups" in flat
            assert "Use kv_cache_tokens" not in flat and "Lower --max-model-len" not in flat
        else:  # indistinguishable from one group by the log alone: said so
            assert "give --preset or --model-config" in flat


def test_module_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgateway", "plan", "--preset", "qwen3-8b", "--gpu-memory-gib",
         "24", "--max-model-len", "32768", "--json"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["bytes_per_token"] == 147_456 and data["max_model_len_fit"] == 38_224


def test_70b_on_one_24_gib_card_does_not_fit_and_says_what_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(["--preset", "llama-3.1-70b", "--gpu-memory-gib", "24"], capsys)
    assert code == 1
    head = out[: out.index("KV bytes per token")]
    flat = " ".join(head.split())
    assert "DOES NOT FIT: llama-3.1-70b needs 131.42 GiB of weights per GPU" in flat
    # The advice starts with what would fit, in order: tensor parallel, quantization, a card.
    order = [
        flat.index("--tensor-parallel-size 8 over 8 GPUs of 24 GiB"),
        flat.index("fp8 weights"),
        flat.index("4-bit weights (an AWQ or GPTQ checkpoint) with --tensor-parallel-size 2"),
        flat.index("one 180 GB (B200) GPU"),
    ]
    assert order == sorted(order)
    assert "Nothing to paste yet" in out and "Gateway backend entry" not in out
    code, out, _ = run(["--preset", "llama-3.1-70b", "--gpu-memory-gib", "24", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["fits"] is False
    assert [a["kind"] for a in data["what_would_fit"]] == [
        "tensor_parallel",
        "quantization",
        "quantization",
        "larger_gpu",
    ]
    assert all(a["max_model_len_fit"] >= 8192 for a in data["what_would_fit"])


def test_a_model_that_fits_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["--preset", "llama-3.1-70b", "--gpu-memory-gib", "79.25", "--tp", "4"], capsys
    )
    assert code == 0 and "DOES NOT FIT" not in out


ONE_GROUP_LOG = (
    "INFO [core.py] Initializing a V1 LLM engine (v0.10.1.1) with config: model='{model}', "
    "dtype=torch.{dtype}, max_seq_len={length}, tensor_parallel_size=1, "
    "pipeline_parallel_size=1, quantization=None, kv_cache_dtype=auto\n"
    "INFO [gpu_worker.py] Available KV cache memory: 56.21 GiB\n"
    "INFO [kv_cache_utils.py] GPU KV cache size: {tokens} tokens\n"
    "INFO [kv_cache_utils.py] Maximum concurrency for {length:,} tokens per request: {c}x\n"
)


def test_one_group_logs_read_as_one_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A one-group log at a length that is not whole blocks (460,496 tokens = 91.95x 5,008
    padded, not 5,000) reads as one group and gets its advice, not taken for a hybrid;
    one from a node run with --dtype float32 is cross-checked at a 32-bit cache, not the
    preset's 16-bit one (off by 2x)."""
    log = tmp_path / "ft.log"
    log.write_text(
        ONE_GROUP_LOG.format(
            model="my-org/llama-ft", dtype="bfloat16", length=5000, tokens="460,496", c="91.95"
        )
    )
    code, out, _ = run(["--from-log", str(log)], capsys)
    flat = " ".join(out.split())
    assert code == 0 and "Use kv_cache_tokens: 460480" in flat and "several" not in flat
    log.write_text(
        ONE_GROUP_LOG.format(
            model="meta-llama/Llama-3.1-8B-Instruct",
            dtype="float32",
            length=131072,
            tokens="230,240",
            c="1.76",
        )
    )
    code, out, _ = run(["--from-log", str(log)], capsys)
    assert code == 0 and "Cross-check against the model: matches" in out, out
    assert "262,144 B/token" in out


def test_a_checkpoint_with_an_fp8_cache_is_not_told_to_use_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
        "vocab_size": 128256, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "kv_cache_scheme": {"num_bits": 8, "type": "float"},
        },
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _, out, _ = run(["--model-config", str(path), "--kv-cache-memory-gib", "20"], capsys)
    assert "already fp8 (from the checkpoint)" in " ".join(out.split()), out
