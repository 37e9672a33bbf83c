"""From request bytes to what the request needs: parse, count, and the body to send.

:func:`plan_request` turns a client's body into a :class:`Counted` (the model, the
counted prompt, the output budget and the :class:`~kvgateway.core.demand.Demand` that
admission reserves); :func:`upstream_body` gives the bytes the node receives.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvgateway.config.model import GatewayConfig, ModelConfig, Policy
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.core.output_model import ANY_KEY, OutputModel, z_of
from kvgateway.errors import BadRequest, ModelNotFound
from kvgateway.server.node_tokenize import NodeTokenizer
from kvgateway.server.openai_request import (
    Kind,
    Limits,
    ParsedRequest,
    parse_body,
    parse_chat,
    parse_completion,
    parse_responses,
)
from kvgateway.server.prefix_hint import prefix_hint, prompt_ids
from kvgateway.server.stream_usage import UsageAsk, ask_node, usage_ask
from kvgateway.server.truncation import truncated, truncates_to_fit, truncation
from kvgateway.tokens.calibration import PromptCalibration
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.lax import flag, lax_int
from kvgateway.tokens.prompt_estimate import PromptEstimate
from kvgateway.tokens.responses_input import chat_body as responses_chat_body

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's documented default
OFF_LOOP_BYTES = 1024 * 1024


class FleetView(Protocol):
    """What planning reads of the fleet (:class:`kvgateway.core.fleet.Fleet`)."""

    def block_size(self, model: str) -> int: ...

    def largest_context(self, model: str) -> int: ...


@dataclass(slots=True)
class Counted:
    model: ModelConfig
    parsed: ParsedRequest
    prompt: PromptEstimate
    # Output tokens reserved per sequence.
    output_tokens: int
    demand: Demand
    # The max_tokens the gateway set because the client left it open (None: unchanged).
    injected_output: int | None = None
    # Output tokens reserved per sequence: output_tokens, or less when learned.
    reserved_output: int = 0
    # Prompt tokens KV is reserved for: the prompts' bounds, or less when learned.
    reserved_prompt: int = 0
    # A stream whose usage the node is asked for: what the client itself asked.
    usage_ask: UsageAsk | None = None


async def plan_request(
    raw: bytes,
    kind: Kind,
    config: GatewayConfig,
    counters: TokenCounters,
    calibration: PromptCalibration,
    fleet: FleetView,
    node_tokenizer: NodeTokenizer | None = None,
    session: str | None = None,
    outputs: OutputModel | None = None,
    client: str = ANY_KEY,
) -> Counted:
    limits = Limits(config.admission.max_messages, config.admission.max_content_parts)
    if len(raw) > OFF_LOOP_BYTES:
        # (A body of 800k messages never gets here: it is refused while it arrives.)
        # Parsing and validating a large body takes milliseconds of Python: not on the loop.
        loop = asyncio.get_running_loop()
        parsed, model = await loop.run_in_executor(
            counters.executor, _parse, raw, kind, config, limits
        )
    else:
        parsed, model = _parse(raw, kind, config, limits)
    # Counting stops once the prompt is certainly past the largest context on offer: it is
    # refused.
    largest = fleet.largest_context(model.name)
    estimator = counters.estimator_for(model.tokenizer)
    body = parsed.body
    prefix_aware = config.routing.prefix_aware and config.routing.policy == Policy.KV_AWARE
    ids: tuple[list[int] | None, bool] = (None, False)
    try:
        if parsed.kind == "completion":
            counted_body = body
        else:
            counted_body = body if parsed.kind == "chat" else responses_chat_body(body)
        if prefix_aware:
            # Before counting: the count then reads the ids' lengths.
            ids = await prompt_ids(parsed, counted_body, model, counters, len(raw))
        if parsed.kind == "completion":
            prompt = await estimator.completion(body, largest or None)
        else:
            prompt = await estimator.chat(counted_body, largest or None)
    except RecursionError as exc:
        # JSON nested to just under json.loads' limit goes deeper still when a value is
        # copied, dumped or rendered: a clean 400, not a 500.
        raise BadRequest(
            "A value in your request is nested too deeply to count.", code="invalid_value"
        ) from exc
    if (
        node_tokenizer is not None
        and not prompt.exact
        and prompt.prompts == 1
        and node_tokenizer.worth_asking(
            # What would be reserved: the bound, or the stand-in's count as the nodes'
            # reports scale it, whichever is more (either may pass a context the node's
            # own count fits).
            reserved_prompts(prompt, model, calibration)[0],
            prompt.floor,
            parsed.requested_output or 1,
            largest,
            # A node that cuts max_tokens serves any prompt with one token of room: its
            # count decides the cut (and whether the prompt fits at all).
            fit_output=1 if config.admission.context_overflow == "clamp" else None,
        )
    ):
        # The bound comes near (or past) the largest context while the node's count may
        # still fit: the node's own count decides.
        exact = await node_tokenizer.count(model, counted_body, chat=parsed.kind != "completion")
        if exact is not None:
            prompt = node_counted(prompt, exact)
    # truncate_prompt_tokens: the node keeps each prompt's last `keep` tokens; -1 (and
    # a Responses request's truncation "auto"): as many as fit beside the output.
    # Only on per-prompt counts: a batch counted past the limit is one lump (its prompts
    # unknown), cut to one prompt's size it would reserve for one sequence of many.
    per_prompt = len(prompt.each) == prompt.prompts
    keep = truncation(body, prompt.longest) if per_prompt else 0
    if keep == 0 and per_prompt and largest and truncates_to_fit(parsed):
        if config.admission.context_overflow == "clamp":
            # vLLM >= 0.32 keeps all but one token of the context, then cuts max_tokens
            # to the one left (renderers/params.py max_truncation_tokens).
            fit = largest - 1
        else:
            # The output the node gets: asked for, or the default as for a short prompt
            # (the prompt is cut to make room for it, not the output to the leftover).
            fit = largest - output_budget(parsed, config, 0, largest)[0]
        keep = fit if 0 < fit < prompt.longest else 0
    if 0 < keep < prompt.longest:
        prompt = truncated(prompt, keep)
    each = reserved_prompts(prompt, model, calibration)
    if prompt.truncated:
        each = [min(n, keep) for n in each]
    longest = max(each)
    adm = config.admission
    learned = (
        adm.output_reservation == "learned"
        and not parsed.echo_only
        and not _output_is_set(parsed.body)
    )
    # KV is reserved for each prompt's bound, or in learned mode for what the nodes'
    # reports predict; the context fit keeps the bound either way (the node checks it).
    kv_prompts = learned_prompts(prompt, model, calibration, each) if learned else each
    output, injected = output_budget(parsed, config, longest, largest)
    block = fleet.block_size(model.name)
    n = parsed.sequences_per_prompt
    reserved = output
    # Every prompt's sequences rounded to whole blocks on their own, as vLLM does.
    tokens = demand_tokens(kv_prompts, output, n, block)
    # Admission by the projected peak needs every replica's sequences: with a shared
    # ledger each request holds its whole bound.
    projected = adm.kv_projection and not config.ledger.url
    lengths = None
    if projected and learned and outputs is not None and adm.preemption_risk > 0:
        # The bound stays max_tokens (the node enforces it); learned lengths say when a
        # running stream is likely to end before it.
        lengths = outputs.group(model.name, client, output)
    prefix = None
    if prefix_aware:
        prefix = prefix_hint(parsed, *ids, block, longest, session)
    demand = Demand(
        model=model.name,
        prompt_tokens=sum(each),
        longest_prompt=longest,
        output_tokens=output,
        sequences=len(each) * n,
        tokens=tokens,
        prefix=prefix,
        projected=projected,
        lengths=lengths,
        z=z_of(adm.preemption_risk) if lengths is not None else 0.0,
        prefix_credit=adm.prefix_credit,
        seen=parsed.stream,
    )
    ask = usage_ask(parsed.kind, parsed.stream, body) if adm.node_stream_usage else None
    return Counted(model, parsed, prompt, output, demand, injected, reserved, sum(kv_prompts), ask)


def _output_is_set(body: dict[str, Any]) -> bool:
    """Does the request fix its output length, so that no learned length applies?
    ``ignore_eos`` runs to ``max_tokens`` (unless a stop string ends it), ``min_tokens``
    sets a floor the learned lengths know nothing of: both reserve ``max_tokens``."""
    min_tokens = lax_int(body.get("min_tokens"))
    return flag(body, "ignore_eos", False) or (min_tokens is not None and min_tokens > 0)


def tokenize_request(counted: Counted) -> tuple[dict[str, Any], bool]:
    """The body the prompt was counted from (a Responses request as the chat vLLM renders
    for it), and whether it is a chat: what a node's /tokenize is asked."""
    body = counted.parsed.body
    if counted.parsed.kind == "completion":
        return body, False
    return (body if counted.parsed.kind == "chat" else responses_chat_body(body)), True


