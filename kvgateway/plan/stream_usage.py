"""The node's own output count on every stream, whatever the client asked for.

Counting a stream's chunks tells the generated tokens only while vLLM sends one token
per chunk. It often does not: ``--stream-interval N`` sends N at a time; an API server
that falls behind its engine merges what piled up into one chunk
(``RequestOutputCollector`` in ``vllm/v1/engine/output_processor.py``); a tool-call or
reasoning parser holds tokens back without a chunk; a speculative node emits several per
step. So every chat and completions stream is sent to the node with
``stream_options: {include_usage: true, continuous_usage_stats: true}``: each chunk then
carries its choice's ``completion_tokens`` so far, and the stream ends with a usage-only
chunk (``"choices": []``). :class:`UsageTap` reads them, and takes out of the relayed
bytes what the client did not ask for: the per-chunk ``usage`` objects unless it asked
for continuous usage, the final usage chunk unless it asked for ``include_usage``.

A node that ignores the options (not vLLM) sends no usage: the chunk count stands in.
No I/O here.

Where the node sends no usage, a stream is counted chunk by chunk
(:func:`count_stream_tokens`: one choice object per generated token, as vLLM streams
when it keeps up; role announcements excepted; up to 1 + ``num_speculative_tokens`` per
choice where the backend decodes speculatively, a bound that never passes the request's
``max_tokens``). Either count goes to admission as the request's progress
(:class:`LiveRequest`, :meth:`~kvgateway.core.reservation.Reservation.progress`): a
request admitted by the projected peak is then projected from where the node says it
is. What a finished request generated is settled and learned by
:class:`~kvgateway.server.exchange.Settle`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvgateway.core.reservation import Reservation
from kvgateway.tokens.plans import lax_bool

_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,15})(?!\d)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,15})(?!\d)')
# A usage object inside a chunk (one level of nesting: the *_tokens_details objects).
# Inside a JSON string a quote is escaped, so this never matches generated text.
_USAGE_FIELD = re.compile(rb',\s*"usage"\s*:\s*(?:null|\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_FINGERPRINT = re.compile(rb'"system_fingerprint"\s*:\s*("(?:[^"\\]|\\.)*")')
_CHOICE_INDEX = re.compile(rb'"choices"\s*:\s*\[\s*\{\s*"index"\s*:\s*(\d{1,9})(?!\d)')
# Counting chunks where the node sends no usage: choice objects, role announcements.
_CHOICE = re.compile(rb'"index"\s*:')
_ROLE = re.compile(rb'"role"\s*:')
# A streamed tool call's own index, as vLLM writes a DeltaToolCall (id, type, index,
# function): not a choice. (Written in another order it is counted: an over-count.)
_TOOL_CALL_INDEX = re.compile(rb'"index"\s*:\s*\d+\s*,\s*"function"')
# The Responses API streams one delta event per token (text, reasoning, tool arguments).
_RESPONSES_DELTA = re.compile(
    rb'"type"\s*:\s*"response\.(?:output_text|reasoning_text|reasoning_summary_text'
    rb'|function_call_arguments)\.delta"'
)


def _without_usage(events: bytes) -> bytes:
    """``events`` without their chunks' usage objects: found as vLLM writes them
    (compact JSON), else by the general pattern."""
    at = events.find(b',"usage":')
    if at < 0:
        return _USAGE_FIELD.sub(b"", events)
    parts = []
    start = 0
    while at >= 0:
        m = _USAGE_FIELD.match(events, at)
        if m is None:  # not a usage object (a usage key of something else)
            at = events.find(b',"usage":', at + 1)
            continue
        parts.append(events[start:at])
        start = m.end()
        at = events.find(b',"usage":', start)
    parts.append(events[start:])
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class UsageAsk:
    """What the client's own ``stream_options`` asked for."""

    include_usage: bool
    continuous: bool


def usage_ask(kind: str, stream: bool, body: dict[str, Any]) -> UsageAsk | None:
    """The client's ask, for a stream whose usage the gateway asks the node for (chat and
    completions); None for anything else."""
    if not stream or kind not in ("chat", "completion"):
        return None
    opts = body.get("stream_options")
    opts = opts if isinstance(opts, dict) else {}
    include = lax_bool(opts.get("include_usage")) is True
    return UsageAsk(include, include and lax_bool(opts.get("continuous_usage_stats")) is True)


def ask_node(body: dict[str, Any]) -> None:
    """Set ``body``'s stream options to bring the node's counts (see the module)."""
    opts = body.get("stream_options")
    opts = dict(opts) if isinstance(opts, dict) else {}
    opts["include_usage"] = True
    opts["continuous_usage_stats"] = True
    body["stream_options"] = opts


