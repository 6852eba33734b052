"""What the repository deploys has no known password: compose*.yaml and ops/k8s run every
Redis with one (``requirepass``), every ``LASTEVENT_REDIS_URL`` carries it, and no
password has a default (Compose's ``${X:?...}``: required; Kubernetes: a Secret the
operator creates, never one committed). Read from the files, no Docker, no cluster."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.store.pool import connect, seeds
from tests.unit.test_redis_cluster import _ComposeLoader

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = sorted(ROOT.glob("compose*.yaml"))
K8S = sorted((ROOT / "ops" / "k8s").rglob("*.yaml"))
REQUIRED = re.compile(r"^\$\{(\w+):\?[^}]*\}$")  # Compose's required variable
SUBSTITUTED = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")
SECRETISH = re.compile(r"PASSWORD|SECRET|REDISCLI_AUTH", re.I)
PASSWORD = "s3cret"


def compose(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(path.read_text(), Loader=_ComposeLoader)
    return loaded


def interpolate(value: str) -> str:
    """What Compose runs, every variable set to PASSWORD."""
    return SUBSTITUTED.sub(PASSWORD, value)


def environments(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each service's environment, and each ``x-`` block of variables."""
    for name, service in doc.get("services", {}).items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        yield name, env
    for name, block in doc.items():
        if name.startswith("x-") and isinstance(block, dict):
            yield name, {k: v for k, v in block.items() if isinstance(v, str | int)}


def redis_password_of(url: str, *, cluster: bool) -> str | None:
    """The password the project's pool sends to every node of ``url``."""
    client = connect(url, 4, cluster=cluster)
    kwargs = (
        client.nodes_manager.connection_kwargs
        if cluster
        else client.connection_pool.connection_kwargs
    )  # type: ignore[attr-defined]
    password: str | None = kwargs.get("password")
    return password


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_has_no_default_password(path: Path) -> None:
    text = path.read_text()
    defaults = [m[0] for m in SUBSTITUTED.finditer(text) if ":-" in m[0] or "-" in m[0][2:4]]
    assert not [d for d in defaults if SECRETISH.search(d)], f"{path.name}: {defaults}"
    for where, env in environments(compose(path)):
        for key, value in env.items():
            if SECRETISH.search(key):
                assert REQUIRED.match(str(value)), f"{path.name} {where}: {key}={value}"
            if re.match(r"postgres(ql)?(\+\w+)?://", str(value)):
                parts = urlsplit(interpolate(str(value)))
                assert parts.password == PASSWORD, f"{path.name} {where}: {key} {value}"


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_runs_redis_with_a_password_every_client_sends(path: Path) -> None:
    doc = compose(path)
    for name, service in doc["services"].items():
        if not str(service.get("image", "")).startswith(("redis", "valkey")):
            continue
        env = service.get("environment") or {}
        command = [str(c) for c in service.get("command") or []]
        if service.get("entrypoint") == ["sh", "/etc/redis-cluster/start.sh"]:
            assert REQUIRED.match(str(env.get("REDIS_PASSWORD", ""))), f"{name}: no password"
        elif "redis-server" in command:
            flag = command.index("--requirepass") if "--requirepass" in command else -1
            assert flag >= 0 and REQUIRED.match(command[flag + 1]), f"{name}: {command}"
        # redis-cli (healthchecks, create.sh) authenticates with REDISCLI_AUTH
        uses_cli = "redis-cli" in str(service.get("healthcheck", "")) or "create.sh" in str(
            service.get("entrypoint", "")
        )
        if uses_cli:
            assert REQUIRED.match(str(env.get("REDISCLI_AUTH", ""))), f"{name}: redis-cli"
    cluster = "LASTEVENT_REDIS_CLUSTER" in path.read_text()
    urls = [
        str(env["LASTEVENT_REDIS_URL"])
        for _, env in environments(doc)
        if "LASTEVENT_REDIS_URL" in env
    ]
    assert urls, f"{path.name} names no LASTEVENT_REDIS_URL"
    for url in urls:
        resolved = interpolate(url)
        assert all(urlsplit(u).password == PASSWORD for u in seeds(resolved)), url
        assert redis_password_of(resolved, cluster=cluster) == PASSWORD, url


def test_cluster_nodes_take_the_password_as_requirepass_and_masterauth() -> None:
    start = (ROOT / "ops" / "redis-cluster" / "start.sh").read_text()
    assert '--requirepass "$REDIS_PASSWORD"' in start
    assert '--masterauth "$REDIS_PASSWORD"' in start  # a replica's to its primary


def k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "kind" in doc and "metadata" in doc:
                yield path, doc


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    pod = spec.get("jobTemplate", {}).get("spec", spec).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def from_secret(env: list[dict[str, Any]], name: str) -> bool:
    """``name`` is set from a Secret's key."""
    return any(v["name"] == name and "secretKeyRef" in v.get("valueFrom", {}) for v in env)


def test_k8s_commits_no_password_and_every_redis_url_carries_the_secret() -> None:
    lastevent = 0
    for path, obj in k8s_objects():
        where = f"{path.relative_to(ROOT)} {obj['kind']}/{obj['metadata']['name']}"
        assert obj["kind"] != "Secret", f"{where}: a Secret committed"
        for key, value in (obj.get("data") or {}).items():  # ConfigMaps: nothing secret
            assert not SECRETISH.search(key), f"{where}: {key}"
            assert key != "LASTEVENT_REDIS_URL", f"{where}: a Redis URL needs the password"
            if "://" in str(value) and "\n" not in str(value):
                assert urlsplit(str(value)).password is None, f"{where}: {key}"
        for c in containers(obj):
            env = c.get("env", [])
            values = {v["name"]: v.get("value") for v in env}
            if c.get("args", [None])[0] in ("api", "worker", "recorder"):
                lastevent += 1
                url = urlsplit(str(values.get("LASTEVENT_REDIS_URL")))
                ref = re.fullmatch(r"\$\((\w+)\)", url.password or "")
                assert ref and from_secret(env, ref[1]), f"{where} {c['name']}: {url}"
            if str(c.get("image", "")).startswith("redis") and c.get("command", [""])[-1].endswith(
                "start.sh"
            ):
                assert from_secret(env, "REDIS_PASSWORD"), f"{where}: a node without password"
            if "redis-cli" in str(c) or "create.sh" in str(c.get("command")):
                assert from_secret(env, "REDISCLI_AUTH"), f"{where}: redis-cli without it"
        if obj["kind"] == "ScaledObject":
            for trigger in obj["spec"]["triggers"]:
                assert trigger["metadata"].get("passwordFromEnv"), f"{where}: KEDA's"
    assert lastevent >= 3
