"""Live output accounting: output tokens counted as they stream, per request and node.

A streamed answer is counted by the node itself where it reports usage on every chunk
(:mod:`kvgateway.server.stream_usage`), else chunk by chunk
(:func:`count_stream_tokens`: one choice object per generated token, as vLLM streams
when it keeps up; role announcements excepted; up to 1 + ``num_speculative_tokens`` per
choice where the backend decodes speculatively, a bound that never passes the request's
``max_tokens``),
so each in-flight request's real KV footprint (prompt + output so far) is known now,
not only its worst case, and :meth:`OutputAccounting.statistics` sums it per node.

With ``admission.output_reservation: learned`` a request reserves less than its
``max_tokens``: its expected output, and its node a pooled margin for all of them
(:mod:`kvgateway.core.output_risk`). Every half block of a stream's count goes to
admission (:meth:`Admission.progress`), which recomputes the node's margin from what
every stream on it has generated, putting the stream a block ahead of its output (so
at least half a block ahead until the next recount) before the node must hold it. That may push the node past its budget: it then takes no new
work until requests end. A reservation planned without a pooled outlook (the learned
quantile of the per-request view) grows by itself instead (one block per sequence at a
time, :meth:`Admission.grow`). Whatever a finished request generated (``usage`` at the
end, else the count) teaches the :class:`~kvgateway.core.output_model.OutputModel`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from kvgateway.core.output_model import ANY_KEY, OutputModel
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
    """One streaming request's output so far, against what its reservation covers."""

    reservation: Reservation
    prompt_tokens: int
    sequences: int
    reserved_output: int  # per sequence
    block_size: int
    generated: int = 0  # over all sequences
    # Tokens one streamed choice may carry: 1, or 1 + num_speculative_tokens where the
    # node decodes speculatively (a step then emits up to that many at once).
    tokens_per_event: int = 1
    # At most this many per sequence (its max_tokens): the count of a speculative
    # stream is a bound, and never grows past the output the request may have.
    max_output: int = 0
    grown: int = 0  # tokens added to the reservation
    # Pooled: the per-sequence count at which the node's margin is next recomputed.
    next_progress: int = 1
    # The count is the node's own (per-chunk usage), not counted from the chunks.
    reported: bool = False

    @property
    def exact(self) -> bool:
        """The count is the output itself, not a bound of it."""
        return self.reported or self.tokens_per_event == 1

    @property
    def footprint(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class OutputAccounting:
    """Every in-flight stream's live count, and the learned output model."""

    model: OutputModel = field(default_factory=OutputModel)
    _live: dict[int, LiveRequest] = field(default_factory=dict)

    def start(
        self,
        r: Reservation,
        prompt_tokens: int,
        sequences: int,
        reserved_output: int,
        block: int,
        *,
        max_output: int = 0,
        tokens_per_event: int = 1,
    ) -> LiveRequest:
        live = LiveRequest(
            r,
            prompt_tokens,
            max(1, sequences),
            reserved_output,
            block,
            tokens_per_event=max(1, tokens_per_event),
            max_output=max_output,
        )
        self._live[r.id] = live
        return live

    def on_events(self, live: LiveRequest, events: bytes, reported: int | None = None) -> None:
        """Count a run of streamed events (or take ``reported``, the node's own count of
        the output so far); grow the reservation ahead of the output."""
        if reported is not None:
            live.reported = True
            live.generated = reported
        else:
            live.generated += count_stream_tokens(events) * live.tokens_per_event
        if live.max_output:
            live.generated = min(live.generated, live.max_output * live.sequences)
        r = live.reservation
        per_seq = -(-live.generated // live.sequences)
        if r.outlook is not None:
            # Every half block, not every read: the margin keeps a stream a block ahead,
            # so it stays ahead in between, at a fraction of the CPU (the node's sums
            # change, and with them its book, on every call).
            if per_seq >= live.next_progress and not r.released:
                live.grown += r.owner.progress(r, per_seq)
                live.next_progress = per_seq + max(1, live.block_size // 2)
            return
        covered = live.reserved_output + live.grown // live.sequences
        if live.max_output and covered >= live.max_output:
            return  # covers all a sequence may generate (max_tokens mode, or grown there)
        if per_seq >= covered and not r.released:
            # Blocks enough to be ahead again: one read may bring many tokens at once; never
            # past what max_tokens needs.
            blocks = (per_seq - covered) // live.block_size + 1
            if live.max_output:
                blocks = min(blocks, -(-(live.max_output - covered) // live.block_size))
            extra = blocks * live.sequences * live.block_size
            r.owner.grow(r, extra)
            live.grown += extra

    def end(self, live: LiveRequest) -> None:
        self._live.pop(live.reservation.id, None)

    def learn(self, model: str, key: str, max_tokens: int, output_per_seq: int) -> None:
        self.model.observe(model, key, max_tokens, output_per_seq)

    def statistics(self) -> dict[str, int]:
        """Live KV footprint (prompt + output so far) of in-flight streams, per node."""
        out: dict[str, int] = {}
        for live in self._live.values():
            name = live.reservation.backend.name
            out[name] = out.get(name, 0) + live.footprint
        return out
