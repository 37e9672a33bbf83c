from kvgateway.config.load import parse_config
from kvgateway.core.fleet import Fleet


def _config(names):
    return parse_config(
        {
            "models": [{"name": "m"}],
            "tiers": [
                {
                    "name": "t",
                    "backends": [
                        {
                            "name": n,
                            "url": f"http://{n}.invalid:9",
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
