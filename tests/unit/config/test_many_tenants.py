"""A request's tenant is found in one lookup, by its key or its name, however many
tenants the config has (each request pays for it); a config made from another (a reload,
``dataclasses.replace``) finds its own tenants, not the other's."""

from __future__ import annotations

import dataclasses
import time

from kvgateway.config.model import AuthConfig, ClassConfig, TenantConfig
from kvgateway.server.edge import tenant_for_key


def _auth(n: int) -> AuthConfig:
    return AuthConfig(
        keys=tuple(
            TenantConfig(f"t{i}", keys=(f"sk-{i:06d}-a", f"sk-{i:06d}-b"), class_name="batch")
            for i in range(n)
        ),
        classes=(
            ClassConfig("interactive", queue_timeout_s=3.0),
            ClassConfig("batch", queue_timeout_s=9.0),
        ),
        default_tenant=TenantConfig("default", keys=("sk-default",), class_name="interactive"),
    )


def _per_lookup_s(auth: AuthConfig, header: str, name: str) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(500):
            tenant_for_key(auth, header)
            auth.queue_timeout(name, 1.0)
        best = min(best, (time.perf_counter() - t) / 500)
    return best


def test_every_key_finds_its_tenant_and_nothing_else_finds_one() -> None:
    auth = _auth(300)
    assert tenant_for_key(auth, "Bearer sk-000123-b") == "t123"
    assert tenant_for_key(auth, "bearer  sk-000299-a ") == "t299"
    assert tenant_for_key(auth, "Bearer sk-default") == "default"
    for header in ("Bearer sk-000123-c", "Bearer ", "", "Basic sk-000123-b", "sk-000123-b"):
        assert tenant_for_key(auth, header) is None, header
    assert auth.tenant("t7").keys == ("sk-000007-a", "sk-000007-b")
    assert auth.tenant("gone") is auth.default_tenant
    assert auth.queue_timeout("t7", 1.0) == 9.0
    assert auth.queue_timeout("default", 1.0) == 3.0


def test_a_config_made_from_another_finds_its_own_tenants() -> None:
    auth = _auth(3)
    reloaded = dataclasses.replace(auth, keys=(TenantConfig("new", keys=("sk-new",)),))
    assert tenant_for_key(reloaded, "Bearer sk-new") == "new"
    assert tenant_for_key(reloaded, "Bearer sk-000001-a") is None
    assert tenant_for_key(auth, "Bearer sk-new") is None
    assert reloaded.tenant("t1") is reloaded.default_tenant
    assert auth == _auth(3)  # the derived maps are not part of a config's equality


def test_the_lookup_costs_the_same_with_twenty_thousand_tenants_as_with_twenty() -> None:
    few = _per_lookup_s(_auth(20), "Bearer sk-000010-b", "t10")
    many = _per_lookup_s(_auth(20_000), "Bearer sk-010000-b", "t10000")
    assert many < 4 * few, (few, many)
