"""Configuration: typed model (:mod:`.model`), YAML loading (:mod:`.load`), YAML reading
helpers with path-named errors (:mod:`.yamlread`)."""

from kvgateway.config.ledger import LedgerConfig
from kvgateway.config.load import load_config, parse_config, parse_config_text
from kvgateway.config.model import (
    AdmissionConfig,
    AuthConfig,
    BackendConfig,
    ClassConfig,
    DiscoveryConfig,
    DnsGroupConfig,
    GatewayConfig,
    HealthConfig,
    LoadFeedbackConfig,
    ModelConfig,
    RoutingConfig,
    ServerConfig,
    TenantConfig,
    TenantLimits,
    TierConfig,
    TimeoutConfig,
)
from kvgateway.config.yamlread import ConfigError
from kvgateway.tokens.plans import TokenizerConfig

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "BackendConfig",
    "ClassConfig",
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
    "TenantConfig",
    "TenantLimits",
    "TierConfig",
    "TimeoutConfig",
    "TokenizerConfig",
    "load_config",
    "parse_config",
    "parse_config_text",
]
