"""Alembic migrations for the ledger (run with ``lastevent migrate``)."""
