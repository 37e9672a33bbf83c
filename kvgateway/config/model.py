"""The gateway's configuration as frozen, typed objects (parsed in :mod:`.load`).

Nothing downstream reads raw YAML. The annotated reference is
``config/gateway.example.yaml``; defaults are written once, here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from kvgateway.config.ledger import LedgerConfig
from kvgateway.tokens.plans import TokenizerConfig


class Policy(StrEnum):
    """``routing.policy``: kv_aware, or a baseline to compare it with."""

    KV_AWARE = "kv_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    LENGTH_AWARE = "length_aware"


POLICIES = tuple(p.value for p in Policy)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    served_name: str
    aliases: tuple[str, ...]
    tokenizer: TokenizerConfig


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    default_output_tokens: int = 1024
    budget_fraction: float = 1.0
    queue_timeout_s: float = 300.0
    queue_size: int = 1024
    max_body_bytes: int = 32 * 1024 * 1024
    # A client that disconnects frees its node's blocks when the node's abort lands:
    # its reservation is held this much longer.
    abort_release_delay_s: float = 0.2
    # Caps that keep one request from holding the event loop (clear 400 above them).
    max_messages: int = 4096
    max_content_parts: int = 8192
    # A chat request without max_tokens may generate up to the rest of the context on
    # vLLM; the gateway caps it at the reserved default so the reservation holds.
    inject_default_output: bool = True
    # A client's max_tokens that does not fit beside its prompt in the largest context:
    # "clamp" (vLLM >= 0.32) serves it with max_tokens cut to what the context leaves
    # (and sends the node the cut); "reject" (vLLM <= 0.31) answers the 400.
    context_overflow: str = "clamp"
    # Send every chat and completions stream to the node with include_usage and
    # continuous_usage_stats (and take out of the relayed chunks what the client did not
    # ask for): the node's own output count on every chunk, not one token per chunk.
    node_stream_usage: bool = True
    # With routing.prefix_aware: prompt blocks that a running request on the same node
    # already holds are reserved once, not once per request.
    prefix_credit: bool = True
    # Admit by the projected KV peak (core/projection.py). False (and with a shared
    # ledger): every request holds prompt + output for its whole life.
    kv_projection: bool = True
    # What bounds each sequence's output in the projection: "learned" lengths of such
    # requests (core/output_model.py), or always its "max_tokens".
    output_reservation: str = "learned"
    # learned: the accepted chance, per node, that its sequences outgrow its budget (the
    # curve is checked at mean + z(risk) standard deviations).
    preemption_risk: float = 0.001
    # clamp, learned: the accepted chance that a node's context cuts an answer short
    # (core/demand.py cut_to). 0: max_tokens is cut only to the largest context.
    clamp_risk: float = 0.001


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: Policy = Policy.KV_AWARE
    # Send work that fits a GPU tier to the offload tier when every GPU tier is full
    # (instead of queueing). Off by default: offload nodes are slow.
    offload_overflow: bool = False
    # kv_aware only: prefer, within the tier kv_aware picks, the node holding the prompt's
    # prefix in its cache (approximate from what was routed; precise with `kv_events`).
    prefix_aware: bool = True


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    connect_s: float = 3.0
    first_byte_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 900.0


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    # Consecutive request failures that eject a backend until a probe succeeds.
    eject_after_failures: int = 3
    # Ask healthy nodes for their limits again this often (catches quick restarts).
    rediscover_interval_s: float = 30.0


@dataclass(frozen=True, slots=True)
class LoadFeedbackConfig:
    enabled: bool = True
    interval_s: float = 2.0
    timeout_s: float = 2.0
    # A node above this real KV usage gets no new work until it falls below
    # `kv_low_watermark` (hysteresis keeps it from flapping).
    kv_high_watermark: float = 0.95
    kv_low_watermark: float = 0.85
    # Waiting requests on the node (queued by someone else) that pause new work.
    max_waiting: int = 0
    # Seconds a node stays paused after it reports new preemptions.
    preemption_cooldown_s: float = 5.0
    # A scrape older than this is ignored (the gateway's own accounting still holds).
    stale_after_s: float = 15.0


@dataclass(frozen=True, slots=True)
class BackendConfig:
    name: str
    url: str
    model: str
    tier: str
    offload: bool
    served_model: str
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_tokens: int | None = None
    capacity: Mapping[str, Any] | None = None
    discover: bool = True
    timeouts: TimeoutConfig = TimeoutConfig()
    # Speculative decoding (vLLM --speculative-config num_speculative_tokens): each running
    # sequence holds this many lookahead slots beyond its tokens.
    num_speculative_tokens: int = 0
    # A KV connector (LMCache, CPU offloading) frees a request's blocks only once their
    # transfer is done: its reservation is held this much longer.
    release_delay_s: float = 0.0
    path: str = ""
    # vLLM's --kv-events-config publisher (tcp://HOST:PORT) for precise prefix routing.
    kv_events: str | None = None
    # Its replay socket (--kv-events-config replay_endpoint): batches lost in transit are
    # fetched again instead of forgetting the node's whole cache view; and the topic.
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    # The gateway binds `kv_events` (the node's --kv-events-config names a host: it connects).
    kv_events_bind: bool = False


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry spans (``pip install kvgateway[otel]``); exporters via OTEL_* env."""

    enabled: bool = False


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How `dns:` backend groups are looked up."""

    # "10.96.0.10" or "127.0.0.1:5353"; empty: the system's resolvers (/etc/resolv.conf).
    nameservers: tuple[str, ...] = ()
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class DnsGroupConfig:
    """Backends behind one DNS name (a Kubernetes headless Service): ``lookup: address``,
    a member per A/AAAA record, on ``port``; ``lookup: srv``, a member per SRV record
    (``_http._tcp.<service>``) on its port, at its target's addresses. A member is the
    ``template`` (model, limits, timeouts) with its own name (``pool@10.0.0.5:8000``)."""

    name: str
    dns: str
    port: int
    scheme: str
    resolve_interval_s: float
    template: BackendConfig
    lookup: str = "address"

    def member(self, address: str, port: int | None = None) -> BackendConfig:
        """The backend at one resolved address (IPv4 or IPv6, without brackets). Its KV
        events come from that address too: the template's ``kv_events`` names the
        group's DNS name as host (each pod publishes on its own address)."""
        host = f"[{address}]" if ":" in address else address
        where = f"{host}:{self.port if port is None else port}"
        t = self.template

        def at_host(endpoint: str | None) -> str | None:  # tcp://NAME:PORT, host for NAME
            return None if endpoint is None else f"tcp://{host}:{urlsplit(endpoint).port}"

        return replace(
            t,
            name=f"{self.name}@{where}",
            url=f"{self.scheme}://{where}",
            kv_events=at_host(t.kv_events),
            kv_events_replay=at_host(t.kv_events_replay),
        )


