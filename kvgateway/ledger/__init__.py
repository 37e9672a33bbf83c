"""The shared reservation ledger (Redis); the embedded one is core/ledger.py."""
