"""The shared reservation ledger (Redis); the embedded one is in core/reservation.py."""
