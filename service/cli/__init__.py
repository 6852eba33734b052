"""The ``lastevent`` command and the local stack.

    up                       everything on one machine (what ``make run`` runs)
    api | worker | recorder  one process of that role
    node                     the API and a worker in one process (one per GPU host)
    migrate                  alembic upgrade head
    model prepare            convert the packaged GGUF model (once)
    billing reconcile|export the ledger against the outbox; usage per tenant
    replay ID                an answer exactly as clients received it
    keys create|list|revoke  API keys: one for a tenant, every key, end one
    tenants set NAME         a tenant's settings (keep every input for audit)
    archive purge            delete archived logs

The only package that imports both ``service.api`` and ``workers``.
"""

from __future__ import annotations

import argparse
import logging

from service.settings import Settings, SettingsError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lastevent", description="lastevent")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="run everything locally (embedded servers unless URLs are set)")
    sub.add_parser("api", help="run the HTTP API")
    sub.add_parser("worker", help="run one engine worker")
    sub.add_parser("node", help="run the HTTP API and a worker in one process")
    sub.add_parser("recorder", help="run a recorder (outbox -> Postgres) on its own")
    sub.add_parser("migrate", help="alembic upgrade head")
    model = sub.add_parser("model", help="model files")
    model_sub = model.add_subparsers(dest="model_cmd", required=True)
    prep = model_sub.add_parser("prepare", help="convert the packaged GGUF model (once)")
    prep.add_argument("--force", action="store_true")
    billing = sub.add_parser("billing", help="reconcile and export usage")
    billing_sub = billing.add_subparsers(dest="billing_cmd", required=True)
    for name, text in (
        ("reconcile", "compare terminal events with ledger rows"),
        ("export", "per-tenant usage"),
    ):
        b = billing_sub.add_parser(name, help=text)
        b.add_argument("--since", required=True, help="ISO time, e.g. 2026-11-30T00:00")
        b.add_argument("--until", help="ISO time (default: now)")
        if name == "export":
            b.add_argument("--format", choices=["csv"], default="csv")
    rp = sub.add_parser("replay", help="re-render an answer exactly as clients received it")
    rp.add_argument("request_id")
    rp.add_argument("--speed", default="max", help="1 (original timing), 10, or max")
    rp.add_argument("--format", choices=["sse", "text", "json"], default="sse")
    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_cmd", required=True)
    kc = keys_sub.add_parser("create", help="create a key for a tenant (printed once)")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--role", choices=["user", "operator"], default="user")
    kc.add_argument("--models", help="comma-separated models it may use (default: all)")
    kl = keys_sub.add_parser("list", help="every key: id, tenant, role, models, revoked")
    kl.add_argument("--tenant", help="only this tenant's")
    kr = keys_sub.add_parser("revoke", help="end a key and the stream tokens made from it")
    kr.add_argument("key_id", help="the key's id (sk-le-<id>-...), or the whole key")
    tenants = sub.add_parser("tenants", help="tenants")
    tenants_sub = tenants.add_subparsers(dest="tenants_cmd", required=True)
    ts = tenants_sub.add_parser("set", help="a tenant's settings (created if new)")
    ts.add_argument("tenant")
    ts.add_argument(
        "--keep-inputs",
        choices=["on", "off"],
        required=True,
        help="keep every request's input for audit, whatever `store` says (the console "
        "shows it; the tenant's stored completions list only `store: true` ones)",
    )
    arch = sub.add_parser("archive", help="archived logs")
    arch_sub = arch.add_subparsers(dest="archive_cmd", required=True)
    purge = arch_sub.add_parser("purge", help="delete archived logs (retention, per tenant)")
    purge.add_argument("--older-than-days", type=int)
    purge.add_argument("--tenant")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    quiet = args.cmd in ("billing", "replay", "archive", "keys", "tenants")
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:  # one line naming the variable, not a traceback
        raise SystemExit(f"lastevent: {exc}") from None
    from service.cli import commands

    if args.cmd == "up":
        from service.cli.up import up

        up(settings)
    elif args.cmd == "api":
        commands.api(settings)
    elif args.cmd == "worker":
        commands.worker(settings)
    elif args.cmd == "node":
        from service.cli.node import node

        node(settings)
    elif args.cmd == "recorder":
        commands.recorder(settings)
    elif args.cmd == "migrate":
        commands.migrate(settings)
    elif args.cmd == "model":
        commands.model_prepare(settings, force=args.force)
    elif args.cmd == "billing":
        raise SystemExit(commands.billing_cmd(settings, args))
    elif args.cmd == "replay":
        raise SystemExit(commands.replay_cmd(settings, args))
    elif args.cmd == "keys":
        from service.cli import keys

        run = {"list": keys.keys_list, "revoke": keys.keys_revoke}.get(args.keys_cmd)
        raise SystemExit((run or commands.keys_create)(settings, args))
    elif args.cmd == "tenants":
        raise SystemExit(commands.tenants_set(settings, args))
    elif args.cmd == "archive":
        raise SystemExit(commands.archive_purge(settings, args))
