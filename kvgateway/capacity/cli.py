"""``gateway plan``: size a vLLM node's KV cache, or explain its start-up log.

The only module of the package that reads files or prints. Flags are turned into the
same mapping a YAML ``capacity:`` block holds and parsed by
:meth:`CapacitySpec.from_mapping`, so the CLI and the gateway config cannot disagree;
its errors are reported against the flag (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgateway.capacity.advice import make_plan
from kvgateway.capacity.arch import DTYPE_BYTES, KV_CACHE_DTYPES, KV_DTYPE_ALIASES
from kvgateway.capacity.errors import CapacityConfigError
from kvgateway.capacity.explain import explain_log
from kvgateway.capacity.loggedpool import logged_block_size, missing_lines
from kvgateway.capacity.logparse import parse_vllm_log
from kvgateway.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION, GIB
from kvgateway.capacity.presets import find_preset
from kvgateway.capacity.report import log_json, plan_json, render_log, render_plan, render_presets
from kvgateway.capacity.spec import CapacitySpec
from kvgateway.capacity.speculative import SPECULATIVE_METHODS

# config.json keys of the explicit-numbers flags, for naming the flag in errors.
_EXPLICIT = {
    "num_hidden_layers": "--num-layers",
    "num_key_value_heads": "--num-kv-heads",
    "head_dim": "--head-dim",
    "kv_lora_rank": "--kv-lora-rank",
    "qk_rope_head_dim": "--qk-rope-head-dim",
    "torch_dtype": "--model-dtype",
}


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="size a vLLM node's KV cache and recommend settings",
        description=(
            "Compute a vLLM node's KV capacity (bytes per token, pool, tokens, longest "
            "context, concurrency) from the model architecture and GPU memory, recommend "
            "settings in the order to try them, and print the vllm serve flags and the "
            "gateway backend entry. Exits 1 when the model does not fit the node at all, "
            "and then starts with what would (tensor parallel size, quantized weights, a "
            "larger card). With --from-log, explain a vLLM start-up log instead."
        ),
    )
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--preset", metavar="NAME", help="built-in model (see --list-presets)")
    model.add_argument("--model-config", metavar="PATH", help="Hugging Face config.json (or dir)")
    model.add_argument("--list-presets", action="store_true", help="list presets and exit")
    explicit = parser.add_argument_group("model from explicit numbers")
    explicit.add_argument("--num-layers", type=_positive_int)
    explicit.add_argument("--num-kv-heads", type=_positive_int)
    explicit.add_argument("--head-dim", type=_positive_int)
    explicit.add_argument("--kv-lora-rank", type=_positive_int, help="MLA latent rank")
    explicit.add_argument("--qk-rope-head-dim", type=_positive_int, help="MLA rope dims")
    explicit.add_argument("--model-dtype", choices=sorted(DTYPE_BYTES), default=None)
    explicit.add_argument("--params-billion", type=_positive_float, help="sizes the weights")
    node = parser.add_argument_group("node")
    node.add_argument("--gpu-memory-gib", type=_positive_float, help="per GPU, as torch sees it")
    node.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_positive_int)
    node.add_argument(
        "--pp",
        "--pipeline-parallel-size",
        dest="pp",
        type=_positive_int,
        help="pipeline stages; each holds its share of the layers (vLLM's get_pp_indices)",
    )
    node.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        help=f"default {DEFAULT_GPU_MEMORY_UTILIZATION} (vLLM's since 2026-04; 0.90 before)",
    )
    node.add_argument(
        "--kv-cache-dtype", choices=(*KV_CACHE_DTYPES, *KV_DTYPE_ALIASES), default=None
    )
    node.add_argument(
        "--kv-cache-memory-gib",
        type=_positive_float,
        help="the KV memory vLLM reported ('Available KV cache memory'); replaces the estimate",
    )
    node.add_argument("--weights-gib", type=_positive_float, help="per GPU; replaces the estimate")
    node.add_argument(
        "--overhead-gib", type=_positive_float, help="activation + non-torch + CUDA graphs"
    )
    node.add_argument("--block-size", type=_positive_int)
    node.add_argument("--max-model-len", type=_positive_int, help="target context length")
    node.add_argument("--max-num-seqs", type=_positive_int)
    node.add_argument("--max-num-batched-tokens", type=_positive_int)
    spec_dec = parser.add_argument_group("speculative decoding (the drafter shares the KV pool)")
    spec_dec.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None)
    spec_dec.add_argument("--num-speculative-tokens", type=_positive_int)
    spec_dec.add_argument("--draft-layers", type=_positive_int, help="drafter KV layers")
    spec_dec.add_argument("--draft-preset", metavar="NAME", help="draft_model: its preset")
    spec_dec.add_argument(
        "--draft-weights-gib", type=_positive_float, help="drafter weights per GPU"
    )
    parser.add_argument(
        "--from-log", metavar="FILE", help="explain a vLLM start-up log (- = stdin)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"gateway plan: error: {message}", file=sys.stderr)
    return 2


def _flag_for(path: str) -> str:
    head, paren, tail = path.partition(" (")
    key, _, rest = head.partition(".")
    if key == "model_config" and rest and not paren:  # explicit numbers, inline config
        sub = rest.split(".")[0]
        return _EXPLICIT.get(sub, "--" + sub.replace("_", "-"))
    if key == "speculative" and rest:
        sub = rest.split(".")[0]
        return "--speculative-method" if sub == "method" else "--" + sub.replace("_", "-")
    flag = "--" + key.replace("_", "-") if key else ""
    return flag + (paren + tail if paren else "")


def _mapping(args: argparse.Namespace) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key in (
        "preset", "gpu_memory_gib", "gpu_memory_utilization", "tp", "kv_cache_dtype",
        "block_size", "kv_cache_memory_gib", "weights_gib", "overhead_gib", "max_model_len",
        "max_num_seqs", "max_num_batched_tokens", "pp",
    ):  # fmt: skip
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    drafter = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "draft_layers": args.draft_layers,
        "draft_preset": args.draft_preset,
        "draft_weights_gib": args.draft_weights_gib,
    }
    if args.speculative_method is not None:
        data["speculative"] = {"method": args.speculative_method} | {
            k: v for k, v in drafter.items() if v is not None
        }
    elif any(v is not None for v in drafter.values()):
        raise CapacityConfigError("--speculative-method", "missing: the drafter flags need it")
    if args.model_config is not None:
        data["model_config"] = args.model_config
    explicit = {
        "num_hidden_layers": args.num_layers,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "torch_dtype": args.model_dtype,
    }
    if any(v is not None for v in explicit.values()):
        if "preset" in data or "model_config" in data:
            detail = "explicit numbers replace --preset/--model-config; give one or the other"
            raise CapacityConfigError("--num-layers", detail)
        data["model_config"] = {k: v for k, v in explicit.items() if v is not None}
        if args.params_billion is not None and args.weights_gib is None:
            dtype_bytes = DTYPE_BYTES.get(args.model_dtype or "bfloat16", 2)
            data["weights_gib"] = args.params_billion * 1e9 * dtype_bytes / (args.tp or 1) / GIB
    return data


def _read(source: str, read_stdin: Callable[[], str]) -> str:
    if source == "-":
        return read_stdin()
    return Path(source).read_text(encoding="utf-8", errors="replace")


def _spec(data: dict[str, Any]) -> CapacitySpec:
    try:
        return CapacitySpec.from_mapping(data, "")
    except CapacityConfigError as exc:
        raise CapacityConfigError(_flag_for(exc.path), exc.detail) from None


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        print(render_presets())
        return 0
    try:
        data = _mapping(args)
    except CapacityConfigError as exc:
        return _fail(str(exc))
    has_model = "preset" in data or "model_config" in data
    if args.from_log is not None:
        try:
            text = _read(args.from_log, sys.stdin.read)
        except OSError as exc:
            return _fail(f"--from-log: cannot read {args.from_log!r}: {exc.strerror or exc}")
        facts = parse_vllm_log(text)
        if facts.is_empty:
            expected = "; ".join(missing_lines(facts))
            return _fail(f"--from-log: no vLLM KV-cache lines found in {args.from_log!r} "
                         f"(looked for: {expected})")  # fmt: skip
        spec = None
        known = _logged_preset(facts.model) if not has_model and "num_layers" not in data else None
        if known is not None:
            # The log names a built-in model: its layout reads the log (a hybrid model's
            # logged count is not its pool), unless the caller gives another.
            data["preset"], has_model = known, True
            print(
                f"gateway plan: the log names {facts.model}: read with the built-in preset "
                f"{known} (--preset or --model-config to read it otherwise)",
                file=sys.stderr,
            )
        if has_model:
            if "gpu_memory_gib" not in data and "kv_cache_memory_gib" not in data:
                data["kv_cache_memory_gib"] = facts.available_kv_gib or 1.0
            # The node's block size (passed, or its device's default: 128 on CPU).
            data.setdefault("block_size", logged_block_size(facts))
            try:
                spec = _spec(data)
            except CapacityConfigError as exc:
                return _fail(str(exc))
        report = explain_log(facts, spec)
        print(json.dumps(log_json(report), indent=2) if args.json else render_log(report))
        return 0
    if not has_model:
        return _fail("give --preset NAME, --model-config PATH or explicit --num-layers/... "
                     "(or --from-log FILE, or --list-presets)")  # fmt: skip
    try:
        plan = make_plan(_spec(data))
    except CapacityConfigError as exc:
        return _fail(str(exc))
    print(json.dumps(plan_json(plan), indent=2) if args.json else render_plan(plan))
    return 0 if plan.fits else 1


def _logged_preset(model: str | None) -> str | None:
    """The built-in preset of the model a log names, if there is one."""
    if not model:
        return None
    try:
        return find_preset(model).name
    except CapacityConfigError:
        return None
