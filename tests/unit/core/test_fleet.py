from kvgateway.config.load import parse_config
from kvgateway.core.fleet import Fleet


def _config(names, url="http://{}.invalid:9"):
    return parse_config(
        {
            "models": [{"name": "m"}],
            "tiers": [
                {
                    "name": "t",
                    "backends": [
                        {
                            "name": n,
                            "url": url.format(n),
                            "model": "m",
                            "max_model_len": 4096,
                            "kv_cache_tokens": 65536,
                        }
                        for n in names
                    ],
                }
            ],
        }
    )


def test_a_removed_backend_leaves_when_its_last_request_ends():
    fleet = Fleet(_config(["a", "b"]))
    a = fleet.get("a")
    assert a is not None
    fleet.adjust(a, 100, 1, 1)
    fleet.adjust(a, 100, 1, 1)
    summary = fleet.apply(_config(["b"]), {})
    assert summary.removed == ("a",)
    assert a.draining and a in fleet.backends and fleet.get("a") is None
    fleet.adjust(a, -100, -1, -1)
    assert a in fleet.backends  # one request still running
    fleet.adjust(a, -100, -1, -1)
    assert a not in fleet.backends
    assert [b.name for b in fleet.backends] == ["b"]


def test_a_backend_back_before_it_drained_is_the_same_backend_with_its_requests():
    # Removed by one reload, added back by the next while requests still ran on it: one
    # object holding them (with a second, empty one the node's requests would not be in
    # its budget, and /metrics would have the name twice).
    fleet = Fleet(_config(["a", "b"]))
    a = fleet.get("a")
    assert a is not None
    fleet.adjust(a, 300, 1, 1)
    fleet.apply(_config(["b"]), {})
    summary = fleet.apply(_config(["a", "b"]), {})
    assert summary.added == ("a",)
    assert fleet.get("a") is a and not a.draining
    assert [b.name for b in fleet.backends] == ["a", "b"]
    assert a.reserved_tokens == 300
    fleet.adjust(a, -300, -1, -1)
    assert [b.name for b in fleet.backends] == ["a", "b"] and a.reserved_tokens == 0


def test_a_node_given_back_its_old_url_is_its_old_backend_not_a_second_one():
    # x moves to a new url while the old node holds 60,000 tokens, then comes back: one
    # object for the old node (a fresh one would offer 62,259 free tokens on a node with
    # ~5k), and it counts as unchecked (what the node reported is dropped) until probed.
    fleet = Fleet(_config(["x"]))
    old = fleet.get("x")
    assert old is not None
    fleet.adjust(old, 60_000, 1, 1)
    fleet.apply(_config(["x"], url="http://{}-new.invalid:9"), {})
    fleet.apply(_config(["x"]), {})
    assert fleet.get("x") is old and not old.draining and old.reserved_tokens == 60_000
    assert not old.healthy  # probed again before it takes new work
    assert [b.config.url for b in fleet.backends if b.name == "x"] == [old.config.url]
