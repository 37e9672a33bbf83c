"""Configuration: typed model (:mod:`.model`), YAML loading (:mod:`.load`), YAML reading
helpers with path-named errors (:mod:`.yamlread`)."""

from kvgateway.config.load import load_config, parse_config, parse_config_text
from kvgateway.config.model import (
    AdmissionConfig,
    BackendConfig,
    DiscoveryConfig,
    DnsGroupConfig,
    GatewayConfig,
    HealthConfig,
    LedgerConfig,
    LoadFeedbackConfig,
    ModelConfig,
    RoutingConfig,
    ServerConfig,
    TierConfig,
    TimeoutConfig,
)
from kvgateway.config.yamlread import ConfigError
from kvgateway.tokens.spec import TokenizerConfig

__all__ = [
    "AdmissionConfig",
    "BackendConfig",
    "ConfigError",
    "DiscoveryConfig",
    "DnsGroupConfig",
    "GatewayConfig",
    "HealthConfig",
    "LedgerConfig",
    "LoadFeedbackConfig",
    "ModelConfig",
    "RoutingConfig",
    "ServerConfig",
    "TierConfig",
    "TimeoutConfig",
    "TokenizerConfig",
    "load_config",
    "parse_config",
    "parse_config_text",
]
