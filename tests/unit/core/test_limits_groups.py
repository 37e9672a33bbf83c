"""KV-cache groups of a discovered node: from vLLM >= 0.32's own capacity when nothing
else says, from the model's architecture when its directory is known."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgateway.config.load import parse_config
from kvgateway.core.backends import Observed, kv_groups_from_capacity, resolve_limits
from kvgateway.core.derived_limits import derive_all


def test_groups_from_the_nodes_capacity() -> None:
    # One group: 64 blocks hold 2 requests of 4,096 tokens (vLLM logs 8,192 tokens).
    assert kv_groups_from_capacity(64, 128, 4096, 8192) == 1
    # A context that is not a whole number of blocks still reads as one group.
    assert kv_groups_from_capacity(65, 128, 4000, int(65 / 32 * 4000)) == 1
    # Gemma 3 (a sliding window of 512 beside full attention): 32 + 21 blocks a request.
    assert kv_groups_from_capacity(64, 128, 4096, 4946) == 2
    assert kv_groups_from_capacity(64, 128, 4096, None) is None


def test_a_hybrid_pool_holds_a_block_of_each_group_per_token_block() -> None:
    cfg = parse_config(
        {
            "models": [{"name": "m"}],
            "tiers": [
                {"name": "t", "backends": [{"name": "a", "url": "http://x:1", "model": "m"}]}
            ],
        }
    ).backends[0]
    seen = Observed(max_model_len=4096, kv_cache_tokens=8064, block_size=128, num_gpu_blocks=64)
    one = resolve_limits(cfg, seen, None)
    hybrid = resolve_limits(cfg, Observed(**{**_fields(seen), "kv_groups": 2}), None)
    assert (one.kv_groups, one.kv_cache_tokens.value) == (1, 8064)
    assert (hybrid.kv_groups, hybrid.kv_cache_tokens.value) == (2, 31 * 128)


def test_groups_from_a_model_directory(tmp_path: Path, vocab_dirs: Callable[[str], Path]) -> None:
    """A tokenizer directory that is the model's directory (its config.json beside the
    tokenizer) gives the groups vLLM forms for its layers."""
    model = tmp_path / "gemma"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).symlink_to(vocab_dirs("qwen") / name)
    (model / "config.json").write_text(json.dumps(GEMMA3))
    doc: dict[str, Any] = {
        "models": [{"name": "m", "tokenizer": {"path": str(model)}}],
        "tiers": [{"name": "t", "backends": [{"name": "a", "url": "http://x:1", "model": "m"}]}],
    }
    assert derive_all(parse_config(doc)) == {"a": Observed(kv_groups=2)}
    del doc["models"][0]["tokenizer"]
    assert derive_all(parse_config(doc)) == {}


GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 512,
    "vocab_size": 151936,
    "intermediate_size": 256,
}


def _fields(o: Observed) -> dict[str, Any]:
    return {k: getattr(o, k) for k in o.__dataclass_fields__}
