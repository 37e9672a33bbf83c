"""Sharing the fleet between tenants: priority classes, fair queuing, shares and floors.

Pure state, no I/O, no clock of its own (``now`` is passed in). :class:`Admission` asks
three things of it:

- the *order* of its waiters: by class (``auth.classes``, highest first), a waiter rising
  one class for every ``aging_s`` it has waited (so a lower class is never starved), then
  within a class by start-time fair queuing on **KV tokens**: a request's tag is
  ``max(class virtual time, the tenant's last finish tag)`` and the tenant's finish tag
  advances by ``tokens / weight`` (and, with a shared ledger, by what other replicas
  grant it). Two saturating tenants of equal weight are therefore served equal KV
  tokens, whatever their request sizes;
- a *gate* per tenant: ``max_concurrent``, ``max_kv_share`` of the fleet's KV budget
  (what other replicas hold for the tenant counting too, with a shared ledger), and
  what other classes reserve as their ``floor_share``: that share of the KV budget and
  of the sequence slots (the nodes' ``max_num_seqs``, which often bind first), each
  reserved while the class holds less of it. A gated request waits without holding up
  others. The slot floors hold on each node as well (:meth:`Tenancy.kept_on`, which
  routing reads): a floor kept in the fleet but not per node leaves the protected class
  the nodes the others have not filled, where its prefills queue behind each other;
- the bookkeeping of grants and releases (tokens and requests in use per tenant/class).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvgateway.config.model import AuthConfig, TenantConfig
from kvgateway.errors import Saturated

MAX_CONCURRENT = "max_concurrent"
MAX_KV_SHARE = "max_kv_share"
CLASS_FLOOR = "class_floor"


@dataclass(frozen=True, slots=True)
class Ticket:
    """A request's place in the order: its class rank and fair-queuing start tag."""

    tenant: str
    klass: str
    rank: int
    start: float
    seq: int

    def key(self, since: float, now: float, aging_s: float) -> tuple[int, int, float, int]:
        """Smaller is served first. Waiting ``aging_s`` raises the rank by one class; a
        raised waiter goes before that class's own waiters, oldest first (fair-queuing
        tags of different classes are not comparable, and it must not starve there)."""
        lift = min(self.rank, int((now - since) / aging_s)) if aging_s > 0 else 0
        if lift > 0:
            return (self.rank - lift, 0, since, self.seq)
        return (self.rank, 1, self.start, self.seq)


