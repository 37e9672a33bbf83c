"""The Settle stage on its own: what a finished answer teaches (the output charged, the
nodes' prompt count, one sequence's length) and what closing a request records, from the
exchange alone, with no fleet and no HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from kvgateway.config.load import parse_config
from kvgateway.config.model import AuthConfig, TenantConfig, TenantLimits
from kvgateway.core.output_model import CUT_SAMPLES, OutputModel
from kvgateway.core.quota import OUTPUT, Charge, LocalQuotaLedger
from kvgateway.core.tenancy import Tenancy
from kvgateway.plan.planner import Plan, Planner
from kvgateway.server.exchange import Answer, Exchange, Outcome, Settle
from kvgateway.server.telemetry import AccessRecord, GatewayMetrics
from kvgateway.tokens.counters import TokenCounters
from kvgateway.tokens.encoding import EncodingCache
from kvgateway.tokens.prompt_estimate import PromptCalibration
from kvgateway.upstream.client import Usage

CONFIG = parse_config(
    {
        "models": [{"name": "m"}],
        "tiers": [
            {"name": "t", "backends": [{"name": "a", "url": "http://127.0.0.1:9", "model": "m"}]}
        ],
    }
)


ACME = TenantConfig("acme", keys=("sk-acme",), limits=TenantLimits(requests_per_minute=10))


class _Fleet:
    def block_size(self, model: str) -> int:
        return 16

    def largest_context(self, model: str) -> int:
        return 8_192


class _Stage:
    def __init__(self, access_log: bool = False) -> None:
        self.calibration = PromptCalibration()
        self.outputs = OutputModel(min_samples=1)
        self.quotas = LocalQuotaLedger()
        self.metrics = GatewayMetrics(CollectorRegistry())
        self.settle = Settle(
            self.calibration,
            self.outputs,
            self.quotas,
            Tenancy(lambda: AuthConfig(keys=(ACME,))),
            self.metrics,
            lambda: 100.0,
            lambda: access_log,
            cuts_learned=lambda: self.told.append(True),
        )
        self.told: list[bool] = []


@pytest.fixture
def counters() -> Iterator[TokenCounters]:
    with ThreadPoolExecutor(1) as pool:
        yield TokenCounters(EncodingCache(), pool)


async def _plan(counters: TokenCounters, **extra: Any) -> Plan:
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 200}], **extra}
    planner = Planner(lambda: CONFIG, counters, PromptCalibration(), _Fleet())
    return await planner.plan(json.dumps(body).encode(), "chat")


def _exchange(plan: Plan, answer: Answer | None) -> Exchange:
    request = make_mocked_request("POST", "/v1/chat/completions")
    ex = Exchange(request=request, record=AccessRecord("r1", "POST", request.path), started=99.0)
    ex.plan, ex.answer = plan, answer
    return ex


async def test_a_finished_answer_teaches_its_output_and_prompt(counters: TokenCounters) -> None:
    stage = _Stage()
    plan = await _plan(counters, max_tokens=400)
    ex = _exchange(plan, Answer("a", Usage(prompt_tokens=230, completion_tokens=120)))
    stage.settle.learn(ex)
    assert ex.output_tokens == 120
    assert stage.calibration.backends() == {"a"}  # the stand-in's count against the node's
    shape = stage.outputs.shape("m", "*", 400)
    assert shape is not None and stage.outputs.statistics().observations == 1


async def test_the_answer_that_completes_a_group_re_offers_the_queue(
    counters: TokenCounters,
) -> None:
    """Requests may wait for their group's answers to allow a node's cut: the answer
    that makes the group hold enough says so, once."""
    stage = _Stage()
    plan = await _plan(counters, max_tokens=400)
    for i in range(CUT_SAMPLES + 3):
        stage.settle.learn(_exchange(plan, Answer("a", Usage(230, 100 + i))))
        assert stage.told == ([True] if i >= CUT_SAMPLES - 1 else [])


async def test_a_stream_without_usage_is_taught_by_its_own_count(
    counters: TokenCounters,
) -> None:
    stage = _Stage()
    plan = await _plan(counters, max_tokens=400, stream=True)
    ex = _exchange(plan, Answer("a", None, streamed=77))
    stage.settle.learn(ex)
    assert ex.output_tokens == 77
    assert stage.calibration.backends() == set()  # no prompt count to learn from
    assert stage.outputs.statistics().observations == 1


async def test_what_teaches_nothing(counters: TokenCounters) -> None:
    """No finished answer, n > 1 (the lengths of n sequences are not one's), or a request
    that fixes its own length (ignore_eos, min_tokens: a load test's lengths are not its
    client's): nothing learned of output lengths."""
    stage = _Stage()
    stage.settle.learn(_exchange(await _plan(counters, max_tokens=400), None))
    n3 = _exchange(await _plan(counters, max_tokens=400, n=3), Answer("a", Usage(230, 300)))
    stage.settle.learn(n3)
    for fixed in ({"ignore_eos": True}, {"min_tokens": 300}):
        plan = await _plan(counters, max_tokens=400, **fixed)
        stage.settle.learn(_exchange(plan, Answer("a", Usage(230, 400))))
    assert stage.outputs.statistics().observations == 0
    assert n3.output_tokens == 300  # still what the tenant is charged


async def test_closing_settles_the_charge_with_the_usage_and_counts_the_request(
    counters: TokenCounters, caplog: pytest.LogCaptureFixture
) -> None:
    stage = _Stage(access_log=True)
    plan = await _plan(counters, max_tokens=400)
    ex = _exchange(plan, Answer("a", Usage(230, 120)))
    charge = stage.quotas.take(
        "acme", TenantLimits(output_tokens_per_minute=10_000), 230, 400, 99.0
    )
    assert isinstance(charge, Charge)
    ex.charge = charge
    ex.record.tenant, ex.record.status, ex.record.outcome = "acme", 200, Outcome.OK
    ex.admissions.append(("t", "fits", 0.0))
    ex.first_byte(99.5)
    stage.settle.learn(ex)
    with caplog.at_level(logging.INFO, logger="kvgateway.access"):
        stage.settle.close(ex)
    assert stage.quotas.usage("acme", 100.0)[OUTPUT] == 120  # the 400 reserved, settled
    got = stage.metrics.registry.get_sample_value(
        "gateway_requests_total", {"model": "-", "tier": "-", "backend": "-", "status": "200"}
    )
    assert got == 1.0
    assert any(getattr(r, "access", None) for r in caplog.records)


async def test_a_refused_request_is_refunded_and_told_what_is_left(
    counters: TokenCounters,
) -> None:
    stage = _Stage()
    ex = _exchange(await _plan(counters, max_tokens=400), None)
    assert stage.settle.refused(ex) == {}  # never charged: nothing to say
    charge = stage.quotas.take("acme", ACME.limits, 230, 400, 99.0)
    assert isinstance(charge, Charge)
    ex.charge, ex.record.status = charge, 429
    headers = stage.settle.refused(ex)
    assert stage.quotas.usage("acme", 100.0) == {k: 0 for k in stage.quotas.usage("acme", 100.0)}
    assert headers["x-ratelimit-remaining-requests"] == "10"