def node_counted(prompt: PromptEstimate, count: int) -> PromptEstimate:
    """``prompt`` as the node counts it (one prompt)."""
    return replace(prompt, total=count, longest=count, each=(count,), exact=True, floor=count)


def with_node_count(counted: Counted, count: int, block_size: int) -> Counted:
    """``counted`` re-planned with the node's own count of its single prompt (from a
    context-length refusal): what a second admission reserves."""
    prompt = node_counted(counted.prompt, count)
    d = counted.demand
    demand = replace(
        d,
        prompt_tokens=count,
        longest_prompt=count,
        tokens=demand_tokens(
            [count], counted.output_tokens, counted.parsed.sequences_per_prompt, block_size
        ),
    )
    return replace(
        counted,
        prompt=prompt,
        demand=demand,
        reserved_prompt=count,
        reserved_output=counted.output_tokens,
    )


def reserved_prompts(
    prompt: PromptEstimate, model: ModelConfig, calibration: PromptCalibration
) -> list[int]:
    """What to reserve for each prompt. The model's own count is exact and taken as it is.
    Otherwise the stand-in's bound, and never less than what the nodes' reports say the
    stand-in's count grows to (calibration: template overhead, tokenizer ratio)."""
    each = list(prompt.each or (prompt.total,))
    if prompt.exact:
        return each
    margin = model.tokenizer.estimate_margin
    if len(each) == 1:
        return [max(each[0], calibration.scaled(model.name, prompt.standin, margin))]
    return [calibration.scaled(model.name, n, margin) for n in each]


