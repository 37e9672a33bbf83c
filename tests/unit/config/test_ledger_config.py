import pytest

from kvgateway.config.load import parse_config
from kvgateway.config.yamlread import ConfigError

BASE = {
    "models": [{"name": "m"}],
    "tiers": [{"name": "t", "backends": [{"name": "a", "url": "http://a:1", "model": "m"}]}],
}


def test_no_ledger_section_means_the_in_process_ledger():
    cfg = parse_config(BASE)
    assert not cfg.ledger.shared and cfg.ledger.lease_s == 10.0


def test_a_redis_ledger_reads_every_key():
    cfg = parse_config(
        BASE
        | {
            "ledger": {
                "url": "rediss://r:6380/1",
                "password_env": "PW",
                "lease_s": 6,
                "timeout_s": 0.5,
                "replica_id": "gw-0",
                "namespace": "prod",
                "fallback_replicas": 4,
                "credit_max_requests": 8,
            }
        }
    )
    led = cfg.ledger
    assert led.shared and led.url == "rediss://r:6380/1" and led.password_env == "PW"
    assert (led.lease_s, led.timeout_s, led.replica_id, led.namespace) == (6, 0.5, "gw-0", "prod")
    assert led.fallback_replicas == 4 and led.credit_max_requests == 8


@pytest.mark.parametrize(
    ("ledger", "message"),
    [
        ({"url": "http://r:6379"}, "ledger.url: expected redis://HOST:PORT/DB or rediss://"),
        ({"url": "redis://r", "lease_s": 3, "timeout_s": 2}, "ledger.timeout_s: must be at most"),
        ({"url": "redis://r", "lease_s": 0}, "ledger.lease_s"),
        ({"url": "redis://r", "port": 1}, "ledger.port"),
        ({"url": "redis://r", "credit_max_requests": 0}, "ledger.credit_max_requests"),
    ],
)
def test_ledger_errors_name_the_key(ledger, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_config(BASE | {"ledger": ledger})
