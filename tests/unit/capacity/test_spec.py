"""CapacitySpec.from_mapping: the gateway YAML's capacity block, errors naming the path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgateway.capacity import CapacityConfigError, CapacitySpec

PATH = "tiers[0].backends[1].capacity"


def parse(data: dict[str, Any], **kw: Any) -> CapacitySpec:
    return CapacitySpec.from_mapping(data, PATH, **kw)


def error(data: Any, **kw: Any) -> str:
    with pytest.raises(CapacityConfigError) as info:
        CapacitySpec.from_mapping(data, PATH, **kw)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_the_documented_backend_block_parses() -> None:
    spec = parse(
        {"gpu_memory_gib": 24, "preset": "llama-3.1-8b", "tp": 1, "kv_cache_dtype": "auto",
         "gpu_memory_utilization": 0.92}
    )  # fmt: skip
    assert spec.model.name == "llama-3.1-8b" and spec.gpu_memory_gib == 24.0
    assert spec.tp == 1 and spec.block_size == 16 and spec.kv_cache_dtype == "auto"
    assert spec.gpu_memory_utilization == 0.92


def test_defaults() -> None:
    spec = parse({"kv_cache_memory_gib": 10, "preset": "qwen3-8b"})
    assert spec.gpu_memory_utilization == 0.92  # vLLM's default since 2026-04
    assert spec.tp == 1 and spec.max_model_len is None and spec.gpu_memory_gib is None


def test_bad_integer_names_the_yaml_path() -> None:
    message = error({"gpu_memory_gib": 24, "preset": "qwen3-8b", "tp": "four"})
    assert message == f'{PATH}.tp: expected a positive integer, got "four"'
    assert error({"gpu_memory_gib": 24, "preset": "qwen3-8b", "tp": True}).startswith(f"{PATH}.tp:")
    assert "max_num_seqs" in error({"gpu_memory_gib": 24, "preset": "qwen3-8b", "max_num_seqs": 0})


@pytest.mark.parametrize(
    ("data", "where", "words"),
    [
        ({"preset": "qwen3-8b"}, "gpu_memory_gib", "missing"),
        ({"gpu_memory_gib": -1, "preset": "qwen3-8b"}, "gpu_memory_gib", "positive number"),
        ({"gpu_memory_gib": 24}, "preset", "missing"),
        ({"gpu_memory_gib": 24, "preset": "nope"}, "preset", "unknown preset"),
        ({"gpu_memory_gib": 24, "preset": "qwen3-8b", "model_config": "x.json"}, "preset",
         "not both"),
        ({"gpu_memory_gib": 24, "preset": "qwen3-8b", "gpu_memory_utilization": 1.5},
         "gpu_memory_utilization", "fraction"),
        ({"gpu_memory_gib": 24, "preset": "qwen3-8b", "kv_cache_dtype": "int2"},
         "kv_cache_dtype", "expected one of"),
        ({"gpu_memory_gib": 24, "preset": "qwen3-8b", "block_size": 24}, "block_size",
         "multiple of 16"),
        ({"gpu_memory_gib": 24, "preset": "qwen3-8b", "gpu": 1}, "gpu", "unknown key"),
        ({"gpu_memory_gib": 24, "preset": "qwen3-8b", "tp": 2, "tensor_parallel_size": 2}, "tp",
         "not both"),
    ],
)  # fmt: skip
def test_errors_name_the_key(data: dict[str, Any], where: str, words: str) -> None:
    message = error(data)
    assert message.startswith(f"{PATH}.{where}: ")
    assert words in message


def test_not_a_mapping() -> None:
    assert error("gpu_memory_gib: 24") == f'{PATH}: expected a mapping, got "gpu_memory_gib: 24"'


def test_model_config_path_is_relative_to_the_yaml_file(data_dir: Path) -> None:
    spec = parse({"gpu_memory_gib": 80, "model_config": "qwen3_8b_config.json"}, base_dir=data_dir)
    assert spec.model.num_layers == 36
    # a directory means its config.json
    seen: list[Path] = []

    def fake_read(path: Path) -> str:
        seen.append(path)
        return (data_dir / "qwen3_8b_config.json").read_text()

    parse({"gpu_memory_gib": 80, "model_config": str(data_dir)}, read_text=fake_read)
    assert seen == [data_dir / "config.json"]


def test_model_config_read_and_json_errors(tmp_path: Path) -> None:
    assert "cannot read" in error({"gpu_memory_gib": 80, "model_config": str(tmp_path / "no.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in error({"gpu_memory_gib": 80, "model_config": str(bad)})
    wrong = tmp_path / "config.json"
    wrong.write_text('{"num_hidden_layers": "many"}')
    message = error({"gpu_memory_gib": 80, "model_config": str(wrong)})
    assert message.startswith(f"{PATH}.model_config (config.json: num_hidden_layers): ")


def test_inline_model_config_and_weights_requirement() -> None:
    inline = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
    # no shape to size weights from: say which key to add
    assert error({"gpu_memory_gib": 24, "model_config": inline}).startswith(f"{PATH}.weights_gib:")
    spec = parse({"gpu_memory_gib": 24, "model_config": inline, "weights_gib": 15})
    assert spec.weights_gib == 15.0
    spec = parse({"kv_cache_memory_gib": 8, "model_config": inline})
    assert spec.kv_cache_memory_gib == 8.0
    bad = {"num_hidden_layers": 0, "num_key_value_heads": 8, "head_dim": 128}
    assert error({"kv_cache_memory_gib": 8, "model_config": bad}).startswith(
        f"{PATH}.model_config.num_hidden_layers:"
    )


def test_kv_dtype_aliases() -> None:
    assert parse({"gpu_memory_gib": 24, "preset": "qwen3-8b", "kv_cache_dtype": "FP32"}
                 ).kv_cache_dtype == "float32"  # fmt: skip
    assert parse({"gpu_memory_gib": 24, "preset": "qwen3-8b", "kv_cache_dtype": "bf16"}
                 ).kv_cache_dtype == "bfloat16"  # fmt: skip


def test_dtype_that_does_not_fit_the_model_is_rejected() -> None:
    message = error({"gpu_memory_gib": 24, "preset": "qwen3-8b", "kv_cache_dtype": "fp8_ds_mla"})
    assert message.startswith(f"{PATH}.kv_cache_dtype:")
