"""Live output accounting: output tokens counted as they stream, per request.

A streamed answer is counted by the node itself where it reports usage on every chunk
(:mod:`kvgateway.plan.stream_usage`), else chunk by chunk
(:func:`count_stream_tokens`: one choice object per generated token, as vLLM streams
when it keeps up; role announcements excepted; up to 1 + ``num_speculative_tokens`` per
choice where the backend decodes speculatively, a bound that never passes the request's
``max_tokens``). Each count goes to admission as the request's progress
(:meth:`~kvgateway.core.reservation.Reservation.progress`): a request admitted by the
projected peak is then projected from where the node says it is. What a finished
request generated (``usage`` at the end, else the count) is settled and learned by
:mod:`kvgateway.server.settle`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from kvgateway.core.output_model import ANY_KEY
from kvgateway.core.reservation import Reservation

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


def client_key(authorization: str) -> str:
    """A stable, non-secret id of the client's API key (the learning groups' key)."""
    token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
    if not token:
        return ANY_KEY
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:12]


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
