"""Logging set-up: named loggers per subsystem and one access line per request.

Prompts, completions and API keys are never logged. ``log_format: json`` turns every
line into one JSON object (for log shippers); ``text`` is ``key=value`` pairs.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass

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
