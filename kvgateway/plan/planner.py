"""Plan, the first stage: from request bytes to what the request needs.

A :class:`Planner` turns a client's body into a :class:`Plan` (the model, the counted
prompt, the output budget and the :class:`~kvgateway.core.demand.Demand` that admission
reserves); :func:`upstream_body` gives the bytes the node receives. Nothing here does I/O
but the injected :class:`NodeCounter` (a node's own count, asked near a context limit).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvgateway.config.model import GatewayConfig, ModelConfig, Policy
from kvgateway.core.demand import Demand, demand_tokens
from kvgateway.core.output_model import ANY_KEY, OutputModel, z_of
from kvgateway.errors import BadRequest, ModelNotFound
from kvgateway.plan.budget import (
    learned_prompts,
    output_budget,
    output_is_set,
    prefix_hint,
    prompt_ids,
    reserved_prompts,
    truncated,
    truncates_to_fit,
    truncation,
    worth_asking,
)
from kvgateway.plan.openai_request import (
    Kind,
    Limits,
    ParsedRequest,
    parse_body,
    parse_chat,
    parse_completion,
    parse_responses,
)
from kvgateway.plan.stream_usage import UsageAsk, ask_node, usage_ask
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.node_count import NodeCount, readmission_prompt_tokens
from kvgateway.tokens.prompt_estimate import PromptCalibration, PromptEstimate
from kvgateway.tokens.responses_input import chat_body as responses_chat_body

log = logging.getLogger("kvgateway.plan")

OFF_LOOP_BYTES = 1024 * 1024


class FleetView(Protocol):
    """What planning reads of the fleet (:class:`kvgateway.core.fleet.Fleet`)."""

    def block_size(self, model: str) -> int: ...

    def largest_context(self, model: str) -> int: ...


class NodeCounter(Protocol):
    """A node's own count of a prompt (:class:`kvgateway.upstream.node_tokenize.NodeTokenizer`)."""

    async def count(
        self, model: ModelConfig, body: dict[str, Any], *, chat: bool
    ) -> int | None: ...


@dataclass(slots=True)
class Plan:
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


