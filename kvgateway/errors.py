"""The gateway's exception tree; every client-visible failure is one of these.

::

    GatewayError                       status  type                    code
    ├── BadRequest                      400    invalid_request_error   invalid_value / missing_field / ...
    │   └── ContextLengthExceeded       400    invalid_request_error   context_length_exceeded
    ├── Unauthorized                    401    authentication_error    invalid_api_key
    ├── ModelNotFound                   404    invalid_request_error   model_not_found
    ├── NotFound                        404    invalid_request_error   not_found
    ├── MethodNotAllowed                405    invalid_request_error   method_not_allowed
    ├── RequestTimeout                  408    invalid_request_error   request_timeout
    ├── BodyTooLarge                    413    invalid_request_error   request_too_large
    ├── Saturated                       429    rate_limit_error        fleet_saturated      (Retry-After)
    ├── RateLimited                     429    rate_limit_error        rate_limit_exceeded  (Retry-After, x-ratelimit-*)
    ├── NoHealthyBackend                503    service_unavailable     no_healthy_backend   (Retry-After)
    ├── ShuttingDown                    503    service_unavailable     shutting_down        (Retry-After)
    ├── UpstreamError                   502    upstream_error          upstream_error
    └── UpstreamTimeout                 504    upstream_error          upstream_timeout

Errors from aiohttp's client are translated into ``UpstreamError`` / ``UpstreamTimeout``
once, in :mod:`kvgateway.upstream.client`; one middleware renders all of them as OpenAI-style JSON
(``{"error": {"message", "type", "param", "code"}}``) so SDK clients raise their usual
exception classes.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class GatewayError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str] = "internal_error"
    # Label for gateway_rejections_total; None for errors that are not rejections.
    rejection_reason: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.retry_after = retry_after
        # Headers the answer carries besides Retry-After (the tenant's x-ratelimit-*).
        self.extra_headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return dict(self.extra_headers)
        return {**self.extra_headers, "Retry-After": str(max(1, round(self.retry_after)))}

    def never_succeeds(self) -> GatewayError:
        """This answer says the request can never be served as it is: OpenAI's SDKs read
        ``x-should-retry: false`` before the status, and do not send it again."""
        self.extra_headers["x-should-retry"] = "false"
        return self


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_value"
    rejection_reason = "bad_request"


class ContextLengthExceeded(BadRequest):
    default_code = "context_length_exceeded"
    rejection_reason = "context_length"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"
    rejection_reason = "auth"


class ModelNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"
    rejection_reason = "unknown_model"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTimeout(GatewayError):
    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"
    rejection_reason = "bad_request"


class BodyTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"
    rejection_reason = "bad_request"


class Saturated(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    default_code = "fleet_saturated"
    rejection_reason = "saturated"


class RateLimited(GatewayError):
    """A tenant's own per-minute limit (``param`` names it); carries ``x-ratelimit-*``."""

    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"
    rejection_reason = "rate_limited"

    def __init__(self, message: str, *, limit_headers: dict[str, str], **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.limit_headers = limit_headers

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.limit_headers}


class NoHealthyBackend(GatewayError):
    status = 503
    error_type = "service_unavailable"
    default_code = "no_healthy_backend"
    rejection_reason = "no_backend"


class ShuttingDown(GatewayError):
    status = 503
    error_type = "service_unavailable"
    default_code = "shutting_down"
    rejection_reason = "shutting_down"


class UpstreamError(GatewayError):
    status = 502
    error_type = "upstream_error"
    default_code = "upstream_error"

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        detail: str = "",
        slow: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        # What the node or the connection said: for logs and /admin, never for clients.
        self.detail = detail
        # Whether another backend may be tried (nothing reached the client yet and the
        # failure says nothing about the request itself).
        self.retryable = retryable
        # The node took no connection in time: gone, or busy (see ``feedback.serving``).
        self.slow = slow


class UpstreamTimeout(UpstreamError):
    status = 504
    default_code = "upstream_timeout"
