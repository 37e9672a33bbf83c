"""The smallest valid gateway YAML: one model, one tier, one backend (tests add to it)."""

ONE_BACKEND = """
models:
  - name: m
tiers:
  - name: small
    backends:
      - {name: a, url: "http://127.0.0.1:9000", model: m}
"""