class Planner:
    """Owns the Plan stage: parsing, counting, the output budget and the demand.

    ``config`` is read per request (a reload swaps it); ``outputs`` gives learned output
    lengths (None: none are used); ``node_counter`` asks a node near a context limit
    (None: the stand-in's bound stands)."""

    def __init__(
        self,
        config: Callable[[], GatewayConfig],
        counters: TokenCounters,
        calibration: PromptCalibration,
        fleet: FleetView,
        *,
        node_counter: NodeCounter | None = None,
        outputs: OutputModel | None = None,
    ) -> None:
        self._config = config
        self._counters = counters
        self._calibration = calibration
        self._fleet = fleet
        self._node_counter = node_counter
        self._outputs = outputs

    async def plan(
        self, raw: bytes, kind: Kind, *, session: str | None = None, client: str = ANY_KEY
    ) -> Plan:
        """The plan for ``raw``; a :class:`~kvgateway.errors.GatewayError` for a request
        no node could serve (bad body, unknown model, a prompt past every context)."""
        config = self._config()
        counters, calibration, fleet = self._counters, self._calibration, self._fleet
        outputs = self._outputs
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
        body = parsed.body
        prefix_aware = config.routing.prefix_aware and config.routing.policy == Policy.KV_AWARE
        prompt, ids = await self._count(parsed, model, config, largest, len(raw), prefix_aware)
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
            and not output_is_set(parsed.body)
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
            clamp_risk=adm.clamp_risk
            if lengths is not None and adm.context_overflow == "clamp" and len(each) == 1
            else 0.0,
        )
        ask = usage_ask(parsed.kind, parsed.stream, body) if adm.node_stream_usage else None
        return Plan(model, parsed, prompt, output, demand, injected, reserved, sum(kv_prompts), ask)

    async def _count(
        self,
        parsed: ParsedRequest,
        model: ModelConfig,
        config: GatewayConfig,
        largest: int,
        raw_bytes: int,
        prefix_aware: bool,
    ) -> tuple[PromptEstimate, tuple[list[int] | None, bool]]:
        """The prompt's count (the node's own where the stand-in's bound comes near the
        largest context), and with prefix awareness its token ids for block keys."""
        estimator = self._counters.estimator_for(model.tokenizer)
        body = parsed.body
        ids: tuple[list[int] | None, bool] = (None, False)
        try:
            if parsed.kind == "completion":
                counted_body = body
            else:
                counted_body = body if parsed.kind == "chat" else responses_chat_body(body)
            counted = None
            if prefix_aware:
                # Before counting: the count then reads the ids' lengths.
                found, own, counted = await prompt_ids(
                    parsed, counted_body, model, self._counters, raw_bytes
                )
                ids = (found, own)
            if counted is not None:
                prompt = counted
            elif parsed.kind == "completion":
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
            self._node_counter is not None
            and not prompt.exact
            and prompt.prompts == 1
            and worth_asking(
                # What would be reserved: the bound, or the stand-in's count as the nodes'
                # reports scale it, whichever is more (either may pass a context the node's
                # own count fits).
                reserved_prompts(prompt, model, self._calibration)[0],
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
            exact = await self._node_counter.count(
                model, counted_body, chat=parsed.kind != "completion"
            )
            if exact is not None:
                prompt = node_counted(prompt, exact)
        return prompt, ids

    async def replan(self, plan: Plan, node: NodeCount, backend: str) -> Plan:
        """``plan`` with the count ``backend`` gave when it refused the prompt as too
        long, learned for calibration. A lower bound ("at least N") is never reserved as
        the count: a node with a longer context is asked for its own, else the most such
        a node can hold is reserved."""
        model = plan.model
        asked = None
        if node.at_least and self._node_counter is not None:
            body, chat = tokenize_request(plan)
            asked = await self._node_counter.count(model, body, chat=chat)
        tokens = readmission_prompt_tokens(
            node,
            asked=asked,
            largest_context=self._fleet.largest_context(model.name),
            output=plan.output_tokens,
        )
        if not node.at_least or asked is not None:
            self._calibration.observe(backend, model.name, plan.prompt.standin, tokens)
        how = (
            ""
            if not node.at_least
            else " (asked)"
            if asked is not None
            else " (the most it may be)"
        )
        log.info(
            "backend %s counted the prompt as %s%d tokens (the gateway %d): admitting again with %d%s",
            backend,
            "at least " if node.at_least else "",
            node.prompt_tokens,
            plan.prompt.longest,
            tokens,
            how,
        )
        return with_node_count(plan, tokens, self._fleet.block_size(model.name))


def tokenize_request(plan: Plan) -> tuple[dict[str, Any], bool]:
    """The body the prompt was counted from (a Responses request as the chat vLLM renders
    for it), and whether it is a chat: what a node's /tokenize is asked."""
    body = plan.parsed.body
    if plan.parsed.kind == "completion":
        return body, False
    return (body if plan.parsed.kind == "chat" else responses_chat_body(body)), True


def node_counted(prompt: PromptEstimate, count: int) -> PromptEstimate:
    """``prompt`` as the node counts it (one prompt)."""
    return replace(prompt, total=count, longest=count, each=(count,), exact=True, floor=count)


def with_node_count(plan: Plan, count: int, block_size: int) -> Plan:
    """``plan`` re-planned with the node's own count of its single prompt (from a
    context-length refusal): what a second admission reserves."""
    prompt = node_counted(plan.prompt, count)
    d = plan.demand
    demand = replace(
        d,
        prompt_tokens=count,
        longest_prompt=count,
        tokens=demand_tokens(
            [count], plan.output_tokens, plan.parsed.sequences_per_prompt, block_size
        ),
    )
    return replace(
        plan,
        prompt=prompt,
        demand=demand,
        reserved_prompt=count,
        reserved_output=plan.output_tokens,
    )


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


def upstream_body(plan: Plan, output_cut: int | None = None) -> bytes | None:
    """The body to send (with ``max_tokens`` cut to ``output_cut`` where the node's
    context cuts it), or None to forward the client's bytes unchanged."""
    body = dict(plan.parsed.body)  # a retry elsewhere starts from the client's own
    changed = False
    if plan.parsed.model != plan.model.served_name:
        body["model"] = plan.model.served_name
        changed = True
    output = output_cut if output_cut is not None else plan.injected_output
    if output is not None:
        body[plan.parsed.output_field] = output
        changed = True
    if plan.usage_ask is not None and not plan.usage_ask.continuous:
        ask_node(body)
        changed = True
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        # The node's KV events are the gateway's view of its cache: a client may not have
        # every cached block reported again (its view would keep blocks gone from the node).
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
        changed = True
    return json.dumps(body, separators=(",", ":")).encode() if changed else None
