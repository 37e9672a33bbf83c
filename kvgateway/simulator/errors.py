"""vLLM's error bodies, with its status codes, types, params and wordings.

Every error is ``{"error": {message, type, param, code}}``. Three families, as vLLM 0.32
renders them (``entrypoints/serve/exception_handling``):

- a request field of the wrong type, a missing one, a body that is no JSON object:
  FastAPI's validation, type ``"Bad Request"``, the message pydantic's error list
  (``"1 validation error:\\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', ...}"``),
  the param the first error's location (``body.max_tokens``): see :func:`invalid_fields`;
- vLLM's own checks (``VLLMValidationError``), type ``"BadRequestError"``: the message
  ends with ``(parameter=..., value=...)`` when the check names them, and the param is
  that parameter (None when it names none, as the ``n`` and ``min_tokens`` checks);
- an unknown model, a 404 ``NotFoundError`` naming the served models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class ApiError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def vllm_check(message: str, parameter: str | None = None, value: object | None = None) -> ApiError:
    """A failed check of vLLM's own (``VLLMValidationError``): the parameter and value it
    names are appended to the message, as its ``__str__`` does."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    text = f"{message} ({', '.join(extras)})" if extras else message
    return bad_request(text, parameter)


# -- FastAPI / pydantic request validation ----------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldError:
    """One entry of pydantic's error list: what FastAPI reports for a field."""

    kind: str
    loc: str
    msg: str
    value: object
    ctx: dict[str, Any] | None = None


# vLLM bounds what it echoes of a refused value (handlers/validation.py).
_MAX_INPUT_CHARS = 200


def _shown(value: object) -> str:
    if isinstance(value, str):
        return (
            value if len(value) <= _MAX_INPUT_CHARS else value[:_MAX_INPUT_CHARS] + "...[truncated]"
        )
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"


def invalid_fields(errors: list[FieldError]) -> ApiError:
    """FastAPI's 400 for a body pydantic refused, worded as vLLM's handler words it."""
    lines = []
    for e in errors:
        entry: dict[str, Any] = {
            "type": e.kind,
            "loc": e.loc,
            "msg": e.msg,
            "input": _shown(e.value),
        }
        if e.ctx is not None:
            entry["ctx"] = e.ctx
        lines.append(f"  {entry}\n")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(lines)
    return ApiError(400, message.rstrip(), "Bad Request", errors[0].loc)


def json_invalid(position: int, reason: str) -> ApiError:
    """A body that is no JSON: FastAPI reports the decoder's reason and offset."""
    return invalid_fields(
        [FieldError("json_invalid", f"body.{position}", "JSON decode error", {}, {"error": reason})]
    )


def body_missing() -> ApiError:
    return invalid_fields([FieldError("missing", "body", "Field required", None)])


def body_not_object(value: object) -> ApiError:
    return invalid_fields([_not_object("body", value)])


def _not_object(loc: str, value: object) -> FieldError:
    msg = "Input should be a valid dictionary or object to extract fields from"
    return FieldError("model_attributes_type", loc, msg, value)


def missing(field: str, body: dict[str, Any]) -> FieldError:
    return FieldError("missing", f"body.{field}", "Field required", body)


def not_object(field: str, value: object) -> FieldError:
    return _not_object(f"body.{field}", value)


def not_string(field: str, value: object) -> FieldError:
    return FieldError("string_type", f"body.{field}", "Input should be a valid string", value)


def int_problem(field: str, value: object) -> FieldError:
    """Why pydantic (lax mode) refuses ``value`` for an integer field."""
    loc = f"body.{field}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return FieldError("finite_number", loc, "Input should be a finite number", value)
        fraction = "Input should be a valid integer, got a number with a fractional part"
        return FieldError("int_from_float", loc, fraction, value)
    if isinstance(value, str):
        unparsed = "Input should be a valid integer, unable to parse string as an integer"
        return FieldError("int_parsing", loc, unparsed, value)
    return FieldError("int_type", loc, "Input should be a valid integer", value)


def bool_problem(field: str, value: object) -> FieldError:
    """Why pydantic (lax mode) refuses ``value`` for a boolean field."""
    loc = f"body.{field}"
    if isinstance(value, str | int | float):
        msg = "Input should be a valid boolean, unable to interpret input"
        return FieldError("bool_parsing", loc, msg, value)
    return FieldError("bool_type", loc, "Input should be a valid boolean", value)


def below(field: str, value: object, minimum: int) -> FieldError:
    msg = f"Input should be greater than or equal to {minimum}"
    return FieldError("greater_than_equal", f"body.{field}", msg, value, {"ge": minimum})


# -- the node's own refusals ------------------------------------------------------------


def model_not_found(model: str, served: str | None = None) -> ApiError:
    """vLLM's 404; its generation endpoints name the served models (``_check_model``)."""
    aliases = f" Valid aliases: {served}." if served is not None else ""
    return ApiError(404, f"The model `{model}` does not exist.{aliases}", "NotFoundError", "model")


def queue_full() -> ApiError:
    """vLLM's refusal past ``--max-num-queued-reqs`` (a GracefulHTTPError: its type is
    the status's phrase)."""
    return ApiError(
        503,
        "The engine is currently busy and cannot accept new requests. Please try again "
        "later or on a different instance.",
        "Service Unavailable",
    )


def engine_dead() -> ApiError:
    """vLLM's answer to a request that arrives once its engine has died, before any
    response starts (``_preflight``: EngineDeadError, a 500)."""
    return ApiError(
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "InternalServerError",
    )


_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def injected_error(status: int) -> ApiError:
    return ApiError(
        status,
        f"Simulated failure (HTTP {status}) injected by /sim/fault.",
        _STATUS_TYPES.get(status, "InternalServerError"),
    )
