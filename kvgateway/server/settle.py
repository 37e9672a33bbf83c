"""Settle, the last stage: what a request teaches and what it costs, once it has ended.

Synchronous, and fed only by the :class:`~kvgateway.server.exchange.Exchange`: the relay
records what it saw (:class:`~kvgateway.server.exchange.Answer`) and trains nothing.
:meth:`Settle.learn` takes a finished answer's usage (the output the tenant is charged,
the nodes' prompt count for calibration, one sequence's length for the output model);
:meth:`Settle.close` settles the tenant's charge, then counts the request in the metrics
and writes its access line.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgateway.core.output_model import OutputModel
from kvgateway.core.quota import QuotaLedger
from kvgateway.core.tenancy import Tenancy
from kvgateway.server.exchange import Exchange, finish
from kvgateway.server.metrics import GatewayMetrics
from kvgateway.server.tenants import limit_headers, settle
from kvgateway.tokens.prompt_estimate import PromptCalibration

Clock = Callable[[], float]


class Settle:
    """Owns the Settle stage. ``access_log`` is read per request (a reload may turn it)."""

    def __init__(
        self,
        calibration: PromptCalibration,
        outputs: OutputModel,
        quotas: QuotaLedger,
        tenancy: Tenancy,
        metrics: GatewayMetrics,
        clock: Clock,
        access_log: Callable[[], bool],
        cuts_learned: Callable[[], None] = lambda: None,
    ) -> None:
        self._calibration = calibration
        self._outputs = outputs
        self._quotas = quotas
        self._tenancy = tenancy
        self._metrics = metrics
        self._clock = clock
        self._access_log = access_log
        # Told when a group's answers first allow a node's context to cut its requests:
        # requests waiting for such a cut may be served now.
        self._cuts_learned = cuts_learned

    def learn(self, ex: Exchange) -> None:
        """What a finished answer (``ex.answer``) says: the output it generated (from
        ``usage``, else a stream's own count), the nodes' count of a stand-in-counted
        prompt, and one sequence's output length."""
        plan, answer = ex.plan, ex.answer
        if plan is None or answer is None:
            return
        usage = answer.usage
        output = usage.completion_tokens if usage is not None else None
        if output is None:
            output = answer.streamed
        if output is not None:
            ex.output_tokens = output
        # vLLM reports the prompt once per request, whatever n is. Learned on the
        # stand-in's own count (what calibration scales); exact counts need no correction.
        prompt = plan.prompt
        if (
            usage is not None
            and prompt.prompts == 1
            and not prompt.exact
            and not prompt.truncated
            and not prompt.uncalibrated
        ):
            self._calibration.observe(
                answer.backend, plan.model.name, prompt.standin, usage.prompt_tokens
            )
        # One sequence's length per request: the mean of n sequences is narrower than the
        # lengths it averages (and hides one cut at its cap), so n > 1 teaches nothing.
        if output is None or plan.parsed.echo_only or plan.demand.sequences != 1:
            return
        if self._outputs.observe(
            plan.model.name, ex.client, plan.output_tokens, output, cap=answer.cap
        ):
            self._cuts_learned()

    def refused(self, ex: Exchange) -> dict[str, str]:
        """Settle a refused request's charge now (one never admitted is refunded) and
        give the tenant's ``x-ratelimit-*`` headers: what it has left after this request,
        not what its charge had taken ({} for a request never charged)."""
        if ex.charge is None:
            return {}
        now = self._clock()
        settle(ex, self._quotas, now)
        return limit_headers(self._quotas, self._tenancy, ex.charge.tenant, now)

    def close(self, ex: Exchange) -> None:
        """The request has ended: settle its charge, count it, log it."""
        now = self._clock()
        settle(ex, self._quotas, now)
        finish(ex, self._metrics, now, self._access_log())
