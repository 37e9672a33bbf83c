"""Loading tokenizer directories: engine choice, BOS/EOS, templates, and clear errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.yamlread import ConfigError
from kvgateway.tokens.bytelevel import (
    MergeProofs,
    NotExact,
    _check_merges,
    split_pattern,
    token_bytes,
    unicode_to_byte,
)
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.exact import ExactCounter
from kvgateway.tokens.modeldir import TokenizerDirError
from tests.support import vocab

# Loads real vocabularies (and transformers): the slow tier.
pytestmark = pytest.mark.slow

Dirs = Callable[[str], Path]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_byte_alphabet_is_a_bijection() -> None:
    table = unicode_to_byte()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["A"] == ord("A")


def test_merge_checks_catch_what_tiktoken_would_do_differently() -> None:
    vocab = {chr(0x100 + b): b for b in range(3)} | {"a": 97, "b": 98, "c": 99}
    vocab |= {"ab": 256, "abc": 257}
    _check_merges([["a", "b"], ["ab", "c"]], vocab)
    with pytest.raises(NotExact, match="not a listed merge"):
        _check_merges([["a", "b"]], vocab)  # tiktoken makes abc from ab + c: not listed
    # Extra merges (every split, as transformers writes them) are fine.
    _check_merges([["a", "b"], ["ab", "c"], ["a", "bc"], ["b", "c"]], vocab | {"bc": 999})
    vocab["bc"] = 258
    with pytest.raises(NotExact, match="order"):
        _check_merges([["a", "b"], ["b", "c"], ["ab", "c"], ["a", "bc"]], vocab)
    # A token merging cannot reach is only ever a whole pre-tokenized piece: exact only
    # if tokenizers also looks pieces up whole (ignore_merges, as Llama 3's).
    whole = {"a": 97, "b": 98, "c": 99, "abc": 300}
    with pytest.raises(NotExact, match="unreachable"):
        _check_merges([], whole)
    _check_merges([], whole, ignore_merges=True)
    with pytest.raises(NotExact, match="makes no token"):
        _check_merges(["c a"], vocab)
    with pytest.raises(NotExact, match="alphabet"):
        token_bytes("\u4e2d")


class _Watched(dict[str, int]):
    """A vocabulary that counts the check's passes over its tokens."""

    passes = 0

    def __iter__(self) -> Iterator[str]:
        self.passes += 1
        return super().__iter__()


def test_merge_proofs_check_each_vocabulary_and_merge_list_once() -> None:
    """The same input is checked once and gets the same verdict, a failure included;
    any change to what the check reads is checked anew."""
    proofs = MergeProofs()
    vocab = _Watched({"a": 97, "b": 98, "c": 99, "ab": 256, "abc": 257})
    merges: list[Any] = [["a", "b"], ["ab", "c"]]
    for _ in range(2):
        proofs.check(merges, vocab, ignore_merges=False)
    assert vocab.passes == 1
    for _ in range(2):
        with pytest.raises(NotExact, match="not a listed merge"):
            proofs.check([["a", "b"]], vocab, ignore_merges=False)
    assert vocab.passes == 2
    proofs.check(merges, vocab, ignore_merges=True)
    assert vocab.passes == 3
    vocab["bc"] = 258
    with pytest.raises(NotExact, match="not a listed merge"):
        proofs.check(merges, vocab, ignore_merges=False)  # no listed merge makes bc
    assert vocab.passes == 4


def test_split_patterns() -> None:
    assert "\\p{L}" in split_pattern({"type": "ByteLevel", "use_regex": True})
    with pytest.raises(NotExact):
        split_pattern({"type": "Metaspace"})
    with pytest.raises(NotExact):
        split_pattern({"type": "ByteLevel", "add_prefix_space": True})


