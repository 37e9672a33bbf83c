"""What a request leaves behind for operators: its access line and its trace spans.

Logging: named loggers per subsystem and one access line per request. Prompts, completions and API keys are never logged. ``log_format: json`` turns every
line into one JSON object (for log shippers); ``text`` is ``key=value`` pairs.

OpenTelemetry spans for the request path: optional (``pip install kvgateway[otel]``),
off by default (``tracing.enabled``), exported the standard ``OTEL_*`` way.

Spans: ``gateway.request`` (continuing the client's ``traceparent``), inside it
``gateway.admission`` (the wait for KV room, with the routing decision as attributes)
and ``gateway.upstream`` (the call to the node, whose ``traceparent`` then names this
span, so the node's own spans join the trace). Without tracing the client's trace context
is passed to the node unchanged.

Exporters, as the OpenTelemetry SDK's environment variables say: ``OTEL_TRACES_EXPORTER``
= ``otlp`` (default; ``OTEL_EXPORTER_OTLP_ENDPOINT`` etc.), ``console`` or ``none``;
``OTEL_SERVICE_NAME`` names the service; ``OTEL_SDK_DISABLED=true`` turns it all off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

ACCESS = logging.getLogger("kvgateway.access")


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    method: str
    path: str
    model: str = "-"
    tenant: str = "-"
    tier: str = "-"
    backend: str = "-"
    route: str = "-"
    prompt_tokens: int = 0
    reserved_tokens: int = 0
    status: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    queued_ms: float = 0.0
    attempts: int = 0
    stream: bool = False
    outcome: str = "-"

    def fields(self) -> dict[str, object]:
        return asdict(self)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            payload.update(access)
        else:
            payload["msg"] = record.getMessage()
        return json.dumps(payload, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            record.msg = " ".join(f"{k}={_fmt(v)}" for k, v in access.items() if v is not None)
            record.args = None
        return super().format(record)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def setup_logging(fmt: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiohttp's own access log duplicates ours without tokens or backends.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def log_access(record: AccessRecord) -> None:
    if ACCESS.isEnabledFor(logging.INFO):
        ACCESS.info("access", extra={"access": record.fields()})


class Tracing:
    """Spans when a tracer is given; every method is a no-op otherwise."""

    def __init__(self, tracer: Any | None = None) -> None:
        self._tracer = tracer

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextlib.contextmanager
    def request(self, name: str, headers: Mapping[str, str]) -> Iterator[Any]:
        """The request's root span, continuing the client's trace context if any."""
        if self._tracer is None:
            yield None
            return
        from opentelemetry import propagate

        parent = propagate.extract(dict(headers))
        with self._tracer.start_as_current_span(name, context=parent, kind=_server()) as span:
            yield span

    @contextlib.contextmanager
    def span(self, name: str, **attributes: str | int | float) -> Iterator[Any]:
        if self._tracer is None:
            yield None
            return
        with self._tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Put the current span's context into ``headers`` (traceparent, tracestate)."""
        if self._tracer is None:
            return
        from opentelemetry import propagate

        propagate.inject(headers)

    def for_node(self, client: Mapping[str, str]) -> dict[str, str]:
        """W3C trace context for the node, so its spans join the trace: the gateway's own
        span when tracing is on, else the client's (``client``: its request's headers)
        unchanged."""
        out: dict[str, str] = {}
        if self._tracer is not None:
            self.inject(out)
            return out
        for name in ("traceparent", "tracestate"):
            value = client.get(name)
            if value is not None:
                out[name] = value
        return out


def _server() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER


def set_attributes(span: Any, **attributes: str | int | float) -> None:
    if span is not None:
        span.set_attributes(attributes)


def from_environment(enabled: bool, provider: Any | None = None) -> Tracing:
    """Tracing as configured: ``provider`` (tests) or an SDK provider built from OTEL_*."""
    if not enabled or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return Tracing()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise RuntimeError(
            "tracing.enabled needs OpenTelemetry: pip install 'kvgateway[otel]'"
        ) from exc
    if provider is None:
        service = os.environ.get("OTEL_SERVICE_NAME", "kvgateway")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip()
        if exporter_name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif exporter_name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise RuntimeError(
                    "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'kvgateway[otel]'"
                ) from exc
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider.get_tracer("kvgateway"))
