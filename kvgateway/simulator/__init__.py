"""A simulated vLLM V1 node and fleet: the stand-in for real vLLM in tests and benchmarks.

- ``create_node_app(settings)``: one node as an aiohttp app (``server.py``);
- ``start_node`` / ``start_fleet``: run nodes on loopback ports in-process (``fleet.py``);
- ``load_fleet_config`` / ``parse_fleet_config``: node specs from the gateway's YAML;
- ``PROFILES``: hardware profiles (``profiles.py``); ``NodeSettings``: every knob.
"""

from kvgateway.simulator.cost import CostModel
from kvgateway.simulator.engine import EngineConfig, EngineCore
from kvgateway.simulator.faults import Fault
from kvgateway.simulator.profiles import PROFILES, get_profile
from kvgateway.simulator.server import create_node_app
from kvgateway.simulator.settings import NodeSettings, SettingsError

__all__ = [
    "PROFILES",
    "CostModel",
    "EngineConfig",
    "EngineCore",
    "Fault",
    "NodeSettings",
    "SettingsError",
    "create_node_app",
    "get_profile",
]
