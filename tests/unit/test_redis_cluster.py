"""The Redis Cluster lastevent ships (ops/redis-cluster, compose.cluster.yaml), read offline.

At LASTEVENT_DURABILITY=replica a reader is sent only what a replica acknowledged, so the
deployment is three primaries with two replicas each (a promoted replica still has one to
confirm to), and its nodes are set up so that a failover can happen. The Kubernetes
overlay's copy of it is checked in test_k8s.py; the scripts run against real servers in
tests/integration/test_redis_cluster_scripts.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.settings import PREFIX, Settings
from service.store.pool import seeds

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops" / "redis-cluster"


def redis_conf() -> dict[str, str]:
    conf: dict[str, str] = {}
    for line in (OPS / "redis.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            assert key not in conf, f"redis.conf: {key} twice"
            assert "#" not in value, f"redis.conf: {key}: Redis reads no comment after a value"
            conf[key] = value.strip()
    return conf


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!override`, `!reset`): the value as it is."""


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_ComposeLoader.add_multi_constructor("!", _tagged)


REQUIRED = re.compile(r"\$\{\w+:\?[^}]*\}")  # a variable Compose requires


def compose(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)
    return loaded


def test_redis_conf_lets_a_replica_take_over() -> None:
    conf = redis_conf()
    assert conf["cluster-enabled"] == "yes"
    assert conf["appendonly"] == "yes"
    assert conf["cluster-replica-no-failover"] == "no"
    # never refused for its link's age (the most advanced one still goes first)
    assert conf["cluster-replica-validity-factor"] == "0"
    assert conf["cluster-allow-replica-migration"] == "yes"
    assert int(conf["cluster-migration-barrier"]) == 1
    # a slot range without a primary stops only its own partitions
    assert conf["cluster-require-full-coverage"] == "no"
    # clients get names (which survive a new address), each node announces its own
    assert conf["cluster-preferred-endpoint-type"] == "hostname"
    assert "cluster-announce-hostname" not in conf, "per node, on its command line"
    # a silent node is given up by lastevent before the cluster fails it over
    node_timeout_ms = int(conf["cluster-node-timeout"])
    assert Settings().redis_silent_s * 1000 < node_timeout_ms
    # start.sh reads nodes.conf where Redis keeps it (the volume's mount, /data)
    assert conf["dir"] == "/data"
    assert conf["cluster-config-file"] == "nodes.conf"
    assert "conf=${REDIS_DATA_DIR:-/data}/nodes.conf" in (OPS / "start.sh").read_text()


def test_compose_cluster_is_three_primaries_with_two_replicas() -> None:
    base = compose("compose.yaml")
    cluster = compose("compose.cluster.yaml")
    services = cluster["services"]
    nodes = {
        name
        for name, s in services.items()
        if s.get("entrypoint") == ["sh", "/etc/redis-cluster/start.sh"]
    }
    assert len(nodes) == 9
    for name in nodes:
        s = services[name]
        # each node announces its service name, which is how the others and clients find it
        assert s["command"] == ["--cluster-announce-hostname", name]
        volumes = dict(v.split(":", 1) for v in s["volumes"])
        assert volumes[name] == "/data" and name in cluster["volumes"], f"{name}: own volume"
        assert volumes["./ops/redis-cluster"] == "/etc/redis-cluster:ro"
        assert s.get("restart") == "unless-stopped"
    create = services["redis-cluster-create"]
    assert create["entrypoint"] == ["sh", "/etc/redis-cluster/create.sh"]
    shards = [s.split() for s in create["environment"]["REDIS_CLUSTER_SHARDS"].split(";")]
    assert [len(s) for s in shards] == [3, 3, 3], "a primary and two replicas each"
    assert sorted(n for s in shards for n in s) == sorted(nodes)
    assert set(create["depends_on"]) == nodes
    # compose.yaml's single node is not started beside the cluster
    assert services["redis"]["profiles"]
    assert "redis" in base["services"]
    for role in ("api", "worker"):
        assert set(base["services"][role]["depends_on"]) - set(services[role]["depends_on"]) == {
            "redis"
        }
        assert services[role]["depends_on"]["redis-cluster-create"] == {
            "condition": "service_completed_successfully"
        }
        env = {**base["x-lastevent-env"], **services[role]["environment"]}
        env = {k: REQUIRED.sub("s3cret", str(v)) for k, v in env.items()}  # Compose's ${X:?}
        assert {k for k in env if k.startswith(PREFIX)} <= {
            PREFIX + f.upper() for f in Settings.__dataclass_fields__
        }
        settings = Settings.from_env(env)
        assert settings.redis_cluster and settings.durability == "replica"
        assert settings.partitions >= len(shards)
        # several seeds, each a node: a process starting while one is down finds another
        hosts = [urlsplit(url).hostname for url in seeds(settings.redis_url or "")]
        assert len(hosts) >= 3 and set(hosts) <= nodes, hosts
        # one seed of each shard
        assert all(any(h in shard for h in hosts) for shard in shards)


@pytest.mark.parametrize("script", ["start.sh", "create.sh"])
def test_scripts_are_posix_sh(script: str) -> None:
    """The redis image runs them with its /bin/sh (dash): no bash. ShellCheck too, where
    it is installed."""
    path = OPS / script
    assert path.read_text().startswith("#!/bin/sh\n")
    dash = shutil.which("dash")
    if dash is not None:
        subprocess.run([dash, "-n", str(path)], check=True, timeout=30)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:
        out = subprocess.run(
            [shellcheck, "-s", "sh", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout
