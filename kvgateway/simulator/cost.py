"""How long a simulated engine step takes: a roofline cost model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Duration of one engine step in simulated seconds: a roofline in four terms.

    ``step_overhead_s + offload_s + max(tokens * prefill_s_per_token, weight_read_s)
    + context_tokens * kv_read_s_per_token``

    - every forward pass reads all GPU-resident weights once (``weight_read_s`` =
      weight bytes / HBM bandwidth) and streams CPU-offloaded weights over PCIe
      (``offload_s``);
    - compute is ~2 * params FLOPs per scheduled token, prefill chunk or decode token
      alike (``prefill_s_per_token``); a step is bound by the larger of compute and the
      weight read, so small decode batches cost the weight read, big prefills their FLOPs;
    - attention reads the KV of every scheduled sequence's context
      (``kv_read_s_per_token`` = KV bytes per token / HBM bandwidth).

    So a bigger batch makes each step slower but yields more tokens per second overall.
    Estimates from public datasheet figures (see profiles.py), right in shape, not exact.
    """

    step_overhead_s: float = 0.002
    weight_read_s: float = 0.016
    offload_s: float = 0.0
    prefill_s_per_token: float = 0.0002
    kv_read_s_per_token: float = 1.31e-7

    def step_duration(self, scheduled_tokens: int, context_tokens: int) -> float:
        if scheduled_tokens <= 0:
            return 0.0
        compute = scheduled_tokens * self.prefill_s_per_token
        return (
            self.step_overhead_s
            + self.offload_s
            + max(compute, self.weight_read_s)
            + context_tokens * self.kv_read_s_per_token
        )
