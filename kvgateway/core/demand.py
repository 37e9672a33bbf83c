"""What one request needs from a backend, and whether a backend could ever give it.

:func:`can_ever_hold` is the one definition of "this backend could hold this request if
it were idle" (context, KV budget and sequence slots), used by routing, the routing
index and admission's queue claims alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvgateway.core.backends import Backend
from kvgateway.core.flight import FIRST_CHUNK_TOKENS, Flight, ahead_of, delayed
from kvgateway.core.output_model import LearnedLengths
from kvgateway.core.projection import NodeProjection
from kvgateway.errors import ContextLengthExceeded


@dataclass(frozen=True, slots=True)
class PrefixHint:
    """What prefix-aware routing knows of a request's prompt: the chained keys of its
    full blocks (:func:`kvgateway.core.prefix_keys.block_keys`, at ``block_size``) and a
    session id (``x-session-id`` or the body's ``user``) as an affinity hint."""

    keys: tuple[int, ...]
    block_size: int
    session: str | None = None
    # The keys are the node's own (its ids, nothing hashed in that they lack): blocks
    # an in-flight request holds may be credited. Else they only guide routing.
    credit: bool = True


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request needs, in KV tokens and sequence slots."""

    model: str
    prompt_tokens: int
    longest_prompt: int
    output_tokens: int
    sequences: int
    tokens: int
    # Backends that already failed this request: treated as down for it.
    exclude: frozenset[str] = frozenset()
    # Backends held for earlier waiters: unavailable now, but still this request's
    # preferred tier (so claims never push a request onto the offload tier).
    busy: frozenset[str] = frozenset()
    # Who asks (a tenant name from the config): its class and fair share order the queue.
    tenant: str = ""
    # Set when routing.prefix_aware is on (kv_aware): where the prompt's blocks may be cached.
    prefix: PrefixHint | None = None
    # Admitted by the projected KV peak (core/projection.py), not by ``tokens`` (which
    # stays the whole bound: tenants' shares, context checks, whole-life admission).
    projected: bool = False
    # Learned output lengths of such requests (output_reservation: learned), read when
    # it is admitted; and the z-score of the accepted preemption risk the projection is
    # checked at.
    lengths: LearnedLengths | None = None
    z: float = 0.0
    # admission.prefix_credit: prompt blocks a started request on the node holds are
    # counted once.
    prefix_credit: bool = True
    # Its progress is seen while it runs (a stream): where it is in its answer is known.
    # A non-streamed answer runs unseen and holds its whole bound (Flight.seen).
    seen: bool = True
    # Slots of a node (name, max_num_seqs) that other classes' floors keep from this
    # request there (Tenancy.kept_on); None: no floor concerns it.
    kept_slots: Callable[[str, int], float] | None = None
    # admission.clamp_risk (one prompt, learned lengths, context_overflow: clamp): a
    # node whose context leaves less than ``output_tokens`` beside the prompt may serve
    # it with max_tokens cut to what it leaves, when such answers pass that cut with at
    # most this chance (0: never). See :func:`served_as`.
    clamp_risk: float = 0.0

    @property
    def longest_sequence(self) -> int:
        return self.longest_prompt + self.output_tokens

    @property
    def shortest_output(self) -> int:
        """The least output a node's context may leave it (``output_tokens`` unless
        learned answers allow a cut)."""
        if self.clamp_risk and self.lengths is not None:
            cut = self.lengths.shortest_cut(self.clamp_risk)
            if cut is not None:
                return min(cut, self.output_tokens)
        return self.output_tokens

    @property
    def cut_pending(self) -> bool:
        """A node's context may cut this request once its group has learned enough
        answers, and it has not yet (:attr:`shortest_output` is still ``output_tokens``)."""
        return bool(self.clamp_risk) and self.lengths is not None and self.lengths.learning

    @property
    def room_floor(self) -> int:
        """Free tokens a backend must have now for this request to fit there at all."""
        return self.sequences if self.projected else self.tokens


def demand_tokens(prompt_lengths: Sequence[int], output_tokens: int, n: int, block: int) -> int:
    """KV tokens a request can occupy: every sequence's prompt and output, in whole blocks.

    vLLM allocates KV in blocks of ``block`` tokens per sequence, so each sequence's
    ``prompt + output`` is rounded up to a block.
    """
    total = 0
    for p in prompt_lengths:
        seq = p + output_tokens
        total += n * (-(-seq // block) * block)
    return total


def fits_limits(context_limit: int, budget_tokens: int, max_num_seqs: int, d: Demand) -> bool:
    """Limits of this size could hold ``d`` (the shape the routing index keeps per tier):
    exact for a demand no context may cut (as :func:`served_as` gives it), otherwise a
    necessary condition only."""
    least = d.shortest_output
    return (
        context_limit >= d.longest_prompt + least
        and (least < d.output_tokens or budget_tokens >= d.tokens)
        and max_num_seqs >= d.sequences
    )


def cut_to(d: Demand, context_limit: int, block: int) -> Demand | None:
    """``d`` as a node with this context serves it: unchanged where prompt and output
    fit; with its output cut to what the context leaves (vLLM >= 0.32 cuts
    ``max_tokens`` so; the gateway sends the cut) where its learned answers allow that
    cut (:attr:`Demand.shortest_output`); None where the node cannot serve it."""
    if d.longest_sequence <= context_limit:
        return d
    if not d.clamp_risk:
        return None
    cut = context_limit - d.longest_prompt
    if cut < 1 or cut < d.shortest_output:
        return None
    # One prompt's sequences, each in whole blocks: the context's worth at most, or
    # (a prompt reserved below its bound) what it held less the output cut off.
    each = min(d.tokens // d.sequences - (d.output_tokens - cut), context_limit)
    tokens = d.sequences * (-(-each // block) * block)
    return replace(d, output_tokens=cut, tokens=tokens, clamp_risk=0.0)


def served_as(b: Backend, d: Demand) -> Demand | None:
    """``d`` as ``b`` would serve it (:func:`cut_to` at its context), None if it cannot."""
    return cut_to(d, b.context_limit, b.limits.block_size)


def tokens_on(b: Backend, d: Demand) -> int:
    """KV tokens ``d`` takes on ``b``: its own (as ``b`` serves it), plus speculative
    decoding's lookahead slots for each of its sequences (in whole blocks) where ``b``
    runs a draft model."""
    return _with_lookahead(b, served_as(b, d) or d)


def _with_lookahead(b: Backend, served: Demand) -> int:
    k = b.config.num_speculative_tokens
    if not k:
        return served.tokens
    block = b.limits.block_size
    return served.tokens + served.sequences * (-(-k // block) * block)


def can_ever_hold(b: Backend, d: Demand) -> bool:
    """``b`` could hold ``d`` if it were idle: limits known and large enough (health,
    pauses and current reservations aside)."""
    limits = b.limits
    if not limits.known:
        return False
    budget = b.budget_tokens
    context = min(b.max_model_len, budget)  # b.context_limit, its limits known
    served = cut_to(d, context, limits.block_size)
    return (
        served is not None
        and fits_limits(context, budget, b.max_num_seqs, served)
        and budget >= _with_lookahead(b, served)
    )


def flight_for(b: Backend, d: Demand, fid: int = 0) -> Flight:
    """``d`` as a flight on ``b``'s projection: its prompt blocks (the one holding the
    last prompt token is never shared: the node recomputes it), the leading ones an
    admitted flight there holds credited, and a draft model's lookahead held ahead."""
    d = served_as(b, d) or d
    block = b.limits.block_size
    keys: tuple[int, ...] = ()
    credited = 0
    hint = d.prefix
    if hint is not None and hint.credit and hint.block_size == block and d.sequences == 1:
        keys = hint.keys[: max(0, (d.longest_prompt - 1) // block)]
        credited = b.projection.creditable(keys) if d.prefix_credit else 0
    return Flight(
        fid,
        d.longest_prompt,
        d.sequences,
        d.output_tokens,
        keys=keys,
        credited=credited,
        scheduled=min(len(keys), FIRST_CHUNK_TOKENS // block),
        shape=d.lengths.shape if d.lengths is not None else None,
        ahead=ahead_of(b.config.num_speculative_tokens),
        rate=1 + b.config.num_speculative_tokens,
        seen=d.seen,
    )


def projected_budget(b: Backend) -> int:
    """Blocks ``b``'s projection may use: its budget less what holds its whole bound."""
    whole_life = b.reserved_tokens - b.projected_tokens
    return (b.budget_tokens - whole_life) // b.limits.block_size


def projected_room(b: Backend, d: Demand, stale: bool = False) -> bool:
    """``d`` fits ``b``'s projected curve, beside whatever holds its whole bound there
    (``stale``: a refusal may be read from a curve a few steps old, see ``fits``)."""
    proj, block = b.projection, b.limits.block_size
    return proj.fits(block, projected_budget(b), d.z, (flight_for(b, d),), stale=stale)


def earliest_fit(
    proj: NodeProjection,
    block: int,
    newcomer: Flight,
    budget: int,
    z: float,
    ahead: Iterable[Flight] = (),
    *,
    stale: bool = False,
) -> int | None:
    """The first step at which ``newcomer`` fits ``proj`` (with ``ahead`` in the curve),
    or None if that depends on a flight whose end is unknown (``stale``: starts refused
    on a curve a few steps old, an estimate never early)."""
    others = tuple(ahead)
    if any(f.end is None for f in proj.flights):
        starts = [0]
    else:
        starts = sorted({0, *(f.end for f in (*proj.flights, *others) if f.end)})
    for start in starts:
        if proj.fits(block, budget, z, (*others, delayed(newcomer, start)), stale=stale):
            return start
    return None


def context_error(demand: Demand, largest: int) -> ContextLengthExceeded:
    # OpenAI's and vLLM's wording first: clients (LiteLLM's ContextWindowExceededError,
    # fallbacks to larger models) recognise a context-length error by it.
    return ContextLengthExceeded(
        f"This model's maximum context length is {largest} tokens. However, you requested "
        f"{demand.longest_sequence} tokens ({demand.longest_prompt} in the messages, "
        f"{demand.output_tokens} in the completion). Please reduce the length of the "
        f"messages or completion. (The largest context any backend for model "
        f"'{demand.model}' offers is {largest} tokens.)",
        param="messages",
    )
