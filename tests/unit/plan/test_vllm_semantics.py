"""A request reads as vLLM 0.32's OpenAI server reads it: the sequences it runs, the
output it may generate, the prompt it keeps and whether it reads the prefix cache (the
source lines are in each test). What the gateway reserves is then never less than what
the node allocates, and what the node would serve is not refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.model import GatewayConfig
from kvgateway.core.cache_view import BlocksStored
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.errors import BadRequest
from kvgateway.plan.budget import output_budget, prefix_hint
from kvgateway.plan.openai_request import parse_chat, parse_completion
from kvgateway.plan.planner import Planner, upstream_body
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.prompt_estimate import PromptCalibration

CONTEXT = 8_192
BLOCK = 16
MSG = [{"role": "user", "content": "hi"}]
IDS = list(range(100))


class _Fleet:
    def block_size(self, model: str) -> int:
        return BLOCK

    def largest_context(self, model: str) -> int:
        return CONTEXT


def _config(**admission: Any) -> GatewayConfig:
    backend = {"name": "a", "url": "http://127.0.0.1:9", "model": "m"}
    return parse_config(
        {
            "models": [{"name": "m"}],
            "admission": admission,
            "tiers": [{"name": "t", "backends": [backend]}],
        }
    )


@pytest.fixture
def planner() -> Iterator[Planner]:
    with ThreadPoolExecutor(1) as pool:
        yield Planner(_config, TokenCounters(EncodingCache(), pool), PromptCalibration(), _Fleet())


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        # chat_completion/protocol.py: echo with no prompt_logprobs takes top_logprobs (0)
        ("chat", {"messages": MSG, "echo": True}),
        # completion/protocol.py: echo with no prompt_logprobs takes logprobs, 0 included
        ("completion", {"prompt": IDS, "echo": True, "logprobs": 0}),
        ("chat", {"messages": MSG, "prompt_logprobs": 0}),
        ("completion", {"prompt": IDS, "prompt_logprob_token_ids": [1]}),
    ],
    ids=["chat-echo", "completion-echo-logprobs", "prompt-logprobs", "prompt-logprob-ids"],
)
def test_a_prompt_whose_logprobs_the_node_computes_gets_no_prefix_credit(
    kind: str, body: dict[str, Any]
) -> None:
    """Prompt logprobs, asked for or implied by echo, make vLLM skip reading its prefix
    cache (sampling_params.py, skip_reading_prefix_cache): the node allocates every
    prompt block, so none is credited as shared (keys stay, for placement)."""
    parse = parse_chat if kind == "chat" else parse_completion
    parsed = parse({"model": "m", **body})
    hint = prefix_hint(parsed, IDS, True, BLOCK, CONTEXT, None)
    assert hint.keys and not hint.credit


def test_a_completion_echoed_without_logprobs_keeps_its_credit() -> None:
    parsed = parse_completion({"model": "m", "prompt": IDS, "echo": True})
    assert prefix_hint(parsed, IDS, True, BLOCK, CONTEXT, None).credit


def test_best_of_is_not_read_and_n_sequences_are_reserved() -> None:
    """vLLM 0.32's CompletionRequest has no ``best_of`` (an extra field, ignored):
    ``n`` sequences run, whatever ``best_of`` says, even below ``n``."""
    assert parse_completion({"model": "m", "prompt": "hi", "best_of": 8}).sequences_per_prompt == 1
    parsed = parse_completion({"model": "m", "prompt": "hi", "n": 4, "best_of": 1})
    assert parsed.sequences_per_prompt == 4


def test_prompt_embeds_are_refused_with_a_clear_400() -> None:
    """vLLM runs ``prompt_embeds`` as prompts of their own beside ``prompt``; their
    lengths are in the tensors, so the gateway cannot reserve them and says so."""
    with pytest.raises(BadRequest) as err:
        parse_completion({"model": "m", "prompt": "hi", "prompt_embeds": "AAAA"})
    assert (err.value.param, err.value.code) == ("prompt_embeds", "unsupported_parameter")


def test_a_completions_null_n_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(BadRequest) as err:
        parse_completion({"model": "m", "prompt": "hi", "n": None})
    assert err.value.param == "n"


def test_a_chats_max_tokens_is_not_read_beside_max_completion_tokens() -> None:
    """vLLM reads ``max_tokens`` only without ``max_completion_tokens``
    (chat_completion/serving.py): a 0 there is served, with the latter's budget."""
    body = {"model": "m", "messages": MSG, "max_completion_tokens": 100, "max_tokens": 0}
    assert parse_chat(body).requested_output == 100