class Tenancy:
    """Fair-queuing tags and KV use per tenant and class, over the live ``auth`` config."""

    def __init__(self, auth: Callable[[], AuthConfig]) -> None:
        self._auth = auth
        self._virtual: dict[str, float] = {}  # per class
        self._finish: dict[str, float] = {}  # per tenant
        # Per tenant: the finish tags of requests tagged but not yet served nor refunded
        # (by ticket seq), and the latest finish tag of one served (here or elsewhere).
        self._waiting_tags: dict[str, dict[int, float]] = {}
        self._served_finish: dict[str, float] = {}
        self._seq = 0
        self.tokens: Counter[str] = Counter()  # KV tokens held, per tenant
        self.requests: Counter[str] = Counter()  # admitted requests in flight, per tenant
        self.class_tokens: Counter[str] = Counter()
        self.class_seqs: Counter[str] = Counter()  # sequence slots held, per class
        # Sequence slots held per backend, per class: floors hold on each node too.
        self.node_seqs: dict[str, Counter[str]] = {}
        self.granted_tokens: Counter[str] = Counter()  # KV tokens ever granted, per tenant
        self.elsewhere = Elsewhere()
        # The tenants by name, for the config they were read from (a reload makes anew).

    @property
    def auth(self) -> AuthConfig:
        return self._auth()

    def tenant(self, name: str) -> TenantConfig:
        """The tenant by name; one gone from the config (a reload) counts as the default."""
        return self._auth().tenant(name)

    def ticket(self, name: str, tokens: int) -> Ticket:
        """Tag a new request (start-time fair queuing within its class)."""
        auth = self._auth()
        t = self.tenant(name)
        klass = auth.class_of(t)
        start = max(self._virtual.get(klass, 0.0), self._finish.get(t.name, 0.0))
        self._finish[t.name] = start + tokens / t.weight
        self._seq += 1
        self._waiting_tags.setdefault(t.name, {})[self._seq] = self._finish[t.name]
        return Ticket(t.name, klass, auth.rank(t), start, self._seq)

    def advance(self, name: str, tokens: int) -> None:
        """Other replicas granted ``tokens`` KV tokens to ``name``: its later requests
        here are tagged as if those had been tagged here (fair queuing across replicas:
        a tenant that other replicas serve waits behind those they do not)."""
        t = self.tenant(name)
        klass = self._auth().class_of(t)
        start = max(self._finish.get(t.name, 0.0), self._virtual.get(klass, 0.0))
        self._finish[t.name] = self._served_finish[t.name] = start + tokens / t.weight

    def refund(self, ticket: Ticket) -> None:
        """A request tagged ``ticket`` was never served: its tenant's finish tag goes back
        to the latest of those served or still waiting (as if it had never come; tags
        already given stay, or the tenant's order would change), whatever order its
        requests give up in."""
        waiting = self._waiting_tags.get(ticket.tenant, {})
        waiting.pop(ticket.seq, None)
        latest = max(waiting.values(), default=self._served_finish.get(ticket.tenant, 0.0))
        self._finish[ticket.tenant] = max(latest, self._served_finish.get(ticket.tenant, 0.0))
        if not waiting:
            self._waiting_tags.pop(ticket.tenant, None)

    def gate(
        self,
        name: str,
        tokens: int,
        budget: int,
        ahead: int = 0,
        ahead_tokens: int = 0,
        *,
        seqs: int = 1,
        slots: int = 0,
    ) -> str | None:
        """The tenant or class limit that keeps this request waiting now, if any.
        ``ahead`` (``ahead_tokens``): the tenant's other requests already let through its
        limits and waiting for room, which count as if running. ``seqs``: the sequences
        it runs, of the fleet's ``slots`` (0: slots are not judged)."""
        auth = self._auth()
        t = self.tenant(name)
        limits = t.limits
        away = self.elsewhere
        running = self.requests[t.name] + away.requests[t.name] + ahead
        if limits.max_concurrent is not None and running >= limits.max_concurrent:
            return MAX_CONCURRENT
        held = self.tokens[t.name] + away.tokens[t.name] + ahead_tokens
        # A tenant holding nothing may always run one request, however large.
        if (
            limits.max_kv_share is not None
            and held
            and held + tokens > limits.max_kv_share * budget
        ):
            return MAX_KV_SHARE
        own = auth.class_of(t)
        kv = (self.class_tokens, away.class_tokens, away.unclassed_tokens)
        if _floors_block(auth, own, *kv, tokens, budget):
            return CLASS_FLOOR
        seq = (self.class_seqs, away.class_seqs, away.unclassed_seqs)
        if slots > 0 and _floors_block(auth, own, *seq, seqs, slots):
            return CLASS_FLOOR
        return None

    def reads_totals(self, name: str) -> bool:
        """Does :meth:`gate` read the fleet's KV budget and slots for ``name``'s requests
        (a KV share limit, or another class's floor)? Without either they are not
        summed: a sum over every backend per request."""
        auth = self._auth()
        t = self.tenant(name)
        if t.limits.max_kv_share is not None:
            return True
        own = auth.class_of(t)
        return any(c.floor_share > 0 for c in auth.classes if c.name != own)

    def never_passes_floors(
        self, name: str, tokens: int, budget: int, *, seqs: int = 1, slots: Sequence[int] = ()
    ) -> bool:
        """Other classes' floors leave this request no room however the fleet is used:
        each holds its floor or keeps it free, so ``tokens`` plus those floors must fit
        the ``budget``, and ``seqs`` plus their share of a node's slots must fit one of
        the nodes (``slots``: each node's) as the floors are kept per node."""
        auth = self._auth()
        own = auth.class_of(self.tenant(name))
        share = sum(c.floor_share for c in auth.classes if c.name != own)
        if share <= 0:
            return False
        return tokens + share * budget > budget or (
            bool(slots) and all(seqs + share * n > n for n in slots)
        )

    def kept_on(self, klass: str) -> Callable[[str, int], float] | None:
        """For requests of class ``klass``: the slots of a node (its name, its
        ``max_num_seqs``) that the other classes' floors keep from them there, each the
        floor's share of the node less what its class holds on it (here, and on other
        replicas as a shared ledger last answered); None if no other class has a
        floor."""
        floors = [(c.name, c.floor_share) for c in self._auth().classes if c.name != klass]
        floors = [f for f in floors if f[1] > 0]
        if not floors:
            return None

        empty: Counter[str] = Counter()

        def kept(backend: str, slots: int) -> float:
            here = self.node_seqs.get(backend, empty)
            away = self.elsewhere.node_seqs.get(backend, empty)
            return sum(max(0.0, share * slots - here[name] - away[name]) for name, share in floors)

        return kept

    def granted(self, ticket: Ticket, tokens: int, seqs: int = 1, backend: str = "") -> None:
        klass = ticket.klass
        waiting = self._waiting_tags.get(ticket.tenant, {})
        tag = waiting.pop(ticket.seq, None)
        if tag is not None:
            served = self._served_finish.get(ticket.tenant, 0.0)
            self._served_finish[ticket.tenant] = max(served, tag)
        self._virtual[klass] = max(self._virtual.get(klass, 0.0), ticket.start)
        self.tokens[ticket.tenant] += tokens
        self.granted_tokens[ticket.tenant] += tokens
        self.requests[ticket.tenant] += 1
        self.class_tokens[klass] += tokens
        self.class_seqs[klass] += seqs
        self.node_seqs.setdefault(backend, Counter())[klass] += seqs

    def released(self, ticket: Ticket, tokens: int, seqs: int = 1, backend: str = "") -> None:
        klass = ticket.klass
        self.tokens[ticket.tenant] -= tokens
        self.requests[ticket.tenant] -= 1
        self.class_tokens[klass] -= tokens
        self.class_seqs[klass] -= seqs
        held = self.node_seqs.setdefault(backend, Counter())
        held[klass] -= seqs
        if not any(held.values()):
            del self.node_seqs[backend]  # a node that holds none (DNS names come and go)


