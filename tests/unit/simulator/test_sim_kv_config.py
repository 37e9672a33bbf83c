"""Prefix-caching, KV-event and hybrid settings from a config's ``simulate:`` block."""

from __future__ import annotations

from typing import Any

import pytest

from kvgateway.simulator.fleetconfig import parse_fleet_config
from kvgateway.simulator.settings import SettingsError


def config(simulate: dict[str, Any]) -> dict[str, Any]:
    return {
        "models": [{"name": "m"}],
        "tiers": [
            {
                "backends": [
                    {
                        "name": "n1",
                        "url": "http://127.0.0.1:9101",
                        "model": "m",
                        "simulate": {"profile": "tiny", **simulate},
                    }
                ]
            }
        ],
    }


def test_kv_events_block_becomes_node_settings() -> None:
    (spec,) = parse_fleet_config(
        config({"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}})
    )
    s = spec.settings
    assert (s.kv_events_endpoint, s.kv_events_topic) == ("tcp://127.0.0.1:5557", "kv-events")
    assert s.kv_events_replay_endpoint is None and not s.kv_events_array_like
    assert s.enable_prefix_caching and s.engine_config().enable_kv_events
    (off,) = parse_fleet_config(config({"enable_prefix_caching": False}))
    assert not off.settings.engine_config().enable_prefix_caching
    assert not off.settings.engine_config().enable_kv_events


def test_hybrid_settings_divide_the_pool_between_groups() -> None:
    (spec,) = parse_fleet_config(
        config({"sliding_window": 32, "num_sliding_window_groups": 2, "num_gpu_blocks": 91})
    )
    assert spec.settings.kv_windows == (None, 32, 32)
    assert spec.settings.kv_tokens == 90 // 3 * 16 == spec.settings.engine_config().kv_tokens


@pytest.mark.parametrize(
    ("simulate", "message"),
    [
        (
            {"kv_events": "tcp://127.0.0.1:5557"},
            "tiers[0].backends[0].simulate.kv_events: expected a mapping",
        ),
        (
            {"kv_events": {"topic": "kv"}},
            "tiers[0].backends[0].simulate.kv_events.endpoint: required",
        ),
        (
            {"kv_events": {"endpoint": "tcp://127.0.0.1:1", "hwm": 5}},
            "tiers[0].backends[0].simulate.kv_events.hwm: unknown key",
        ),
        (
            {"num_sliding_window_groups": 1},
            "tiers[0].backends[0].simulate.sliding_window: a positive window is needed",
        ),
    ],
)
def test_errors_name_the_yaml_path(simulate: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_fleet_config(config(simulate))
    assert str(info.value).startswith(message), str(info.value)
