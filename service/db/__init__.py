"""Postgres: SQLAlchemy models, the billing ledger (idempotent upserts)."""