def _floors_block(
    auth: AuthConfig,
    own: str,
    here: Counter[str],
    away: Counter[str],
    unclassed: int,
    asked: int,
    total: int,
) -> bool:
    """Would ``asked`` more of one resource (KV tokens or slots, ``total`` of them) in
    class ``own`` eat into what the other classes' floors keep? Each floor keeps what
    its class does not hold of it, here or on other replicas."""
    kept = sum(
        max(0.0, c.floor_share * total - here[c.name] - away[c.name])
        for c in auth.classes
        if c.name != own
    )
    used = sum(here.values()) + sum(away.values()) + unclassed
    return bool(kept) and used + asked + kept > total


@dataclass(slots=True)
class Elsewhere:
    """What other gateway replicas hold, as a shared ledger last saw it: per tenant
    (KV tokens, requests) and per class (KV tokens, sequences)."""

    tokens: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    class_tokens: Counter[str] = field(default_factory=Counter)
    class_seqs: Counter[str] = field(default_factory=Counter)
    # Sequences per class on a backend, as last answered for a grant there.
    node_seqs: dict[str, Counter[str]] = field(default_factory=dict)
    # Per class and model: how long the oldest request other replicas keep waiting
    # behind the floors has waited (s), as last read. A request of the class for the
    # model here that has waited less waits too: freed room goes to the oldest.
    floor_waits: dict[tuple[str, str], float] = field(default_factory=dict)
    # In the ledger's fallback: what the others are taken to hold, all of the fleet
    # but this replica's share, in classes unknown here.
    unclassed_tokens: int = 0
    unclassed_seqs: int = 0


class Queued(Protocol):
    """What the order functions read of a waiter."""

    @property
    def ticket(self) -> Ticket | None: ...
    @property
    def since(self) -> float: ...
    @property
    def claims(self) -> frozenset[str]: ...
    @property
    def gated(self) -> str | None: ...


W = TypeVar("W", bound=Queued)


def displaced_error() -> Saturated:
    return Saturated(
        "The fleet is saturated and requests of a higher priority class are waiting; "
        "this one was refused to make room for them. Retry later.",
        code="displaced_by_priority",
        retry_after=1.0,
    )


def tenant_queue_full_error(tenant: str, gate: str, waiting: int) -> Saturated:
    return Saturated(
        f"Tenant '{tenant}' is at its {gate} limit and already has {waiting} requests "
        "waiting for it. Retry later.",
        code=f"tenant_{gate}",
        retry_after=1.0,
    )


def floors_error(tenant: str, tokens: int) -> Saturated:
    refusal = Saturated(
        f"Tenant '{tenant}': this request needs {tokens} KV tokens, more than the other "
        "priority classes' floor_share leaves to its class; it can never be admitted. "
        "Reduce the request.",
        code=f"tenant_{CLASS_FLOOR}",
    )
    refusal.never_succeeds()
    return refusal


def gated_error(tenant: str, gate: str, timeout: float) -> Saturated:
    return Saturated(
        f"Tenant '{tenant}' stayed at its {gate} limit for {timeout:g}s. Retry later.",
        code=f"tenant_{gate}",
        retry_after=max(1.0, timeout / 2),
    )
