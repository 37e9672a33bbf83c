"""Usage read from an answer: the node's, never a number the client planted."""

import json

from kvgateway.upstream.client import Usage, find_usage


def test_usage_fields_planted_in_echoed_request_json_are_not_read():
    # vLLM's Responses answer echoes the request's text.format schema and tools right
    # before its usage: taken for it, a schema key "output_tokens": 0 would make every
    # answer free.
    schema = {"type": "object", "output_tokens": 0, "input_tokens": 0}
    tools = [{"type": "function", "name": "f", "parameters": {"output_tokens": 0}}]
    body = {
        "id": "r",
        "object": "response",
        "tools": tools,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
        "usage": {
            "input_tokens": 9,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 30,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 39,
        },
        "user": '"output_tokens": 1',  # string content is escaped: never a bare key
    }
    assert find_usage(json.dumps(body).encode()) == Usage(9, 30)
    chat = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    assert find_usage(json.dumps(chat).encode()) == Usage(5, 7)
    assert find_usage(b'{"usage": null}') is None and find_usage(b"{}") is None


def test_a_string_value_usage_after_the_real_usage_is_not_taken_for_it():
    # vLLM's rerank answer echoes documents after its usage; chat's prompt_logprobs come
    # after usage too: taken for it, a document or token "usage" would hide the real usage
    # (charging 0, or the whole max_tokens).
    rerank = {
        "id": "r",
        "usage": {"prompt_tokens": 367, "total_tokens": 367},
        "results": [{"index": 0, "document": {"text": "usage"}, "relevance_score": 0.5}],
    }
    assert find_usage(json.dumps(rerank).encode()) == Usage(367, None)
    chat = {
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 285},
        "prompt_logprobs": [None, {"42": {"logprob": -1.0, "decoded_token": "usage"}}],
    }
    assert find_usage(json.dumps(chat).encode()) == Usage(12, 285)
    assert find_usage(b'{"a": "usage", "b": "usage"}') is None