def test_missing_and_inconsistent_directories(
    tmp_path: Path, vocab_dirs: Dirs, encodings: EncodingCache
) -> None:
    with pytest.raises(TokenizerDirError, match="does not exist"):
        encodings.model(str(tmp_path / "nope"))
    with pytest.raises(TokenizerDirError, match=r"neither tokenizer\.json"):
        encodings.model(str(tmp_path))
    # A special token that is no token of the vocabulary is added as one, as
    # transformers adds it (the next free id), not refused.
    new_bos = _copy(vocab_dirs("tekken"), tmp_path / "bos")
    _edit_config(new_bos, bos_token="<|begin|>")
    tok = encodings.model(str(new_bos))
    assert len(tok.engine.encode("<|begin|>")) == 1
    assert tok.engine.encode("<|begin|>")[0] >= 131_072  # past Tekken's vocabulary
    bad_template = _copy(vocab_dirs("tekken"), tmp_path / "tpl")
    _edit_config(bad_template, chat_template="{% for m in messages %}")
    with pytest.raises(TokenizerDirError, match="chat template"):
        encodings.model(str(bad_template))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerDirError, match="cannot read"):
        encodings.model(str(broken))


def test_a_bad_path_is_a_config_error_naming_the_yaml_path(tmp_path: Path) -> None:
    data = {
        "models": [{"name": "m", "tokenizer": {"path": str(tmp_path / "missing")}}],
        "tiers": [{"name": "t", "backends": [{"name": "b", "url": "http://h:1", "model": "m"}]}],
    }
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith("models[0].tokenizer.path: ")


def test_config_path_loads_the_tokenizer(vocab_dirs: Dirs) -> None:
    data = {
        "models": [{"name": "m", "tokenizer": {"path": str(vocab_dirs("tekken"))}}],
        "tiers": [{"name": "t", "backends": [{"name": "b", "url": "http://h:1", "model": "m"}]}],
    }
    cfg = parse_config(data)
    tok = cfg.models[0].tokenizer
    assert tok.path == str(vocab_dirs("tekken"))
    assert tok.model is not None and tok.model.prefix == (1,)


