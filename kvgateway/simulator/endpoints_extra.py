"""vLLM's other OpenAI-compatible endpoints, as the simulated node serves them.

- ``POST /v1/embeddings``: ``{"object": "list", "data": [{"index", "object": "embedding",
  "embedding"}], "usage"}``, floats or base64 float32 (the ``openai`` SDK asks for base64);
- ``POST /v1/rerank`` (and ``/rerank``): ``results`` sorted by ``relevance_score``;
- ``POST /v1/score`` (and ``/score``): one ``score`` per (``text_1``, ``text_2``) pair;
- ``POST /detokenize``: ``{"prompt": text}`` for ``{"tokens": [ids]}`` (``/tokenize`` is
  in ``server.py``);
- ``POST /v1/responses``: see :mod:`.responses`.

Shapes follow ``vllm/entrypoints/pooling`` (EmbeddingResponse, RerankResponse,
ScoreResponse). A real node serves pooling only when started as a pooling model; the
simulator answers them from any node, at once and outside the engine: vectors and scores
are a deterministic function of the text (the same text always gives the same vector),
and the prompt is counted and checked against ``max_model_len`` as vLLM does.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

from aiohttp import web

from kvgateway.simulator import protocol as p
from kvgateway.simulator import wire
from kvgateway.simulator.errors import bad_request
from kvgateway.simulator.node import NODE_KEY, SimNode
from kvgateway.simulator.responses import handle_responses

EMBEDDING_DIMENSIONS = 384


def register_extra_endpoints(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", _embeddings)
    for path in ("/v1/rerank", "/rerank"):
        app.router.add_post(path, _rerank)
    for path in ("/v1/score", "/score"):
        app.router.add_post(path, _score)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_post("/v1/responses", handle_responses)


async def _detokenize(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    model = body.get("model")
    node.check_model(model if isinstance(model, str) else None)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise bad_request("tokens must be a list of token ids.", "tokens")
    try:
        text = node.tokenizer.decode(tokens)
    except ValueError as exc:
        raise bad_request(str(exc), "tokens") from exc
    return wire.json_response({"prompt": text})


def vector(text: str, dimensions: int) -> list[float]:
    """A unit vector that depends only on the text (and the dimension count)."""
    out: list[float] = []
    counter = 0
    while len(out) < dimensions:
        digest = hashlib.sha256(f"{counter}:{text}".encode()).digest()
        out.extend((b - 127.5) / 127.5 for b in digest)
        counter += 1
    del out[dimensions:]
    norm = math.sqrt(sum(v * v for v in out)) or 1.0
    return [v / norm for v in out]


def _texts(body: dict[str, Any], key: str) -> list[str]:
    value = body.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [" ".join(map(str, value))]  # token ids: one prompt
    raise bad_request(f"{key} must be a string or a non-empty list of strings.", key)


async def _counted(node: SimNode, texts: list[str], what: str) -> int:
    """Prompt tokens of all ``texts``; each must fit ``max_model_len`` on its own."""
    limit = node.settings.max_model_len
    total = 0
    for text in texts:
        n = max(1, await node.tokenizer.count_prompt_async(text))
        if n > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n} tokens in the input for {what}. Please reduce the length "
                "of the input.",
                "input_tokens",
            )
        total += n
    return total


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {**wire.usage(prompt_tokens, 0), "prompt_tokens_details": None}


async def _embeddings(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    model = body.get("model")
    node.check_model(model if isinstance(model, str) else None)
    texts = _texts(body, "input")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise bad_request("dimensions must be a positive integer.", "dimensions")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("encoding_format must be float or base64.", "encoding_format")
    tokens = await _counted(node, texts, "embedding generation")
    data = []
    for i, text in enumerate(texts):
        vec = vector(text, dims or EMBEDDING_DIMENSIONS)
        embedding: list[float] | str = vec
        if fmt == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"index": i, "object": "embedding", "embedding": embedding})
    return wire.json_response(
        {
            "id": wire.new_id("embd"),
            "object": "list",
            "created": wire.now_ts(),
            "model": node.settings.model,
            "data": data,
            "usage": _usage(tokens),
        }
    )


def relevance(query: str, document: str) -> float:
    """A score in (0, 1): the cosine of the two texts' vectors, squashed."""
    a, b = vector(query, 64), vector(document, 64)
    cosine = sum(x * y for x, y in zip(a, b, strict=True))
    return 1 / (1 + math.exp(-8 * cosine))


async def _rerank(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    model = body.get("model")
    node.check_model(model if isinstance(model, str) else None)
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("query must be a string.", "query")
    documents = _texts(body, "documents")
    top_n = body.get("top_n") or len(documents)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise bad_request("top_n must be a positive integer.", "top_n")
    tokens = await _counted(node, [query + d for d in documents], "reranking")
    scores = [relevance(query, d) for d in documents]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    ranked = [
        {"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]}
        for i in order
    ]
    return wire.json_response(
        {
            "id": wire.new_id("rerank"),
            "model": node.settings.model,
            "usage": {"total_tokens": tokens},
            "results": ranked[:top_n],
        }
    )


async def _score(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body = p.parse_json(await request.read())
    model = body.get("model")
    node.check_model(model if isinstance(model, str) else None)
    firsts, seconds = _texts(body, "text_1"), _texts(body, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request("text_1 and text_2 must have the same length.", "text_2")
    tokens = await _counted(node, [a + b for a, b in zip(firsts, seconds, strict=True)], "score")
    data = [
        {"index": i, "object": "score", "score": relevance(a, b)}
        for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
    ]
    return wire.json_response(
        {
            "id": wire.new_id("score"),
            "object": "list",
            "created": wire.now_ts(),
            "model": node.settings.model,
            "data": data,
            "usage": _usage(tokens),
        }
    )