class UsageTap:
    """One stream's node-reported output so far; :meth:`feed` returns what to relay."""

    def __init__(self, ask: UsageAsk, choices: int = 1) -> None:
        self._ask = ask
        self._one_choice = choices == 1
        self._per_choice: dict[int, int] = {}
        self.final = b""  # the usage-only chunk, once it came
        self._held = b""  # a finish chunk and what followed it, waiting for the usage chunk
        # The node's count of the prompt, from the first usage it reported.
        self.prompt_tokens: int | None = None

    @property
    def completion_tokens(self) -> int | None:
        """Output generated so far over all choices, as the node counts; None while the
        node has reported nothing."""
        if not self._per_choice:
            return None
        return sum(self._per_choice.values())

    def feed(self, events: bytes) -> bytes:
        """Read a run of complete SSE events; the same events without what the client
        did not ask for. A client that did not ask for usage gets the node's
        ``system_fingerprint`` where the node alone puts it, on the finish chunk: vLLM
        moves it to the usage chunk the gateway asked for, so a lone choice's finish
        chunk waits for that chunk (they come one after the other) and takes it."""
        out = self._strip(events)
        if self._ask.include_usage or not self._one_choice:
            return out
        head = b""
        if self._held:
            self._held += out
        else:
            at = out.find(b'"finish_reason":"')
            if at < 0:
                return out
            start = max(0, out.rfind(b"data:", 0, at))
            head, self._held = out[:start], out[start:]
        if self.final or b"[DONE]" in self._held:
            return head + self._stamped()
        return head

    def flush(self) -> bytes:
        """What :meth:`feed` still holds (the stream ended without its usage chunk)."""
        held, self._held = self._held, b""
        return held

    def _stamped(self) -> bytes:
        held = self.flush()
        fp = _FINGERPRINT.search(self.final)
        end = held.find(b"\n\n")
        close = held.rfind(b"}", 0, end if end >= 0 else len(held))
        if fp is None or close < 0 or b'"system_fingerprint"' in held[:close]:
            return held
        return held[:close] + b',"system_fingerprint":' + fp.group(1) + held[close:]

    def _strip(self, events: bytes) -> bytes:
        if self.prompt_tokens is None and b'"prompt_tokens"' in events:
            m = _PROMPT.search(events)
            if m is not None:
                self.prompt_tokens = int(m.group(1))
        if self._ask.continuous or b'"usage"' not in events:
            if self._ask.continuous and b'"usage"' in events:
                self._read(events)
            return events
        if self._one_choice and b"[]" not in events:
            # The common run (one choice, no final chunk): its last count is the count,
            # and the usage objects are taken out where they are found.
            at = events.rfind(b'"completion_tokens"')
            m = _COMPLETION.match(events, at) if at >= 0 else None
            if m is not None:
                self._per_choice[0] = int(m.group(1))
            return _without_usage(events)
        out = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            if b'"usage"' not in event:
                out.append(event)
                continue
            if _NO_CHOICES.search(event):
                self._read_final(event)
                if self._ask.include_usage:
                    out.append(event)
                continue
            self._read_chunk(event)
            out.append(_without_usage(event))
        return b"".join(e + b"\n\n" for e in out)

    def _read(self, events: bytes) -> None:
        for event in events.split(b"\n\n"):
            if b'"usage"' not in event:
                continue
            if _NO_CHOICES.search(event):
                self._read_final(event)
            else:
                self._read_chunk(event)

    def _read_chunk(self, event: bytes) -> None:
        m = _COMPLETION.search(event)
        if m is None:
            return
        at = _CHOICE_INDEX.search(event)
        i = int(at.group(1)) if at is not None else 0
        n = int(m.group(1))
        if n > self._per_choice.get(i, 0) or i not in self._per_choice:
            self._per_choice[i] = n

    def _read_final(self, event: bytes) -> None:
        self.final = event + b"\n\n"
        m = _COMPLETION.search(event)
        if m is not None:
            # The node's total over every choice: the count from here on.
            self._per_choice = {0: int(m.group(1))}


def count_stream_tokens(events: bytes) -> int:
    """Output tokens in a run of SSE events (an over-count never an under-count of
    vLLM's one-token chunks: a finish-only chunk counts as one). Chat and completions
    chunks are counted by their choices, Responses events by their deltas."""
    indexes = len(_CHOICE.findall(events))
    if b'"tool_calls"' in events:
        indexes -= len(_TOOL_CALL_INDEX.findall(events))
    chat = max(0, indexes - len(_ROLE.findall(events)))
    if b"response." not in events:
        return chat
    return chat + len(_RESPONSES_DELTA.findall(events))


@dataclass(eq=False, slots=True)
class LiveRequest:
    """One streaming request's output so far."""

    reservation: Reservation
    sequences: int
    generated: int = 0  # over all sequences
    # Tokens one streamed choice may carry: 1, or 1 + num_speculative_tokens where the
    # node decodes speculatively (a step then emits up to that many at once).
    tokens_per_event: int = 1
    # At most this many per sequence (its max_tokens): the count of a speculative
    # stream is a bound, and never grows past the output the request may have.
    max_output: int = 0
    # The count is the node's own (per-chunk usage), not counted from the chunks.
    reported: bool = False
    # The per-sequence count admission last heard.
    told: int = -1

    @property
    def exact(self) -> bool:
        """The count is the output itself, not a bound of it."""
        return self.reported or self.tokens_per_event == 1

    def feed(self, events: bytes, reported: int | None = None, prompt: int | None = None) -> None:
        """Count a run of streamed events (or take ``reported``, the node's own count of
        the output so far) and tell admission how far each sequence has come (and the
        node's count of the prompt, ``prompt``, when it gave one)."""
        if reported is not None:
            self.reported = True
            self.generated = reported
        else:
            self.generated += count_stream_tokens(events) * self.tokens_per_event
        if self.max_output:
            self.generated = min(self.generated, self.max_output * self.sequences)
        per_seq = -(-self.generated // self.sequences)
        if per_seq > self.told and (per_seq > 0 or self.reported):
            self.told = per_seq
            self.reservation.progress(per_seq, prompt)


def live_request(
    r: Reservation, sequences: int, *, max_output: int = 0, tokens_per_event: int = 1
) -> LiveRequest:
    """The live count of a stream relayed on ``r`` (``sequences`` choices)."""
    return LiveRequest(
        r, max(1, sequences), tokens_per_event=max(1, tokens_per_event), max_output=max_output
    )