def test_add_bos_token_overrides_the_post_processor_of_llama_style_classes_only(
    tmp_path: Path,
    vocab_dirs: Dirs,
    encodings: EncodingCache,
) -> None:
    """transformers 4.x: LlamaTokenizerFast (and Gemma's, Cohere's) rebuild the
    post-processor from add_bos_token / add_eos_token; the generic class keeps
    tokenizer.json's (BOS <s> = 1 here) whatever the config says."""
    directory = _copy(vocab_dirs("tekken"), tmp_path / "nobos")
    _edit_config(directory, add_bos_token=False, add_eos_token=True)
    tok = encodings.model(str(directory), transformers=4)
    assert tok.prefix == (1,) and tok.suffix == ()
    _edit_config(directory, tokenizer_class="LlamaTokenizerFast")
    tok = encodings.model(str(directory), transformers=4)
    assert tok.prefix == () and tok.suffix == (2,)
    assert tok.encode_prompt("hi")[-1] == 2
    # Silent config, Llama class: BOS and no EOS by the class's defaults.
    _edit_config(directory, add_bos_token=None, add_eos_token=None)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config = {k: v for k, v in config.items() if v is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = encodings.model(str(directory), transformers=4)
    assert tok.prefix == (1,) and tok.suffix == ()


def test_transformers_5_keeps_the_post_processor_of_every_class(
    tmp_path: Path,
    vocab_dirs: Dirs,
    encodings: EncodingCache,
) -> None:
    """transformers 5 drops add_bos_token / add_eos_token beside a tokenizer.json: the
    file's post-processor decides for every class (BOS <s> = 1 here), except GPT-NeoX's,
    which builds one that adds neither."""
    directory = _copy(vocab_dirs("sentencepiece"), tmp_path / "sp5")
    _edit_config(directory, add_bos_token=False, add_eos_token=True)
    for cls in ("LlamaTokenizerFast", "GemmaTokenizer", "PreTrainedTokenizerFast"):
        _edit_config(directory, tokenizer_class=cls)
        tok = encodings.model(str(directory))
        assert (tok.prefix, tok.suffix) == ((1,), ()), cls
    _edit_config(directory, tokenizer_class="LlamaTokenizerFast")
    assert encodings.model(str(directory), transformers=4).prefix == ()
    _edit_config(directory, tokenizer_class="GPTNeoXTokenizer", add_bos_token=True)
    tok = encodings.model(str(directory))
    assert (tok.prefix, tok.suffix) == ((), ())


def test_template_files_and_named_templates(
    tmp_path: Path, vocab_dirs: Dirs, encodings: EncodingCache
) -> None:
    directory = _copy(vocab_dirs("qwen"), tmp_path / "named")
    _edit_config(
        directory,
        chat_template=[
            {"name": "default", "template": "D{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
        ],
    )
    counter = ExactCounter(encodings.model(str(directory)))
    msgs = [{"role": "user", "content": "x"}]
    assert counter.render_chat({"messages": msgs}).text == "Dx"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert counter.render_chat({"messages": msgs, "tools": tools}).text == "T1"
    (directory / "chat_template.jinja").write_text("J{{ messages | length }}")
    counter = ExactCounter(encodings.model(str(directory)))
    assert counter.render_chat({"messages": msgs}).text == "J1"
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    counter = ExactCounter(encodings.model(str(directory)))
    # vLLM prefers a processor's template unless the request has tools.
    assert counter.render_chat({"messages": msgs}).text == "P"
    assert counter.render_chat({"messages": msgs, "tools": tools}).text == "T1"


def test_a_tiktoken_file_with_its_pattern(
    tmp_path: Path, vocab_dirs: Dirs, encodings: EncodingCache
) -> None:
    directory = tmp_path / "qwen-tiktoken"
    directory.mkdir()
    src = vocab._site("dashscope") / "resources" / "qwen.tiktoken"
    shutil.copy(src, directory / "qwen.tiktoken")
    with pytest.raises(TokenizerDirError, match="split pattern"):
        encodings.model(str(directory))
    base = len(vocab.qwen_ranks())
    config = {
        "eos_token": "<|im_end|>",
        "added_tokens_decoder": {
            str(base): {"content": "<|endoftext|>"},
            str(base + 1): {"content": "<|im_start|>"},
            str(base + 2): {"content": "<|im_end|>"},
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = encodings.model(str(directory), pattern=vocab.QWEN_PATTERN)
    reference = encodings.model(str(vocab_dirs("qwen")), engine="tokenizers")
    text = "<|im_start|>user\nPrices: 12345.678 USD, naïve café 東京 🙂<|im_end|>\n"
    assert tok.engine.encode(text) == reference.engine.encode(text)


def test_which_tokenizers_can_count_pieces_apart() -> None:
    from kvgateway.tokens.engines import _position_independent

    assert _position_independent({"pre_tokenizer": None, "added_tokens": []})
    first = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}
    assert not _position_independent({"pre_tokenizer": first})
    always = {"type": "Sequence", "pretokenizers": [{**first, "prepend_scheme": "always"}]}
    assert _position_independent({"pre_tokenizer": always})
    assert not _position_independent({"added_tokens": [{"content": "<x>", "lstrip": True}]})


def test_reloads_reuse_an_unchanged_directory(tmp_path: Path, vocab_dirs: Dirs) -> None:
    directory = _copy(vocab_dirs("sentencepiece"), tmp_path / "sp")
    data = {
        # transformers 4.x, whose Llama class reads add_bos_token (5 ignores it).
        "models": [{"name": "m", "tokenizer": {"path": str(directory), "transformers": 4}}],
        "tiers": [{"name": "t", "backends": [{"name": "b", "url": "http://h:1", "model": "m"}]}],
    }
    encodings = EncodingCache()
    first = parse_config(data, encodings=encodings).models[0].tokenizer.model
    again = parse_config(data, encodings=encodings).models[0].tokenizer.model
    assert first is not None and again is first
    _edit_config(directory, add_bos_token=False)
    changed = parse_config(data, encodings=encodings).models[0].tokenizer.model
    assert changed is not first and changed is not None and changed.prefix == ()
