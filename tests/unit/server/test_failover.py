"""Every request's retry loop on its own (:func:`kvgateway.server.proxy.failover`), with
explicit collaborators: room is held on one backend per try and always given back; a
failure before the first byte moves the request to a backend that has not failed it;
one that may not be retried, or the last try's, reaches the client."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import pytest
from aiohttp.test_utils import make_mocked_request

from kvgateway.config.model import HealthConfig
from kvgateway.core.backends import Backend
from kvgateway.errors import NoHealthyBackend, UpstreamError
from kvgateway.server.exchange import Exchange
from kvgateway.server.proxy import MAX_ATTEMPTS, failed, failover
from kvgateway.server.state import GatewayState
from kvgateway.server.telemetry import AccessRecord
from tests.support.backends import backend

STATE = cast(
    "GatewayState",
    SimpleNamespace(clock=lambda: 100.0, live=lambda: SimpleNamespace(health=HealthConfig())),
)


@dataclass
class _Held:
    backend: Backend
    log: list[str]

    async def __aenter__(self) -> _Held:
        self.log.append(f"hold {self.backend.name}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.log.append(f"release {self.backend.name}")


@dataclass
class _Fleet:
    """Backends in order, each answering ``ex`` with what ``answers`` says (a failure
    before the first byte, or an answer)."""

    ex: Exchange
    answers: dict[str, UpstreamError | str]
    log: list[str] = field(default_factory=list)
    asked: list[frozenset[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.backends = [backend(name) for name in self.answers]

    async def hold(self, exclude: frozenset[str]) -> _Held:
        self.asked.append(exclude)
        for b in self.backends:
            if b.name not in exclude:
                return _Held(b, self.log)
        raise NoHealthyBackend("none left")

    async def attempt(self, held: _Held) -> str | UpstreamError:
        answer = self.answers[held.backend.name]
        if isinstance(answer, UpstreamError):
            return failed(STATE, self.ex, held.backend, answer)
        return answer


def _exchange() -> Exchange:
    request = make_mocked_request("POST", "/v1/embeddings")
    return Exchange(request=request, record=AccessRecord("r1", "POST", request.path), started=99.0)


async def test_a_failure_before_the_first_byte_moves_to_a_backend_that_has_not_failed() -> None:
    ex = _exchange()
    fleet = _Fleet(ex, {"a": UpstreamError("refused", detail="connect"), "b": "answer"})
    assert await failover(STATE, ex, fleet.hold, fleet.attempt) == "answer"
    assert fleet.asked == [frozenset(), frozenset({"a"})]
    assert fleet.log == ["hold a", "release a", "hold b", "release b"]
    assert [(f.backend, f.retried) for f in ex.failures] == [("a", True)]
    assert ex.record.attempts == 2
    assert fleet.backends[0].consecutive_failures == 1  # counted towards its health


async def test_a_failure_that_may_not_be_retried_reaches_the_client_at_once() -> None:
    ex = _exchange()
    fleet = _Fleet(ex, {"a": UpstreamError("bad", retryable=False), "b": "answer"})
    with pytest.raises(UpstreamError, match="bad"):
        await failover(STATE, ex, fleet.hold, fleet.attempt)
    assert fleet.log == ["hold a", "release a"]
    assert [(f.backend, f.retried) for f in ex.failures] == [("a", False)]


async def test_when_every_backend_has_failed_the_last_failure_is_the_answer() -> None:
    """Two backends, both failing: the first is tried again (anywhere but the last to
    fail), and the third failure is the client's, not a 503 for want of backends."""
    ex = _exchange()
    fleet = _Fleet(ex, {"a": UpstreamError("a down"), "b": UpstreamError("b down")})
    with pytest.raises(UpstreamError, match="a down"):
        await failover(STATE, ex, fleet.hold, fleet.attempt)
    assert fleet.asked == [frozenset(), frozenset({"a"}), frozenset({"a", "b"}), frozenset({"b"})]
    assert ex.record.attempts == MAX_ATTEMPTS
    assert [f.retried for f in ex.failures] == [True, True, False]
    assert fleet.log.count("hold a") + fleet.log.count("hold b") == MAX_ATTEMPTS
    assert fleet.log.count("release a") + fleet.log.count("release b") == MAX_ATTEMPTS


async def test_a_failure_with_nowhere_else_to_go_is_not_counted_as_retried() -> None:
    ex = _exchange()
    fleet = _Fleet(ex, {"only": UpstreamError("busy")})
    with pytest.raises(UpstreamError, match="busy"):
        await failover(STATE, ex, fleet.hold, fleet.attempt)
    assert fleet.asked == [frozenset(), frozenset({"only"}), frozenset({"only"})]
    assert [(f.backend, f.retried) for f in ex.failures] == [("only", False)]
