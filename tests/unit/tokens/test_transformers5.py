"""Counting as a node on vLLM >= 0.19 (transformers 5) counts, the gateway's default; and
``tokenizer.transformers: 4`` for older nodes. (test_vs_transformers5.py checks the same
rules against vLLM's own code.)"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.yamlread import ConfigError
from kvgateway.tokens.chat_template import TemplateError
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.responses_input import chat_body
from kvgateway.tokens.transformers5 import tokenizer_class

# Loads real vocabularies (and transformers): the slow tier.
pytestmark = pytest.mark.slow

Dirs = Callable[[str], Path]
NFD = unicodedata.normalize("NFD", "Café résumé naïve, Ångström, 한국어 텍스트, tiếng Việt. " * 8)


def _qwen_without_nfc(base: Path, directory: Path) -> Path:
    """A Qwen2Tokenizer directory whose tokenizer.json has no normalizer."""
    directory.mkdir()
    spec = json.loads((base / "tokenizer.json").read_text())
    spec["normalizer"] = None
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text((base / "tokenizer_config.json").read_text())
    return directory


def test_qwen2_class_normalizes_to_nfc_whatever_the_file_says(
    vocab_dirs: Dirs,
    tmp_path: Path,
    encodings: EncodingCache,
) -> None:
    """transformers 5's Qwen2Tokenizer builds its own NFC normalizer: NFD text costs what
    its NFC form does (one NFD prompt: 231 tokens on a node, 331 without NFC). With
    transformers 4 (the file as it is) the decomposed accents cost extra tokens."""
    directory = _qwen_without_nfc(vocab_dirs("qwen"), tmp_path / "qwen")
    nfc = unicodedata.normalize("NFC", NFD)
    for engine in ("auto", "tokenizers"):
        tok = encodings.model(str(directory), engine=engine)
        assert len(tok.encode_prompt(NFD)) == len(tok.encode_prompt(nfc))
        old = encodings.model(str(directory), engine=engine, transformers=4)
        assert len(old.encode_prompt(NFD)) > 1.3 * len(old.encode_prompt(nfc))
    counter = ExactCounter(encodings.model(str(directory)))
    chat = {"messages": [{"role": "user", "content": NFD}]}
    assert counter.count_chat_sync(chat) == len(counter.prompt_ids(chat))


@pytest.mark.parametrize(
    ("cfg", "model", "want"),
    [
        ({"tokenizer_class": "Qwen2Tokenizer"}, {"model_type": "qwen2"}, "Qwen2Tokenizer"),
        # qwen2's registered class overrules the hub's.
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, {"model_type": "qwen2"}, "Qwen2Tokenizer"),
        ({}, {"model_type": "qwen3"}, "Qwen2Tokenizer"),
        # A model type registered with the generic class: the hub's class is not used.
        ({"tokenizer_class": "LlamaTokenizerFast"}, {"model_type": "deepseek_v3"}, ""),
        ({"tokenizer_class": "GPT2Tokenizer"}, {"model_type": "granite"}, ""),
        ({"tokenizer_class": "GPTNeoXTokenizer"}, {"model_type": "olmo2"}, ""),
        # Registered otherwise, not overruling: the hub's.
        ({"tokenizer_class": "Qwen2Tokenizer"}, {"model_type": "gemma3_text"}, "Qwen2Tokenizer"),
        ({"tokenizer_class": "LlamaTokenizerFast"}, {"model_type": "llama"}, "LlamaTokenizer"),
        ({}, {"model_type": "llama", "tokenizer_class": "LlamaTokenizer"}, "LlamaTokenizer"),
        ({}, {"model_type": "llama"}, ""),  # transformers 5 registers no class for llama
        ({}, {"model_type": "gemma3"}, "GemmaTokenizer"),
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, {"model_type": "mistral"}, ""),
        # vLLM loads the generic class for these model types.
        ({"tokenizer_class": "LlamaTokenizer"}, {"model_type": "internlm2"}, ""),
        ({"tokenizer_class": "BertTokenizer"}, {}, ""),  # a class these rules do not know
    ],
)
def test_the_class_transformers_5_loads(
    cfg: dict[str, Any], model: dict[str, Any], want: str
) -> None:
    assert tokenizer_class(cfg, model) == want


def test_developer_message_renders_as_system_for_a_template_without_the_role(
    vocab_dirs: Dirs,
) -> None:
    """vLLM >= 0.19 hands a template that does not name the developer role a system
    message (rendering the developer role as such would count 5 under the node)."""
    directory = str(vocab_dirs("qwen"))
    body = {
        "messages": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
        ]
    }
    new = ExactCounter(EncodingCache().model(directory))
    text = new.render_chat(body).text
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    assert "You are a helpful assistant." not in text
    old = ExactCounter(EncodingCache().model(directory, transformers=4))
    with pytest.raises(TemplateError, match="Unknown role: developer"):
        old.render_chat(body)  # older nodes answer 400
    assert new.count_chat_sync(body) == len(new.prompt_ids(body))


def test_responses_instructions_and_developer_input_become_one_system_message(
    vocab_dirs: Dirs,
) -> None:
    counter = ExactCounter(EncodingCache().model(str(vocab_dirs("qwen"))))
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "No emoji."}]},
            {"role": "user", "content": "Hi"},
        ],
    }
    text = counter.render_chat(chat_body(body)).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\nNo emoji.<|im_end|>\n")
    assert text.count("<|im_start|>system") == 1


def test_templates_see_named_special_tokens_only(
    vocab_dirs: Dirs, tmp_path: Path, encodings: EncodingCache
) -> None:
    """transformers 5's special_tokens_map has the named tokens, not the extra ones."""
    base = vocab_dirs("qwen")
    directory = tmp_path / "extra"
    directory.mkdir()
    (directory / "tokenizer.json").symlink_to(base / "tokenizer.json")
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    config["chat_template"] = "{{ additional_special_tokens | default('none') }} {{ eos_token }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    body = {"messages": [{"role": "user", "content": "x"}]}
    new = ExactCounter(encodings.model(str(directory)))
    assert new.render_chat(body).text == "none <|im_end|>"
    old = ExactCounter(encodings.model(str(directory), transformers=4))
    assert old.render_chat(body).text == "['<|im_start|>', '<|im_end|>'] <|im_end|>"


def test_config_names_the_nodes_transformers(vocab_dirs: Dirs) -> None:
    def config(**tokenizer: Any) -> dict[str, Any]:
        return {
            "models": [{"name": "m", "tokenizer": {"path": str(vocab_dirs("qwen")), **tokenizer}}],
            "tiers": [
                {"name": "t", "backends": [{"name": "b", "url": "http://h:1", "model": "m"}]}
            ],
        }

    encodings = EncodingCache()
    default = parse_config(config(), encodings=encodings).models[0].tokenizer
    assert default.transformers == 5 and default.model is not None
    assert default.model.transformers == 5
    old = parse_config(config(transformers=4), encodings=encodings).models[0].tokenizer
    assert old.model is not None and old.model.transformers == 4
    with pytest.raises(
        ConfigError, match=r"models\[0\]\.tokenizer\.transformers: expected an integer from 4 to 5"
    ):
        parse_config(config(transformers=3), encodings=encodings)
