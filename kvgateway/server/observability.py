"""Setting up what the gateway leaves for operators, once at start-up: its log lines
(``log_format: json`` turns every line into one JSON object for log shippers; ``text``
is ``key=value`` pairs; prompts, completions and API keys are never logged) and its
tracer (OpenTelemetry, optional: ``pip install kvgateway[otel]``, off by default,
``tracing.enabled``, exported the standard ``OTEL_*`` way).

Exporters, as the OpenTelemetry SDK's environment variables say: ``OTEL_TRACES_EXPORTER``
= ``otlp`` (default; ``OTEL_EXPORTER_OTLP_ENDPOINT`` etc.), ``console`` or ``none``;
``OTEL_SERVICE_NAME`` names the service; ``OTEL_SDK_DISABLED=true`` turns it all off.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from kvgateway.server.telemetry import Tracing


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
