"""From request bytes to what the request needs: parse, count, and the body to send.

:func:`plan_request` turns a client's body into a :class:`Counted` (the model, the
counted prompt, the output budget and the :class:`~kvgateway.core.demand.Demand` that
admission reserves); :func:`upstream_body` gives the bytes the node receives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from kvgateway.config.model import GatewayConfig, ModelConfig
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.errors import ModelNotFound
from kvgateway.server.openai_request import (
    Kind,
    ParsedRequest,
    parse_body,
    parse_chat,
    parse_completion,
)
from kvgateway.tokens.calibration import PromptCalibration
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.counting import PromptTokens, plan_chat, plan_completion

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's documented default


@dataclass(slots=True)
class Counted:
    model: ModelConfig
    parsed: ParsedRequest
    prompt: PromptTokens
    output_tokens: int
    demand: Demand


async def plan_request(
    raw: bytes,
    kind: Kind,
    config: GatewayConfig,
    counters: TokenCounters,
    calibration: PromptCalibration,
    block_size: Callable[[str], int],
) -> Counted:
    body = parse_body(raw)
    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    model = config.resolve_model(parsed.model)
    if model is None:
        raise ModelNotFound(
            f"The model `{parsed.model}` does not exist or you do not have access to it.",
            param="model",
        )
    counter = counters.for_tokenizer(model.tokenizer)
    if parsed.kind == "chat":
        prompt = await counter.count(plan_chat(body, model.tokenizer))
        default_out = config.admission.default_output_tokens
    else:
        plan, known = plan_completion(body["prompt"])
        prompt = await counter.count(plan, known)
        default_out = COMPLETIONS_DEFAULT_MAX_TOKENS
    output = parsed.requested_output or default_out
    margin = model.tokenizer.estimate_margin
    scaled_total = calibration.scaled(model.name, prompt.total, margin)
    scaled_longest = calibration.scaled(model.name, prompt.longest, margin)
    per_prompt = (
        [scaled_longest]
        if prompt.prompts == 1
        else _spread(scaled_total, scaled_longest, prompt.prompts)
    )
    demand = Demand(
        model=model.name,
        prompt_tokens=scaled_total,
        longest_prompt=scaled_longest,
        output_tokens=output,
        sequences=prompt.prompts * parsed.n,
        tokens=demand_tokens(per_prompt, output, parsed.n, block_size(model.name)),
    )
    return Counted(model, parsed, prompt, output, demand)


def _spread(total: int, longest: int, prompts: int) -> list[int]:
    # Batched completion prompts: the longest as itself, the others as their average;
    # the sum never falls below the counted total.
    rest = max(0, total - longest)
    others = prompts - 1
    return [longest] + [-(-rest // others)] * others


def upstream_body(counted: Counted, inject_output: bool) -> bytes | None:
    """The body to send, or None to forward the client's bytes unchanged."""
    body = counted.parsed.body
    changed = False
    if counted.parsed.model != counted.model.served_name:
        body["model"] = counted.model.served_name
        changed = True
    if inject_output and counted.parsed.requested_output is None and counted.parsed.kind == "chat":
        # vLLM's default for chat is "the rest of the context": cap it at what was
        # reserved, or the reservation would not hold.
        body[counted.parsed.output_field] = counted.output_tokens
        changed = True
    return json.dumps(body, separators=(",", ":")).encode() if changed else None
