"""The gateway's default mode against what vLLM 0.32 itself runs (transformers 5.19):
vLLM's ``get_tokenizer`` and its renderer's developer-role rewrite, called in vLLM's own
virtualenv (``transformers5_oracle.py``), on directories of the real vocabularies under
the tokenizer classes the gateway models, with and without a ``config.json``.

transformers 5 rebuilds a class's pipeline (Qwen2's NFC and split regex, Llama's
Metaspace, Gemma's space replacement, GPT-NeoX's and Cohere's NFC...) from the file's
vocabulary and merges, keeps the file's post-processor whatever ``add_bos_token`` says,
and chooses the class by model type first where the two disagree; the gateway's 4.x
rules get these directories wrong (test_vs_transformers.py checks those against 4.57).
"""

from __future__ import annotations

import json
import subprocess
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvgateway.tokens import transformers5
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.roles import as_system
from tests.support.real_fleet import require_vllm
from tests.support.real_models import VLLM_VENV

# One worker asks the oracle and runs every test that reads it: the others never wait.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("transformers5-oracle")]

ORACLE = Path(__file__).with_name("transformers5_oracle.py")
TEXTS = [
    "Hello world, this is a test.",
    " leading space and  double  spaces\n\n\tTabs   end ",
    unicodedata.normalize("NFD", "Café résumé naïve 한국어 Việt Nam"),
    "<|im_start|>user\nhi<|im_end|> <s>[INST] x [/INST] <|begin_of_text|>y</s> <bos><pad>",
    "1234567890 3.14159 0xDEADBEEF",
    "中文文本，日本語のテキスト 😀🎉 ﬁ",
]
# name: (vocabulary, tokenizer_config.json changes (None removes), config.json model_type,
# whether tokenizer.json loses its normalizer).
VARIANTS: dict[str, tuple[str, dict[str, Any], str | None, bool]] = {
    "qwen-no-nfc": ("qwen", {}, None, True),
    "qwen-no-nfc-by-model-type": ("qwen", {"tokenizer_class": None}, "qwen2", True),
    "qwen-generic-class-qwen2-type": (
        "qwen",
        {"tokenizer_class": "PreTrainedTokenizerFast"},
        "qwen2",
        True,
    ),
    "qwen3.5": ("qwen", {"tokenizer_class": "Qwen3_5Tokenizer"}, None, True),
    "gpt2": ("qwen", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}, None, False),
    "gpt2-granite-type": ("qwen", {"tokenizer_class": "GPT2Tokenizer"}, "granite", False),
    "gpt-neox": ("qwen", {"tokenizer_class": "GPTNeoXTokenizer"}, None, True),
    "cohere": ("qwen", {"tokenizer_class": "CohereTokenizer"}, None, True),
    "llama-fast-deepseek-type": ("qwen", {"tokenizer_class": "LlamaTokenizerFast"}, "deepseek_v3", False),
    "llama3-no-bos-flag": ("llama3", {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}, "llama", False),
    "tekken": ("tekken", {"tokenizer_class": "PreTrainedTokenizerFast"}, "mistral", False),
    "sp-llama": ("sentencepiece", {}, None, False),
    "sp-llama-no-bos-flag": ("sentencepiece", {"add_bos_token": False, "add_eos_token": True}, None, False),
    "sp-llama-legacy": ("sentencepiece", {"legacy": True}, None, False),
    "sp-llama-type-only": ("sentencepiece", {"tokenizer_class": None}, "llama", False),
    "sp-code-llama": ("sentencepiece", {"tokenizer_class": "CodeLlamaTokenizer"}, None, False),
    "sp-gemma": ("sentencepiece", {"tokenizer_class": "GemmaTokenizer"}, None, False),
    "sp-gpt-neox": ("sentencepiece", {"tokenizer_class": "GPTNeoXTokenizer"}, None, False),
}  # fmt: skip

TEMPLATE_WITHOUT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
TEMPLATE_WITH = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "developer", "content": "be brief", "tools": None}, {"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "later", "tools": [{"type": "function"}]},
        {"role": "assistant", "content": "ok"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "text", "text": "q"}], "name": "u"},
    ],
    [{"role": "user", "content": "no developer"}, {"role": "system", "content": "late"}],
    [{"role": "developer", "content": "only", "name": "dev", "tools": None}],
]  # fmt: skip


