"""Run by vLLM's own interpreter (``.venv-vllm``): what a vLLM node with transformers 5
makes of tokenizer directories and conversations. Reads a JSON list of jobs on stdin and
prints one JSON list of answers (test_vs_transformers5.py is the caller).

Jobs:

- ``{"dir": D, "texts": [...]}``: the tokenizer vLLM loads for D (``get_tokenizer``), its
  class, its named special tokens, and each text's ids with and without special tokens;
- ``{"tables": true}``: transformers' model-type mapping and the model types whose
  registered class overrules the hub's;
- ``{"developer": conversation, "template": T}``: the conversation vLLM's renderer hands
  the template T (developer messages as system ones where T does not know the role).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.disable(logging.WARNING)


def tokenizer_job(job: dict[str, Any]) -> dict[str, Any]:
    from vllm.tokenizers import get_tokenizer  # type: ignore[import-not-found]  # oracle venv only
    from vllm.transformers_utils import repo_utils  # type: ignore[import-not-found]

    # A directory without a model config fails vLLM's config lookup, which it retries
    # after 2 s in case a hub cache refresh hid the file: a local directory's answer does
    # not change, so the oracle retries at once. The tokenizer it loads is the same.
    max_retries, _, fatal = repo_utils.with_retry.__defaults__
    repo_utils.with_retry.__defaults__ = (max_retries, 0, fatal)

    tok = get_tokenizer(job["dir"])
    cls = type(tok)
    if cls.__name__.startswith("Cached"):  # vLLM's caching subclass
        cls = cls.__mro__[1]
    ids = [
        [
            tok(text, add_special_tokens=True)["input_ids"],
            tok(text, add_special_tokens=False)["input_ids"],
        ]
        for text in job["texts"]
    ]
    return {"class": cls.__name__, "special": tok.special_tokens_map, "ids": ids}


def tables_job() -> dict[str, Any]:
    from transformers.models.auto import tokenization_auto as auto

    return {
        "mapping": {k: v for k, v in auto.TOKENIZER_MAPPING_NAMES.items() if isinstance(v, str)},
        # transformers 5 only (the oracle's venv); this venv has transformers 4.
        "registered_wins": sorted(auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS),  # type: ignore[attr-defined]
    }


def developer_job(job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm.renderers import hf  # type: ignore[import-not-found]  # oracle venv only

    conversation = job["developer"]
    if any(m["role"] == "developer" for m in conversation) and not (
        hf._detect_developer_role_support(job["template"])
    ):
        conversation = hf._consolidate_system_messages(
            hf._convert_developer_to_system(conversation)
        )
    return list(conversation)


def main() -> None:
    out: list[Any] = []
    for job in json.load(sys.stdin):
        if "dir" in job:
            out.append(tokenizer_job(job))
        elif "tables" in job:
            out.append(tables_job())
        else:
            out.append(developer_job(job))
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
