"""Render plans and log reports as text or JSON-ready dicts (pure; cli.py prints)."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from typing import Any

from kvgateway.capacity import layout as lay
from kvgateway.capacity.advice import Plan, Recommendation, Settings
from kvgateway.capacity.alternatives import needed_len
from kvgateway.capacity.arch import kv_bytes_per_token
from kvgateway.capacity.estimate import CapacityEstimate
from kvgateway.capacity.explain import LogReport
from kvgateway.capacity.loggedpool import per_token_bytes
from kvgateway.capacity.memory import GIB
from kvgateway.capacity.presets import preset_arch, presets
from kvgateway.capacity.spec import CapacitySpec

CONTEXTS = (4096, 8192, 16384, 32768)
_WIDTH = 100


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def serve_command(spec: CapacitySpec, settings: Settings) -> str:
    flags = [
        f"vllm serve {spec.model.hf_id or spec.model.name}",
        f"--max-model-len {settings.max_model_len}",
        f"--max-num-seqs {settings.max_num_seqs}",
        # Pinned because the default moved (0.90 -> 0.92) between releases.
        f"--gpu-memory-utilization {spec.gpu_memory_utilization:.2f}",
    ]
    if spec.tp > 1:
        flags.append(f"--tensor-parallel-size {spec.tp}")
    if spec.pp > 1:
        flags.append(f"--pipeline-parallel-size {spec.pp}")
    drafter = spec.speculative
    if drafter is not None:
        config: dict[str, Any] = {"method": drafter.method}
        if drafter.method not in ("ngram", "mtp"):  # vLLM needs the drafter's checkpoint
            model = drafter.draft_model
            config["model"] = (model.hf_id if model else None) or "DRAFT_MODEL"
        config["num_speculative_tokens"] = drafter.num_speculative_tokens
        flags.append(f"--speculative-config '{json.dumps(config)}'")
    if spec.kv_cache_dtype in ("float32", "float16"):
        # vLLM's --kv-cache-dtype has no such choice: the KV cache follows --dtype.
        flags.append(f"--dtype {spec.kv_cache_dtype}")
    elif spec.kv_cache_dtype != "auto":
        flags.append(f"--kv-cache-dtype {spec.kv_cache_dtype}")
    if spec.block_size != 16:
        flags.append(f"--block-size {spec.block_size}")
    if spec.max_num_batched_tokens:
        flags.append(f"--max-num-batched-tokens {spec.max_num_batched_tokens}")
    return " \\\n    ".join(flags)


def backend_entry(spec: CapacitySpec, settings: Settings) -> dict[str, Any]:
    """The gateway backend to paste. No ``kv_cache_tokens``: a configured value overrides
    what the live node reports, and this one is only an estimate."""
    return {
        "name": f"{spec.model.name}-1",
        "url": "http://HOST:8000",
        "model": spec.model.hf_id or spec.model.name,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
    }


def _yaml_entry(entry: dict[str, Any], kv_cache_tokens: int | None = None) -> list[str]:
    lines = []
    for i, (key, value) in enumerate(entry.items()):
        lines.append(f"{'- ' if i == 0 else '  '}{key}: {value}")
    if kv_cache_tokens is not None:
        lines.append(
            f"  # kv_cache_tokens: {kv_cache_tokens}  # expected; left out so the node's own "
            "number (its /metrics) is used"
        )
    return lines


def _does_not_fit_lines(plan: Plan) -> list[str]:
    est, spec = plan.estimate, plan.spec
    pool = est.pool
    card = f"{spec.gpu_memory_gib:g} GiB GPU" + ("" if spec.tp == 1 else f"s x {spec.tp}")
    lines = textwrap.wrap(
        f"DOES NOT FIT: {spec.model.name} needs {_gib(pool.weights_bytes)} GiB of weights "
        f"per GPU plus {_gib(pool.activation_bytes + pool.overhead_bytes)} GiB of "
        f"activations and overhead, but vLLM may use {_gib(pool.requested_bytes)} GiB of a "
        f"{card} ({spec.gpu_memory_utilization:.2f}); no request fits.",
        _WIDTH,
    )
    need = needed_len(est)
    if not plan.alternatives:
        return [*lines, "", "Nothing tried fits (tensor parallel up to 8, fp8 or 4-bit weights, "
                "cards up to 180 GB): choose a smaller model.", ""]  # fmt: skip
    lines += ["", f"What would fit (each re-estimated; at least {need:,} tokens of context):"]
    for alt in plan.alternatives:
        a = alt.estimate
        lines += textwrap.wrap(
            f"{alt.change}: {a.kv_cache_tokens:,} KV tokens, longest context "
            f"{a.max_model_len_fit:,}",
            _WIDTH,
            initial_indent="  - ",
            subsequent_indent="    ",
        )
    return [*lines, ""]


def _recommendation_lines(recs: tuple[Recommendation, ...]) -> list[str]:
    lines = ["Recommendations, in the order to try them:"]
    for rec in recs:
        lines.append(f"  {rec.step}. {rec.title}")
        lines.extend(textwrap.wrap(rec.detail, _WIDTH, initial_indent="     ",
                                   subsequent_indent="     "))  # fmt: skip
    return lines


def _limiting_stage(est: CapacityEstimate) -> str:
    if est.pp == 1:
        return ""
    stage = min(est.stages, key=lambda st: st.num_blocks)
    return f"; stage {stage.stage + 1} of {est.pp}, the one with the fewest blocks"


def _pool_line(plan: Plan) -> str:
    est, spec = plan.estimate, plan.spec
    pool = est.pool
    if pool.measured:
        return (
            f"{_gib(est.kv_pool_bytes)} GiB per GPU (given: vLLM's Available KV cache memory)"
            + _limiting_stage(est)
        )
    return (
        f"{_gib(pool.pool_bytes)} GiB per GPU = {_gib(pool.requested_bytes)} "
        f"({spec.gpu_memory_gib:g} GiB x {spec.gpu_memory_utilization:.2f}) - weights "
        f"{_gib(pool.weights_bytes)} - activation {_gib(pool.activation_bytes)} - overhead "
        f"{_gib(pool.overhead_bytes)}" + _limiting_stage(est)
    )


def _layers(est: CapacityEstimate) -> str:
    """The layers one GPU holds (its stage's, the drafter's on the last stage) x bytes."""
    largest = max(est.stages, key=lambda st: st.model_layers + st.draft_layers)
    text = f"{largest.model_layers} layers"
    if largest.draft_layers:
        text += f" + {largest.draft_layers} drafter"
    text += f" x {est.bytes_per_token_per_layer:,} B"
    if est.pp > 1:
        text += f"; stage {largest.stage + 1} of {est.pp} holds the most"
    return text


def render_plan(plan: Plan, *, header: bool = True) -> str:
    est, spec = plan.estimate, plan.spec
    model = spec.model
    lines: list[str] = []
    if header:
        lines += [
            f"gateway plan: {model.name}"
            + (f" ({model.hf_id})" if model.hf_id and model.hf_id != model.name else "")
            + f", tp {spec.tp}"
            + (f", pp {spec.pp}" if spec.pp > 1 else "")
            + (f", {spec.speculative.method} drafter" if spec.speculative else "")
            + f", KV cache {spec.kv_cache_dtype}, block size {spec.block_size}",
            "",
        ]
    if not plan.fits:
        lines += _does_not_fit_lines(plan)
    # An explicit max_model_len above the config's (rope scaling) is the working limit.
    limit = max(model.max_position_embeddings or 0, spec.max_model_len or 0)
    conc = "  ".join(f"{n // 1024}k: {est.concurrency_at(n):.2f}x" for n in CONTEXTS)
    lines += [
        f"KV bytes per token   {est.bytes_per_token:,} B per GPU ({_layers(est)})",
        f"KV pool              {_pool_line(plan)}",
        f"GPU blocks           {est.num_gpu_blocks:,} x {est.block_size} tokens"
        + (f" in {est.layout.num_groups} groups" if est.layout.is_hybrid else "")
        + " (block 0 is vLLM's reserved null block)",
        f"kv_cache_tokens      {est.kv_cache_tokens:,} usable (vLLM will log 'GPU KV cache "
        f"size: {est.vllm_logged_tokens:,} tokens'"
        + (
            f"; the newest releases {_logged_at_length(est):,}: tokens at full-length concurrency)"
            if est.layout.is_hybrid
            else ")"
        ),
        f"Longest context      {est.max_model_len_fit:,} tokens for one request"
        + (f" (model limit {limit:,})" if limit else ""),
        f"Concurrency          {conc}",
        f"                     at the target {est.target_len:,}: {est.max_concurrency:.2f}x "
        f"(vLLM will log {est.vllm_logged_concurrency:.2f}x)",
        "",
        *_recommendation_lines(plan.recommendations),
        "",
    ]
    if plan.settings is None:
        fix = "one of the alternatives at the top" if not plan.fits else "step 4 or 5"
        lines.append(f"Nothing to paste yet: no context fits; apply {fix} first.")
    else:
        lines += ["Serve with:", "  " + serve_command(spec, plan.settings), ""]
        lines += ["Gateway backend entry:"]
        entry = backend_entry(spec, plan.settings)
        lines += ["  " + line for line in _yaml_entry(entry, plan.settings.kv_cache_tokens)]
    if est.notes:
        lines += ["", "Assumptions and notes:"]
        for note in est.notes:
            lines += textwrap.wrap(note, _WIDTH, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    est, spec = plan.estimate, plan.spec
    settings = plan.settings
    return {
        "model": spec.model.name,
        "hf_id": spec.model.hf_id,
        "tp": spec.tp,
        "pp": spec.pp,
        "speculative_method": spec.speculative.method if spec.speculative else None,
        "draft_kv_layers": est.draft_layers,
        "stages": [
            {
                "stage": st.stage,
                "layers": st.model_layers,
                "draft_layers": st.draft_layers,
                "kv_pool_bytes": max(0, st.pool_bytes),
                "num_gpu_blocks": st.num_blocks,
            }
            for st in est.stages
        ],
        "fits": plan.fits,
        "what_would_fit": [
            {
                "kind": alt.kind,
                "change": alt.change,
                "tp": alt.estimate.tp,
                "kv_cache_tokens": alt.estimate.kv_cache_tokens,
                "max_model_len_fit": alt.estimate.max_model_len_fit,
            }
            for alt in plan.alternatives
        ],
        "kv_cache_dtype": spec.kv_cache_dtype,
        "block_size": est.block_size,
        "bytes_per_token": est.bytes_per_token,
        "bytes_per_token_per_layer": est.bytes_per_token_per_layer,
        "kv_pool_bytes": est.kv_pool_bytes,
        "kv_pool_gib": round(est.kv_pool_bytes / GIB, 3),
        "kv_pool_measured": est.pool.measured,
        "num_gpu_blocks": est.num_gpu_blocks,
        "kv_cache_tokens": est.kv_cache_tokens,
        "vllm_logged_tokens": est.vllm_logged_tokens,
        "max_model_len_fit": est.max_model_len_fit,
        "target_max_model_len": est.target_len,
        "max_concurrency": round(est.max_concurrency, 4),
        "concurrency": {str(n): round(est.concurrency_at(n), 4) for n in CONTEXTS},
        "recommendations": [
            {"step": r.step, "title": r.title, "detail": r.detail} for r in plan.recommendations
        ],
        "settings": None
        if settings is None
        else {
            "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.max_num_seqs,
            "kv_cache_tokens": settings.kv_cache_tokens,
            "concurrency": round(settings.concurrency, 4),
        },
        "vllm_serve": None if settings is None else serve_command(spec, settings),
        "gateway_backend": None if settings is None else backend_entry(spec, settings),
        "notes": list(est.notes),
    }


def render_log(report: LogReport) -> str:
    facts = report.facts
    lines = ["gateway plan --from-log: what the vLLM start-up log says", ""]
    seen = [f"model {facts.model}" if facts.model else None,
            f"vLLM {facts.vllm_version}" if facts.vllm_version else None,
            f"max_model_len {facts.max_model_len}" if facts.max_model_len else None,
            f"{facts.kv_device} KV cache" if facts.kv_device else None]  # fmt: skip
    if any(seen):
        lines += ["Log: " + ", ".join(s for s in seen if s), ""]
    for finding in report.findings:
        lines += textwrap.wrap(finding, _WIDTH, initial_indent="- ", subsequent_indent="  ")
    if not report.findings:
        lines.append("Nothing about the KV cache could be read from this log.")
    if report.missing:
        lines += ["", "Not in the log (so not explained above):"]
        for line in report.missing:
            lines += textwrap.wrap(line, _WIDTH, initial_indent="  - ", subsequent_indent="    ")
    if report.cross_check is not None:
        check = report.cross_check
        verdict = "matches" if check.ok else "DOES NOT MATCH"
        lines += ["", f"Cross-check against the model: {verdict}"]
        lines += textwrap.wrap(check.detail, _WIDTH, initial_indent="  ", subsequent_indent="  ")
    if report.plan is not None:
        lines += ["", "Plan on the logged KV pool:", "", render_plan(report.plan, header=False)]
    elif report.recommendations:
        lines += ["", *_recommendation_lines(report.recommendations)]
        if report.settings is not None:
            s = report.settings
            lines += ["", "Gateway backend entry (model from the log):"]
            entry = {
                "name": "node-1",
                "url": "http://HOST:8000",
                "model": facts.model or "MODEL",
                "max_model_len": s.max_model_len,
                "max_num_seqs": s.max_num_seqs,
            }
            lines += ["  " + line for line in _yaml_entry(entry, s.kv_cache_tokens)]
    return "\n".join(lines)


def log_json(report: LogReport) -> dict[str, Any]:
    check = report.cross_check
    out: dict[str, Any] = {
        "log": report.facts.as_dict(),
        "findings": list(report.findings),
        "cross_check": None
        if check is None
        else {
            "predicted_tokens": check.predicted_tokens,
            "logged_tokens": check.logged_tokens,
            "deviation": round(check.deviation, 6),
            "ok": check.ok,
            "detail": check.detail,
        },
        "plan": None if report.plan is None else plan_json(report.plan),
        "recommendations": [
            {"step": r.step, "title": r.title, "detail": r.detail} for r in report.recommendations
        ],
        "missing_lines": list(report.missing),
        "pool": None if report.pool is None else asdict(report.pool),
    }
    # The headline figures at the top level, whichever way they were obtained.
    facts = report.facts
    if report.plan is not None:
        est = report.plan.estimate
        out["bytes_per_token"] = est.bytes_per_token
        out["kv_cache_tokens"] = est.kv_cache_tokens
        out["max_model_len_fit"] = est.max_model_len_fit
        out["max_concurrency"] = round(est.max_concurrency, 4)
        if report.plan.settings is not None:
            out["kv_cache_tokens"] = report.plan.settings.kv_cache_tokens
    elif report.settings is not None:
        usable = report.settings.kv_cache_tokens
        implied = per_token_bytes(facts, report.pool) if report.pool else None
        out["bytes_per_token"] = round(implied) if implied else None  # from the log: approximate
        out["kv_cache_tokens"] = usable
        out["max_model_len_fit"] = usable  # one group of full attention assumed
        length = facts.max_model_len
        out["max_concurrency"] = round(usable / length, 4) if length else None
    return out


def render_presets() -> str:
    lines = [f"{'preset':18} {'B/token (tp 1)':>15} {'params':>8}  model / what it shows"]
    for preset in presets():
        arch = preset_arch(preset.name)
        lines.append(
            f"{preset.name:18} {kv_bytes_per_token(arch, 1, 'auto'):>15,} "
            f"{preset.param_count / 1e9:>7.1f}B  {preset.hf_id}: {preset.summary}"
        )
    return "\n".join(lines)


def _logged_at_length(est: CapacityEstimate) -> int:
    return lay.vllm_logged_tokens_at_length(
        est.layout, est.num_gpu_blocks, est.block_size, est.in_flight_tokens, est.target_len
    )
