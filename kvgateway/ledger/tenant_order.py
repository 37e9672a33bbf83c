"""The tenants' order across replicas, read and written with each refresh of the
holdings (:mod:`kvgateway.ledger.tenant_holds`):

- **Fair queuing**: each replica writes the KV tokens it has granted each tenant that
  shares its class with another (``{ns}:gtok:TENANT``), and advances each such tenant's
  fair-queuing tag by what the others granted it since it last looked, so a tenant that
  other replicas serve waits here behind one they do not.
- **Waiting behind the floors**: each replica writes how long its oldest request kept
  waiting by the class floors has waited, per class and model
  (``{ns}:fwait:CLASS:MODEL``), and reads the others'. A request of that class for that
  model here that has waited less waits too, so freed
  room goes to the oldest waiter across replicas (without it, the replica whose own
  requests end takes every slot they free, and the other's wait until they time out).
- **A class within its floor goes first**: the shared ledger's wait sets (a replica with
  requests queued for a backend holds the others' new requests off it) do not hold it
  off (:func:`within_floor`).
"""

from __future__ import annotations

from collections import Counter

from redis.asyncio.client import Pipeline

from kvgateway.config.model import AuthConfig
from kvgateway.core.tenancy import Elsewhere, Tenancy


def sharing_tenants(auth: AuthConfig) -> list[str]:
    """The tenants that share a class with another."""
    per_class = Counter(auth.class_of(t) for t in auth.tenants)
    return sorted({t.name for t in auth.tenants if per_class[auth.class_of(t)] > 1})


def node_key(ns: str, backend: str, klass: str) -> str:
    """Where each replica's sequences of ``klass`` on ``backend`` are recorded."""
    return f"{{{ns}}}:nseq:{backend}:{klass}"


def write_node_seqs(
    pipe: Pipeline, ns: str, me: str, classes: list[str], held: dict[str, Counter[str]]
) -> None:
    """This replica's sequences per class on each backend of ``held``, written (a grant
    writes its own backend's in its script; releases here)."""
    for name in sorted(held):
        for klass in classes:
            if held[name][klass] > 0:
                pipe.hset(node_key(ns, name, klass), me, held[name][klass])
            else:
                pipe.hdel(node_key(ns, name, klass), me)


def write_grants(
    pipe: Pipeline, sha: str, ns: str, me: str, tenancy: Tenancy, names: list[str]
) -> None:
    """The KV tokens this replica has granted each of ``names``, written; the others'
    read (:func:`take_grants`)."""
    keys = [f"{{{ns}}}:live", *(f"{{{ns}}}:gtok:{n}" for n in names)]
    pipe.evalsha(sha, len(keys), *keys, me, *(tenancy.granted_tokens[n] for n in names))


def take_grants(tenancy: Tenancy, seen: dict[str, int], names: list[str], got: list[int]) -> None:
    """Advance each tenant's fair-queuing tag by what the others granted it since this
    replica last looked (``seen``); what they granted before that does not count."""
    for name, total in zip(names, (int(x) for x in got), strict=True):
        before = seen.get(name)
        seen[name] = total
        if before is not None and total > before:
            tenancy.advance(name, total - before)


Waits = dict[tuple[str, str], float]  # (class, model) -> seconds waited


def write_floor_waits(
    pipe: Pipeline, sha: str, ns: str, me: str, pairs: list[tuple[str, str]], mine: Waits
) -> None:
    """How long this replica's oldest request waiting behind the floors has waited, per
    class and model (``mine``), written; the others' read (:func:`take_floor_waits`)."""
    ages = [int(mine[p] * 1000) if p in mine else -1 for p in pairs]
    keys = [f"{{{ns}}}:live", *(f"{{{ns}}}:fwait:{c}:{m}" for c, m in pairs)]
    pipe.evalsha(sha, len(keys), *keys, me, *ages)


def take_floor_waits(away: Elsewhere, pairs: list[tuple[str, str]], ages_ms: list[int]) -> bool:
    """Take in the others' oldest waiters behind the floors, per class and model; True
    when one was served (the oldest there waited less than before, or none waits): the
    waiters here ask again."""
    before = dict(away.floor_waits)
    away.floor_waits = {
        p: int(a) / 1000 for p, a in zip(pairs, ages_ms, strict=True) if int(a) >= 0
    }
    return any(c not in away.floor_waits or away.floor_waits[c] < age for c, age in before.items())


def within_floor(tenancy: Tenancy, klass: str, budget: int, slots: int) -> bool:
    """``klass`` has a floor and holds less than it (KV tokens or slots, here and on the
    other replicas as last read): the room its floor keeps is its own, so other
    replicas' waiters (of any class) do not hold its requests off a backend."""
    share = next((c.floor_share for c in tenancy.auth.classes if c.name == klass), 0.0)
    if share <= 0:
        return False
    away = tenancy.elsewhere
    tokens = tenancy.class_tokens[klass] + away.class_tokens[klass]
    seqs = tenancy.class_seqs[klass] + away.class_seqs[klass]
    return tokens <= share * budget or seqs <= share * slots
