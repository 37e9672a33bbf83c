"""What to count for a request, before any encoding: the text pieces of each prompt and
the tokens its chat template and images add (pure; :mod:`.counting` counts a plan)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvgateway.tokens.spec import TokenizerConfig

# Content parts charged ``image_tokens`` each (other media parts are counted as JSON text).
IMAGE_PARTS = ("image_url", "input_image", "image")


@dataclass(slots=True)
class CountPlan:
    """What to count for one request: texts to encode plus fixed template tokens.

    ``groups`` holds one list of piece indexes per prompt (a completions request may
    batch several prompts, each a separate sequence on the node).
    """

    pieces: list[str] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    fixed: list[int] = field(default_factory=list)

    def new_group(self, fixed: int = 0) -> None:
        self.groups.append([])
        self.fixed.append(fixed)

    def add_text(self, text: str) -> None:
        if text:
            self.groups[-1].append(len(self.pieces))
            self.pieces.append(text)

    def add_fixed(self, tokens: int) -> None:
        self.fixed[-1] += tokens


def content_text(plan: CountPlan, content: Any, cfg: TokenizerConfig) -> None:
    """Add a message's content: its text parts, each image's fixed cost, and the JSON of
    any other part (an unknown part is never free)."""
    if isinstance(content, str):
        plan.add_text(content)
        return
    if not isinstance(content, list):
        return
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in {"text", "input_text"}:
            text = part.get("text")
            if isinstance(text, str):
                plan.add_text(text)
        elif kind in IMAGE_PARTS:
            plan.add_fixed(cfg.image_tokens)
        elif kind == "refusal":
            text = part.get("refusal")
            if isinstance(text, str):
                plan.add_text(text)
        else:
            # Audio, files and future part types: count their JSON so an unknown part
            # is never free.
            plan.add_text(json.dumps(part, separators=(",", ":")))


def plan_chat(body: dict[str, Any], cfg: TokenizerConfig) -> CountPlan:
    """Token plan for a chat request (``messages`` already validated as a list of dicts)."""
    plan = CountPlan()
    plan.new_group(cfg.reply_priming_tokens)
    for msg in body["messages"]:
        plan.add_fixed(cfg.per_message_tokens)
        role = msg.get("role")
        if isinstance(role, str):
            plan.add_fixed(1)  # a role name is a single token in every common template
        content_text(plan, msg.get("content"), cfg)
        name = msg.get("name")
        if isinstance(name, str):
            plan.add_fixed(cfg.per_name_tokens)
            plan.add_text(name)
        tool_calls = msg.get("tool_calls")
        if isinstance(tool_calls, list):
            for call in tool_calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    plan.add_text(str(fn.get("name", "")))
                    plan.add_text(str(fn.get("arguments", "")))
        fn_call = msg.get("function_call")
        if isinstance(fn_call, dict):
            plan.add_text(str(fn_call.get("name", "")))
            plan.add_text(str(fn_call.get("arguments", "")))
    # Tool and function schemas are rendered into the prompt by the chat template.
    for key in ("tools", "functions"):
        schemas = body.get(key)
        if isinstance(schemas, list) and schemas:
            plan.add_text(json.dumps(schemas, separators=(",", ":"), sort_keys=True))
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        plan.add_text(json.dumps(fmt.get("json_schema"), separators=(",", ":"), sort_keys=True))
    return plan


def plan_completion(prompt: Any) -> tuple[CountPlan, list[int]]:
    """Token plan for a completions ``prompt``; token-id prompts are counted directly.

    Returns the plan and, per prompt, tokens already known (token-id lists).
    """
    plan = CountPlan()
    known: list[int] = []
    prompts: list[Any]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    for p in prompts:
        plan.new_group()
        if isinstance(p, str):
            plan.add_text(p)
            known.append(0)
        else:
            known.append(len(p))
    return plan, known
