"""`gateway check`: validate a config and show every backend's limits and their source."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp

from kvgateway.config.argtypes import positive_number
from kvgateway.config.load import load_config
from kvgateway.config.model import BackendConfig, GatewayConfig, ModelConfig
from kvgateway.config.yamlread import ConfigError
from kvgateway.core.backends import DEFAULT_MAX_NUM_SEQS, Limits, Observed, resolve_limits
from kvgateway.core.derived_limits import derive_backend, model_dir_groups
from kvgateway.upstream.dns import DnsLookupError, resolve_group
from kvgateway.upstream.probe import ProbeError, probe


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        help="validate a config and show each backend's resolved limits",
        description=(
            "Validate the YAML, ask every reachable node for its limits (/v1/models, /metrics), "
            "derive limits from capacity blocks, and print each limit with its source "
            "(config > discovered > derived). Warns when sources disagree. Exits 2 on an "
            "invalid config, 1 when some model has no routable backend (none reachable with "
            "known limits; with --no-discover: none whose limits are known or discoverable)."
        ),
    )
    p.add_argument("--config", required=True)
    p.add_argument("--no-discover", action="store_true", help="do not contact the nodes")
    p.add_argument(
        "--timeout", type=positive_number, default=3.0, help="per-node probe timeout (s)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        base = Path(args.config).parent
        derived = {b.name: derive_backend(b, base) for b in config.backends}
        groups = model_dir_groups(config)
    except ConfigError as exc:
        sys.stderr.write(f"invalid config: {exc}\n")
        return 2
    discovered: dict[str, Observed | str] = {}
    backends = list(config.backends)
    if not args.no_discover:
        members, discovered = asyncio.run(_discover_all(config, args.timeout))
        backends += members
        derived.update({b.name: derive_backend(b, base) for b in members})
    rows = []
    for b in backends:
        d = derived[b.name]
        disc = discovered.get(b.name)
        from_dir = Observed(kv_groups=groups[b.model]) if b.model in groups else None
        limits = resolve_limits(
            b, disc if isinstance(disc, Observed) else None, d[0] if d else from_dir
        )
        rows.append(_row(b, limits, disc, config.admission.budget_fraction))
    unroutable = _unroutable_models(config, rows, asked=not args.no_discover)
    models = [_model_row(m) for m in config.models]
    if args.json:
        doc = {
            "config": args.config,
            "models": models,
            "backends": rows,
            "unroutable_models": unroutable,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(_text(config, rows, models))
        for g in config.dns_groups:
            state = "members listed above" if not args.no_discover else "looked up at run time"
            sys.stdout.write(
                f"{g.name}  tier={g.template.tier}  "
                + (f"srv {g.dns} " if g.lookup == "srv" else f"dns {g.dns} port {g.port} ")
                + f"every {g.resolve_interval_s:g}s  model={g.template.model} ({state})\n"
            )
        for model, why in unroutable.items():
            sys.stdout.write(f"ERROR: model {model}: no routable backend ({why})\n")
    return 1 if unroutable else 0


def _routable(row: dict[str, Any], asked: bool) -> bool:
    """Would the gateway send work to this backend? Without asking: could it, once up?"""
    known = row["max_model_len"]["value"] is not None and row["kv_cache_tokens"]["value"]
    if asked:
        return bool(known) and not str(row["node"]).startswith("unreachable")
    return bool(known) or bool(row["discover"])


def _unroutable_models(
    config: GatewayConfig, rows: list[dict[str, Any]], *, asked: bool
) -> dict[str, str]:
    """Each model none of whose backends is routable, with the reason."""
    out: dict[str, str] = {}
    groups = {g.template.model for g in config.dns_groups}
    for model in config.models:
        mine = [r for r in rows if r["model"] == model.name]
        if any(_routable(r, asked) for r in mine) or (model.name in groups and not asked):
            continue
        if not mine:
            out[model.name] = "no backend serves it" + (
                " (its DNS groups resolved to no address)" if model.name in groups else ""
            )
        elif asked:
            out[model.name] = "every backend is unreachable or has unknown limits"
        else:
            out[model.name] = "limits unknown and discovery disabled on every backend"
    return out


async def _discover_all(
    config: GatewayConfig, timeout: float
) -> tuple[list[BackendConfig], dict[str, Observed | str]]:
    """The DNS groups' current members, and what every backend says about its limits."""
    members: list[BackendConfig] = []
    for group in config.dns_groups:
        try:
            endpoints = await resolve_group(
                group, timeout=timeout, nameservers=config.discovery.nameservers
            )
        except DnsLookupError as exc:
            sys.stderr.write(f"warning: {group.template.path}.dns: {exc}\n")
            continue
        members += [group.member(a, port) for a, port in sorted(endpoints)]
    async with aiohttp.ClientSession() as session:

        async def one(b: BackendConfig) -> tuple[str, Observed | str]:
            if not b.discover:
                return b.name, "discovery disabled"
            try:
                return b.name, (await probe(session, b, timeout)).observed
            except ProbeError as exc:
                return b.name, f"unreachable: {exc}"

        backends = (*config.backends, *members)
        return members, dict(await asyncio.gather(*(one(b) for b in backends)))


