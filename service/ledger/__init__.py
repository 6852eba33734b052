"""Every Postgres call: the schema, the billing ledger and archive, API keys, migrations."""