@dataclass(frozen=True, slots=True)
class TierConfig:
    name: str
    offload: bool
    backends: tuple[BackendConfig, ...]
    # Discovered members are not in `backends`: they come and go at run time.
    dns_groups: tuple[DnsGroupConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    # When set, /admin/* takes only these (client keys cannot read internal state).
    admin_api_keys: tuple[str, ...] = ()
    access_log: bool = True
    log_format: str = "text"
    shutdown_grace_s: float = 30.0
    # Seconds /ready fails before the listener closes, so load balancers (a Kubernetes
    # Service) stop sending new connections first.
    drain_delay_s: float = 0.0
    # A connection without a whole request head for this long is closed; a body: below.
    keepalive_timeout_s: float = 15.0
    body_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; ``None`` is unlimited. Token rates count the prompt as counted
    by the gateway and the output reserved at admission, settled with the usage."""

    prompt_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    # The largest fraction of the fleet's KV budget this tenant may hold at once.
    max_kv_share: float | None = None


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    keys: tuple[str, ...] = ()
    # Spelled `class` in YAML; empty: the lowest configured class.
    class_name: str = ""
    weight: float = 1.0
    limits: TenantLimits = TenantLimits()


@dataclass(frozen=True, slots=True)
class ClassConfig:
    """A priority class; `auth.classes` lists them highest first."""

    name: str
    # Share of the KV budget and of the (each node's) slots no other class may take.
    floor_share: float = 0.0
    # How long this class's requests may wait for room (None: admission.queue_timeout_s).
    queue_timeout_s: float | None = None


DEFAULT_TENANT = "default"


def key_digest(key: str) -> bytes:
    """An API key's SHA-256 (bytes a header held that are not UTF-8 as they came)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Tenants: who may call, in which priority class, with which limits.

    ``server.api_keys*`` are the keys of ``default_tenant``; with no key anywhere the
    gateway is open and every request is ``default_tenant``."""

    keys: tuple[TenantConfig, ...] = ()
    classes: tuple[ClassConfig, ...] = (ClassConfig("standard"),)
    default_tenant: TenantConfig = TenantConfig(DEFAULT_TENANT)
    # A waiter is raised one class for every this many seconds it has waited.
    aging_s: float = 5.0
    # Derived once (the config never changes): the tenants by name and by their keys'
    # SHA-256, so that a request finds its tenant in one lookup however many there are.
    _by_name: dict[str, TenantConfig] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _by_digest: dict[bytes, str] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for t in self.tenants:
            self._by_name.setdefault(t.name, t)
            for key in t.keys:
                self._by_digest.setdefault(key_digest(key), t.name)

    @property
    def tenants(self) -> tuple[TenantConfig, ...]:
        return (self.default_tenant, *self.keys)

    def tenant(self, name: str) -> TenantConfig:
        """The tenant by name; one not in this config (gone with a reload): the default."""
        return self._by_name.get(name, self.default_tenant)

    def owner(self, key: str) -> str | None:
        """The tenant whose key ``key`` is, by its SHA-256: the lookup's time depends on
        that digest (under the process's hash seed), which tells nothing of any key."""
        return self._by_digest.get(key_digest(key))

    @property
    def open(self) -> bool:
        """No key anywhere: every request is the default tenant's."""
        return not self._by_digest

    def rank(self, tenant: TenantConfig) -> int:
        """0 for the highest class; a tenant without a class is in the lowest."""
        names = [c.name for c in self.classes]
        return names.index(tenant.class_name) if tenant.class_name in names else len(names) - 1

    def class_of(self, tenant: TenantConfig) -> str:
        return self.classes[self.rank(tenant)].name

    def queue_timeout(self, tenant_name: str, default: float) -> float:
        """How long ``tenant_name``'s requests may wait for room."""
        own = self.classes[self.rank(self.tenant(tenant_name))].queue_timeout_s
        return default if own is None else own


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    server: ServerConfig
    models: tuple[ModelConfig, ...]
    admission: AdmissionConfig
    routing: RoutingConfig
    health: HealthConfig
    load_feedback: LoadFeedbackConfig
    tiers: tuple[TierConfig, ...]
    discovery: DiscoveryConfig = DiscoveryConfig()
    auth: AuthConfig = AuthConfig()
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    tracing: TracingConfig = TracingConfig()
    source: str = "<memory>"
    _model_index: dict[str, ModelConfig] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for model in self.models:
            for name in (model.name, *model.aliases):
                self._model_index[name] = model
        # The name answers carry (the nodes'): a client may send it back.
        for model in self.models:
            self._model_index.setdefault(model.served_name, model)

    def resolve_model(self, name: str) -> ModelConfig | None:
        return self._model_index.get(name)

    @property
    def backends(self) -> tuple[BackendConfig, ...]:
        """The backends named in the file (not the members of DNS groups)."""
        return tuple(b for t in self.tiers for b in t.backends)

    @property
    def dns_groups(self) -> tuple[DnsGroupConfig, ...]:
        return tuple(g for t in self.tiers for g in t.dns_groups)


class LiveConfig:
    """The running config, read per request by every stage (a call); a reload sets it."""

    __slots__ = ("value",)

    def __init__(self, value: GatewayConfig) -> None:
        self.value = value

    def __call__(self) -> GatewayConfig:
        return self.value

    # The parts a stage reads per request, each a call of its own.
    def auth(self) -> AuthConfig:
        return self.value.auth

    def health(self) -> HealthConfig:
        return self.value.health

    def access_log(self) -> bool:
        return self.value.server.access_log

    def prefix_credit(self) -> bool:
        return self.value.admission.prefix_credit
