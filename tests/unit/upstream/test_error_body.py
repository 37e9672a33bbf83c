"""Node error bodies reach clients as OpenAI error objects."""

import json

from kvgateway.upstream.error_body import is_error_object, openai_error_body


def test_error_objects_pass_and_anything_else_is_wrapped():
    vllm = json.dumps({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
    old = json.dumps({"object": "error", "message": "bad", "type": "x", "code": 400})
    for body in (vllm.encode(), old.encode()):
        assert is_error_object(body) and openai_error_body(400, body, "n1") == body
    for body, status in ((b"404: Not Found", 404), (b"<html>bad</html>", 400), (b"", 413),
                         (b"[1, 2]", 400), (b'{"error": "text"}', 422), (b"\xff\xfe", 400)):  # fmt: skip
        wrapped = json.loads(openai_error_body(status, body, "n1"))["error"]
        assert wrapped["message"].startswith(f"Backend n1 answered {status}")
        assert wrapped["code"] == f"upstream_{status}" and wrapped["param"] is None
    assert json.loads(openai_error_body(404, b"404: Not Found", "n1"))["error"] == {
        "message": "Backend n1 answered 404: 404: Not Found",
        "type": "NotFoundError",
        "param": None,
        "code": "upstream_404",
    }
    long = openai_error_body(400, b"x" * 10_000, "n1")
    assert len(long) < 700


def test_a_large_body_is_judged_by_its_opening_not_parsed():
    big = b'{"error": {"message": "' + b"x" * 300_000 + b'", "code": 422}}'
    assert is_error_object(big) and openai_error_body(422, big, "n1") is big
    page = b"<html>" + b"x" * 300_000
    assert json.loads(openai_error_body(502, page, "n1"))["error"]["code"] == "upstream_502"