# Usage reports of a model before learned mode reserves prompts by what they predict.
LEARNED_PROMPT_SAMPLES = 50


def learned_prompts(
    prompt: PromptEstimate,
    model: ModelConfig,
    calibration: PromptCalibration,
    bounds: list[int],
) -> list[int]:
    """KV to reserve for a single prompt in learned mode: the nodes' predicted count of
    it (template overhead and tokenizer ratio learned from their usage reports) instead
    of the worst-case vocabulary bound, never more than the bound; the bound until
    :data:`LEARNED_PROMPT_SAMPLES` reports were seen. Exact counts and batched prompts
    (already reserved by the prediction) stay as they are."""
    if prompt.exact or prompt.uncalibrated or prompt.truncated or len(bounds) != 1:
        return bounds  # no stand-in count to predict from (standin 0 or cut)
    margin = model.tokenizer.estimate_margin
    guess = calibration.learned(model.name, prompt.standin, margin, LEARNED_PROMPT_SAMPLES)
    return bounds if guess is None else [min(bounds[0], guess)]


def _parse(
    raw: bytes, kind: Kind, config: GatewayConfig, limits: Limits
) -> tuple[ParsedRequest, ModelConfig]:
    # Too many messages was refused while the body arrived (body.read_limited).
    body = parse_body(raw, limits, messages=False)
    if kind == "chat":
        parsed = parse_chat(body, limits)
    elif kind == "responses":
        parsed = parse_responses(body, limits)
    else:
        parsed = parse_completion(body)
    model = config.resolve_model(parsed.model)
    if model is None:
        raise ModelNotFound(
            f"The model `{parsed.model}` does not exist or you do not have access to it.",
            param="model",
        )
    return parsed, model


def output_budget(
    parsed: ParsedRequest, config: GatewayConfig, prompt_bound: int, largest_context: int
) -> tuple[int, int | None]:
    """Output tokens to reserve per sequence, and the ``max_tokens`` to send when the
    client left it open or asked for more than the largest context leaves (None: the
    body goes unchanged).

    A client-given budget is kept, unless it does not fit beside the prompt in the
    largest context but does fit the context itself: with ``admission.context_overflow:
    clamp`` (vLLM >= 0.32) it is cut to what the context leaves, as the node would cut
    it. Left open (absent or ``null``), vLLM would allow "the
    rest of the context" (chat, and completions with an explicit null) or 16
    (completions, absent): the gateway sends the node what it reserves, the default capped
    at what the largest context leaves after the prompt, so the cap never turns a request
    the node could serve into a 400. With ``inject_default_output: false`` the body goes
    unchanged and the gateway reserves what vLLM would allow.
    """
    if parsed.echo_only:
        return 1, None  # vLLM schedules one token for an echo of the prompt
    requested = parsed.requested_output
    if requested is not None:
        left = largest_context - prompt_bound
        if (
            config.admission.context_overflow == "clamp"
            and largest_context
            and 0 < left < requested <= largest_context
        ):
            # vLLM >= 0.32 serves it with max_tokens cut to what the context leaves
            # (get_max_tokens); the node is sent the cut, so the reservation holds
            # whatever its count of the prompt.
            return left, left
        return requested, None
    room = max(1, largest_context - prompt_bound) if largest_context else None
    explicit_null = parsed.output_field in parsed.body and parsed.body[parsed.output_field] is None
    if parsed.kind != "completion":
        default = config.admission.default_output_tokens
        vllm_allows = room
    else:
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
        vllm_allows = room if explicit_null else COMPLETIONS_DEFAULT_MAX_TOKENS
    if not config.admission.inject_default_output:
        return (vllm_allows or default), None
    budget = min(default, room) if room is not None else default
    return budget, budget


def upstream_body(counted: Counted) -> bytes | None:
    """The body to send, or None to forward the client's bytes unchanged."""
    body = counted.parsed.body
    changed = False
    if counted.parsed.model != counted.model.served_name:
        body["model"] = counted.model.served_name
        changed = True
    if counted.injected_output is not None:
        body[counted.parsed.output_field] = counted.injected_output
        changed = True
    if counted.usage_ask is not None and not counted.usage_ask.continuous:
        ask_node(body)
        changed = True
    return json.dumps(body, separators=(",", ":")).encode() if changed else None
