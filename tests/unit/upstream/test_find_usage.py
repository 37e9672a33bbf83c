"""Usage read from an answer: the node's, never a number the client planted."""

import json

from kvgateway.upstream.client import Usage, find_usage


def test_usage_fields_planted_in_echoed_request_json_are_not_read():
    # vLLM's Responses answer echoes the request's text.format schema and tools right
    # before its usage: a schema key "output_tokens": 0 made every answer free.
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