def test_a_completions_null_max_tokens_is_vllms_default() -> None:
    """completion/protocol.py normalize_null_max_tokens: null is 16, not the context."""
    parsed = parse_completion({"model": "m", "prompt": "hi", "max_tokens": None})
    assert output_budget(parsed, _config(inject_default_output=False), 10, CONTEXT) == (16, None)


async def test_an_injected_output_budget_is_never_below_min_tokens(planner: Planner) -> None:
    """The node refuses ``max_tokens`` below ``min_tokens`` (sampling_params.py): a chat
    with ``min_tokens`` 2000 and no budget is sent, and reserves, at least 2000."""
    raw = json.dumps({"model": "m", "messages": MSG, "min_tokens": 2000}).encode()
    plan = await planner.plan(raw, "chat")
    sent = json.loads(upstream_body(plan) or raw)
    assert sent[plan.parsed.output_field] >= 2000 and plan.output_tokens >= 2000


async def test_a_responses_null_truncation_truncates_as_auto_does(planner: Planner) -> None:
    """vLLM truncates a Responses input unless ``truncation`` is "disabled" (the
    default when absent): null truncates like "auto"."""

    def body(truncation: Any) -> bytes:
        return json.dumps(
            {"model": "m", "input": "word " * 12_000, "max_output_tokens": 100, **truncation}
        ).encode()

    auto = await planner.plan(body({"truncation": "auto"}), "responses")
    null = await planner.plan(body({"truncation": None}), "responses")
    assert auto.prompt.truncated and null.prompt.truncated
    assert null.demand.longest_prompt == auto.demand.longest_prompt
    absent = await planner.plan(body({}), "responses")  # "disabled": kept whole
    assert not absent.prompt.truncated
    assert absent.demand.longest_prompt > CONTEXT > null.demand.longest_prompt


def test_a_salted_prompt_is_keyed_as_vllm_hashes_it() -> None:
    """vLLM puts ``cache_salt`` in its first block's hash (and in that block's event, as
    extra keys ``(salt,)``): the prompt's keys match the node holding its salted blocks,
    not one holding the same prompt unsalted."""
    ids = list(range(1000, 1000 + BLOCK * 8 + 5))
    n = len(ids) // BLOCK
    index = PrefixIndex()
    tokens = tuple(ids[: n * BLOCK])
    plain = BlocksStored(tuple(range(1, n + 1)), None, tokens, BLOCK, extra_keys=(None,) * n)
    salted = BlocksStored(
        tuple(range(101, n + 101)), None, tokens, BLOCK, extra_keys=(("s",), *(None,) * (n - 1))
    )
    index.apply_events("plain", [plain], now=0.0)
    index.apply_events("salted", [salted], now=0.0)
    parsed = parse_completion({"model": "m", "prompt": ids, "cache_salt": "s"})
    hint = prefix_hint(parsed, ids, True, BLOCK, CONTEXT, None)
    assert hint.keys and not hint.credit
    assert index.matched_blocks("plain", hint.keys, now=0.0) == 0
    assert index.matched_blocks("salted", hint.keys, now=0.0) == len(hint.keys)


async def test_a_client_cannot_have_the_node_report_its_cache_again(planner: Planner) -> None:
    """``vllm_xargs.kv_cache_report_mode`` makes vLLM publish a block stored again at
    every cache hit but removed once: the gateway's view of the node would keep blocks it
    evicted. The node is sent the request without it (the other xargs kept)."""
    xargs = {"kv_cache_report_mode": "full", "other": 1}
    raw = json.dumps({"model": "m", "messages": MSG, "max_tokens": 8, "vllm_xargs": xargs})
    plan = await planner.plan(raw.encode(), "chat")
    sent = upstream_body(plan)
    assert sent is not None and json.loads(sent)["vllm_xargs"] == {"other": 1}
