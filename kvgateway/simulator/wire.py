"""vLLM's response shapes: bodies, SSE chunks, the model list, as vLLM 0.32 writes them.

Field sets and orders follow ``ChatCompletionResponse``, ``CompletionResponse`` and their
stream models (``entrypoints/openai/*/protocol.py``): whole bodies carry every field, null
where vLLM has nothing; stream chunks are dumped with ``exclude_unset``, so each carries
the fields vLLM sets on it (the role chunk ``prompt_token_ids`` and ``prompt_text``, a
finish ``stop_reason``, the last chunk ``system_fingerprint``); the final usage chunk
drops its nulls. JSON is compact and UTF-8, not ASCII-escaped, as pydantic writes it.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

# The release the simulator's API follows (GET /version, system_fingerprint).
VLLM_VERSION = "0.32.0"
SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    """vLLM's ids: the prefix and 16 hex digits (``random_uuid``)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def now_ts() -> int:
    return int(time.time())


def fingerprint(*config: object) -> str:
    """``vllm-<version>-<hash8>``: vLLM hashes its whole config; the node's shape here."""
    digest = hashlib.sha256(repr(config).encode()).hexdigest()[:8]
    return f"vllm-{VLLM_VERSION}-{digest}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def full_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """``UsageInfo`` with every field (whole bodies)."""
    return {
        **usage(prompt_tokens, completion_tokens),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {_compact(obj)}\n\n"


def json_response(body: Any, *, status: int = 200) -> web.Response:
    """A JSON response as vLLM's (FastAPI's JSONResponse) is: compact, UTF-8."""
    return web.Response(
        body=_compact(body).encode(), status=status, headers={"Content-Type": "application/json"}
    )


def models_body(model: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": new_id("modelperm"),
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


def chat_message_choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    # vLLM leaves tool_calls out when there are none (ChatMessage._serialize).
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def completion_choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


class ChunkFormat:
    """One response's bodies and chunks. The per-token event is a string template
    because a busy node writes tens of thousands of them per second."""

    __slots__ = ("_head", "chat", "created", "fingerprint", "id", "model")

    def __init__(self, *, chat: bool, id: str, created: int, model: str, fingerprint: str) -> None:
        self.chat = chat
        self.id = id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        head = _compact(self.chunk([]))
        self._head = "data: " + head.removesuffix("]}")  # ends with `"choices":[`

    def token_event(self, index: int, text_json: str) -> str:
        """``sse(chunk([delta(index, text, None)]))``, pre-serialized (``text_json``:
        the text as a JSON string)."""
        if self.chat:
            body = (
                f'{{"index":{index},"delta":{{"content":{text_json}}},"logprobs":null,'
                '"finish_reason":null,"token_ids":null}'
            )
        else:
            body = (
                f'{{"index":{index},"text":{text_json},"logprobs":null,"finish_reason":null,'
                '"stop_reason":null,"prompt_token_ids":null,"token_ids":null}'
            )
        return f"{self._head}{body}]}}\n\n"

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def delta(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
                **({"stop_reason": None} if finish else {}),
                "token_ids": None,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }

    def role(self, index: int, prompt_tokens: int | None) -> dict[str, Any]:
        """A chat choice's first chunk; ``prompt_tokens`` set: continuous usage."""
        chunk = self.chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if prompt_tokens is not None:
            chunk["usage"] = self.running_usage(prompt_tokens, 0)
        return {**chunk, "prompt_token_ids": None, "prompt_text": None}

    def running_usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """A chunk's continuous usage (chat sets completion_tokens_details)."""
        counts: dict[str, Any] = usage(prompt_tokens, completion_tokens)
        return {**counts, "completion_tokens_details": None} if self.chat else counts

    def final_usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        chunk = self.chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        chunk["system_fingerprint"] = self.fingerprint
        return chunk

    def body(self, choices: list[dict[str, Any]], prompt: int, completion: int) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        head = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": full_usage(prompt, completion),
        }
        if self.chat:
            head.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        return {**head, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
