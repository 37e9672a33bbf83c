"""A node's error answer as OpenAI's error object, whatever the node wrote.

vLLM answers errors with ``{"error": {...}}`` (older releases with ``{"object":
"error", "message": ...}``); a proxy or a server in front of it may answer with plain
text or HTML ("404: Not Found"). OpenAI SDKs read ``error.message`` from JSON, so a body
that is not an error object is wrapped into one, with the node's text (cut short) as
the message; JSON error bodies pass through unchanged.
"""

from __future__ import annotations

import json
import re

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 413: "BadRequestError", 422: "UnprocessableEntityError",
          429: "RateLimitError"}  # fmt: skip
_MAX_TEXT = 500


# Bodies past this are not parsed on the event loop: one that opens as an error object
# is taken for one (a 422 can echo a whole prompt back).
_PARSE_LIMIT = 64 * 1024
_ERROR_OPENING = re.compile(rb'\A\s*\{\s*"(?:error|object)"\s*:')


def is_error_object(data: bytes) -> bool:
    """Whether ``data`` is a JSON error object an OpenAI client can read."""
    if len(data) > _PARSE_LIMIT:
        return _ERROR_OPENING.match(data) is not None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return False
    if not isinstance(body, dict):
        return False
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return True
    return body.get("object") == "error" and isinstance(body.get("message"), str)


def is_json_object(data: bytes) -> bool:
    """Whether a 200 answer is shaped as a JSON object (checked at its ends only: the
    gateway never parses whole answers)."""
    return data.lstrip()[:1] == b"{" and data.rstrip()[-1:] == b"}"


def openai_error_body(status: int, data: bytes, backend: str, *, code: str = "") -> bytes:
    """``data`` if it is an error object already, else one wrapping its text."""
    if is_error_object(data) and status >= 400:
        return data
    text = data[:_MAX_TEXT].decode("utf-8", "replace").strip()
    message = f"Backend {backend} answered {status}" + (f": {text}" if text else ".")
    error = {
        "message": message,
        "type": _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
        "param": None,
        "code": code or f"upstream_{status}",
    }
    return json.dumps({"error": error}).encode()