def _row(
    b: BackendConfig, limits: Limits, disc: Observed | str | None, fraction: float
) -> dict[str, Any]:
    def lim(name: str) -> dict[str, Any]:
        value = getattr(limits, name)
        return {"value": value.value, "source": value.source}

    seqs = lim("max_num_seqs")
    if seqs["value"] is None:
        # What admission then uses (Backend.max_num_seqs): said the same in text and JSON.
        seqs = {"value": DEFAULT_MAX_NUM_SEQS, "source": "assumed"}

    kv = limits.kv_cache_tokens.value
    mml = limits.max_model_len.value
    return {
        "name": b.name,
        "tier": b.tier,
        "url": b.url,
        "model": b.model,
        "served_model": b.served_model,
        "offload": b.offload,
        "discover": b.discover,
        "max_model_len": lim("max_model_len"),
        "kv_cache_tokens": lim("kv_cache_tokens"),
        "max_num_seqs": seqs,
        "kv_groups": limits.kv_groups,
        "node_kv_tokens": limits.node_kv_tokens,
        "budget_tokens": int(kv * fraction) if kv else None,
        "context_limit": min(mml, int(kv * fraction)) if kv and mml else None,
        "node": disc if isinstance(disc, str) else ("reachable" if disc else "not asked"),
        "warnings": list(limits.warnings),
    }


def _model_row(model: ModelConfig) -> dict[str, Any]:
    """How the model's prompts are counted: exactly, or by a stand-in and its bound."""
    tok = model.tokenizer
    if tok.model is not None:
        return {
            "name": model.name,
            "counting": "exact",
            "tokenizer": tok.model.name,
            "path": tok.path,
            "why": tok.model.engine_note,
            "chat_templates": sorted(tok.model.templates),
        }
    return {"name": model.name, "counting": "stand-in", "tokenizer": tok.encoding.describe()}


def _text(config: GatewayConfig, rows: list[dict[str, Any]], models: list[dict[str, Any]]) -> str:
    out = [
        f"config {config.source}: OK ({len(config.models)} model(s), {len(config.tiers)} tier(s), "
        f"{len(rows)} backend(s), policy {config.routing.policy}, "
        f"budget_fraction {config.admission.budget_fraction:g})",
        "",
    ]
    for m in models:
        if m["counting"] == "exact":
            templates = ", ".join(m["chat_templates"]) or "none (chat requests will fail)"
            out.append(f"model {m['name']}: counts exactly with {m['tokenizer']} ({m['why']})")
            out.append(f"    {m['path']}; chat templates: {templates}")
        else:
            out.append(
                f"model {m['name']}: counts with the stand-in {m['tokenizer']} "
                "(set tokenizer.path to the model's tokenizer to count exactly)"
            )
    out.append("")
    for r in rows:
        tier = r["tier"] + (" (offload)" if r["offload"] else "")

        def show(key: str, row: dict[str, Any] = r) -> str:
            v = row[key]
            value = "?" if v["value"] is None else f"{v['value']:,}"
            return f"{value} [{v['source']}]"

        out.append(
            f"{r['name']}  tier={tier}  {r['url']}  model={r['model']} ({r['served_model']})"
        )
        out.append(f"    max_model_len    {show('max_model_len')}")
        out.append(f"    kv_cache_tokens  {show('kv_cache_tokens')}")
        if r["kv_groups"] > 1 or r["node_kv_tokens"] is not None:
            said = r["node_kv_tokens"]
            out.append(
                f"    kv_groups        {r['kv_groups']}"
                + (f"; the node states {said:,} tokens of max-length requests" if said else "")
            )
        out.append(f"    max_num_seqs     {show('max_num_seqs')}")
        if r["budget_tokens"] is not None:
            out.append(
                f"    budget           {r['budget_tokens']:,} tokens; longest request "
                f"{(r['context_limit'] or 0):,} tokens"
            )
        out.append(f"    node             {r['node']}")
        for w in r["warnings"]:
            out.append(f"    WARNING          {w}")
        if r["max_model_len"]["value"] is None:
            out.append(
                "    WARNING          limits unknown: the gateway will not route here until "
                "the node answers (or set max_model_len/kv_cache_tokens, or a capacity block)"
            )
        out.append("")
    return "\n".join(out)