def _variant(root: Path, name: str, base: Path) -> Path:
    _, changes, model_type, no_normalizer = VARIANTS[name]
    directory = root / name
    directory.mkdir()
    if no_normalizer:
        spec = json.loads((base / "tokenizer.json").read_text())
        spec["normalizer"] = None
        (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    else:
        (directory / "tokenizer.json").symlink_to(base / "tokenizer.json")
    config = json.loads((base / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type is not None:
        (directory / "config.json").write_text(
            json.dumps({"model_type": model_type, "architectures": ["X"]})
        )
    return directory


@pytest.fixture(scope="session")
def oracle(
    vocab_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """vLLM's answers for every variant, the tables and the conversations: one oracle
    run for the whole test run (the module's tests share one xdist worker)."""
    require_vllm()
    root = tmp_path_factory.mktemp("t5")
    dirs = {n: _variant(root, n, vocab_dirs(v[0])) for n, v in VARIANTS.items()}
    jobs: list[dict[str, Any]] = [{"dir": str(d), "texts": TEXTS} for d in dirs.values()]
    jobs.append({"tables": True})
    for template in (TEMPLATE_WITHOUT, TEMPLATE_WITH):
        jobs += [{"developer": c, "template": template} for c in CONVERSATIONS]

    stdout = subprocess.run(
        [str(VLLM_VENV / "bin" / "python"), str(ORACLE)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout
    answers = json.loads(stdout.strip().splitlines()[-1])
    n = len(dirs)
    return {
        "dirs": dirs,
        "tokenizers": dict(zip(dirs, answers[:n], strict=True)),
        "tables": answers[n],
        "developer": answers[n + 1 :],
    }


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_directories_load_as_vllm_with_transformers_5_loads_them(
    name: str,
    oracle: dict[str, Any],
    encodings: EncodingCache,
) -> None:
    """Same class, same named special tokens (what a template sees), same ids with and
    without special tokens. On the 4.x rules a Qwen2Tokenizer directory without NFC
    counts NFD text ~1.4x the node, a Llama-class SentencePiece directory counts text
    after a special token one more, add_bos_token false drops a BOS the node adds..."""
    directory = oracle["dirs"][name]
    want = oracle["tokenizers"][name]
    tok = encodings.model(str(directory))
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    model = json.loads(p.read_text()) if (p := directory / "config.json").exists() else {}
    assert (transformers5.tokenizer_class(cfg, model) or "TokenizersBackend") == want["class"]
    assert dict(tok.template_tokens) == want["special"]
    for text, (with_special, without) in zip(TEXTS, want["ids"], strict=True):
        assert tok.encode_prompt(text) == with_special, text
        assert tok.encode_prompt(text, add_special_tokens=False) == without, text


@pytest.mark.timeout(1200)
def test_model_type_tables_are_transformers_5s(oracle: dict[str, Any]) -> None:
    mapping: dict[str, str] = oracle["tables"]["mapping"]
    known = {cls: tuple(sorted(t for t, c in mapping.items() if c == cls)) for cls in transformers5._MODEL_TYPES_OF_CLASS}  # fmt: skip
    assert {c: tuple(sorted(t)) for c, t in transformers5._MODEL_TYPES_OF_CLASS.items()} == known
    generic = {"TokenizersBackend", "PreTrainedTokenizerFast", "MistralCommonBackend"}
    assert {t for t, c in mapping.items() if c in generic} == transformers5.GENERIC_MODEL_TYPES
    assert set(oracle["tables"]["registered_wins"]) == transformers5.REGISTERED_WINS


@pytest.mark.timeout(1200)
def test_developer_messages_reach_the_template_as_vllm_hands_them(
    oracle: dict[str, Any],
) -> None:
    jobs = [(c, t) for t in (TEMPLATE_WITHOUT, TEMPLATE_WITH) for c in CONVERSATIONS]
    for (conversation, template), want in zip(jobs, oracle["developer"], strict=True):
        assert as_system(conversation, template) == want, conversation
