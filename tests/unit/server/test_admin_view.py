from kvgateway.server.admin import _without_userinfo


def test_a_configured_credential_never_shows_in_the_admin_view() -> None:
    assert _without_userinfo("http://user:s3cret@10.0.0.5:8000/v1") == "http://10.0.0.5:8000/v1"
    assert _without_userinfo("https://tok@node.internal") == "https://node.internal"
    assert _without_userinfo("http://10.0.0.5:8000") == "http://10.0.0.5:8000"
    # An @ in the path is not a credential.
    assert _without_userinfo("http://n:8000/a@b") == "http://n:8000/a@b"
