"""Writes the KEDA ScaledObject that scales one model's worker Deployment (ops/k8s/README.md).

Each model has its own queue in every partition: partition ``p``'s stream for the model is
``Keys(prefix, P).queue(p, model_lane(model))`` (``service/store/keys.py``), so KEDA gets
two triggers per partition, on the same stream:
its consumer group's lag (jobs no worker has taken yet) and its pending entries (jobs
workers are running). ``scalingModifiers`` adds them all up: that sum is the demand, and
the target is what one worker runs at once, so the replicas are
``ceil((waiting + running) / per_worker)``. Scaling on the lag alone would shrink the
Deployment whenever the workers keep up (lag 0) and grow it again when they no longer do.

One ScaledObject per model, each scaling that model's worker Deployment. Regenerate after
changing the partitions, the key prefix, a model's name or the Redis topology::

    .venv/bin/python ops/k8s/scaledobject.py > ops/k8s/base/scaledobject.yaml
    .venv/bin/python ops/k8s/scaledobject.py --partitions 6 --cluster --patch \\
        > ops/k8s/overlays/redis-cluster/scaledobject-patch.yaml
    .venv/bin/python ops/k8s/scaledobject.py --model Qwen2.5-0.5B-Instruct \\
        --name lastevent-worker-qwen > ops/k8s/overlays/two-models/scaledobject-qwen.yaml

tests/unit/test_k8s.py checks that the committed files name exactly the streams of the
partitions their ConfigMap configures.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from service.settings import Settings
from service.store.keys import QUEUE_GROUP, Keys, model_lane

NAME = "lastevent-worker"
CONTAINER = "worker"
# the ConfigMap entries that hold the Redis address(es) as KEDA wants them (host:port)
ADDRESS_ENV = "REDIS_ADDRESS"
ADDRESSES_ENV = "REDIS_ADDRESSES"
PASSWORD_ENV = "REDIS_PASSWORD"


def triggers(
    prefix: str, partitions: int, *, model: str, cluster: bool, per_worker: int
) -> list[dict[str, Any]]:
    keys = Keys(prefix, partitions)
    lane = model_lane(model)
    connection = (
        {"addressesFromEnv": ADDRESSES_ENV}
        if cluster
        else {"addressFromEnv": ADDRESS_ENV, "databaseIndex": "0"}
    )
    # the worker container's REDIS_PASSWORD (the Secret lastevent-redis)
    connection["passwordFromEnv"] = PASSWORD_ENV
    kind = "redis-cluster-streams" if cluster else "redis-streams"
    out: list[dict[str, Any]] = []
    for p in keys.all_partitions:
        stream = {"stream": keys.queue(p, lane), "consumerGroup": QUEUE_GROUP}
        out.append(
            {
                "type": kind,
                "name": f"lag_p{p}",
                "metadata": {
                    **connection,
                    **stream,
                    "lagCount": str(per_worker),
                    "activationLagCount": "0",
                },
            }
        )
        out.append(
            {
                "type": kind,
                "name": f"pending_p{p}",
                "metadata": {**connection, **stream, "pendingEntriesCount": str(per_worker)},
            }
        )
    return out


def spec(
    prefix: str,
    partitions: int,
    *,
    name: str,
    model: str,
    cluster: bool,
    per_worker: int,
    min_replicas: int,
    max_replicas: int,
) -> dict[str, Any]:
    trigger_list = triggers(prefix, partitions, model=model, cluster=cluster, per_worker=per_worker)
    return {
        "scaleTargetRef": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
            "envSourceContainerName": CONTAINER,
        },
        # a worker takes minutes to load its model: keep one, never scale to zero
        "minReplicaCount": min_replicas,
        "maxReplicaCount": max_replicas,
        "pollingInterval": 15,
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "behavior": {
                    "scaleUp": {
                        "stabilizationWindowSeconds": 0,
                        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 60}],
                    },
                    # slowly: a stopping worker hands its unfinished requests over
                    "scaleDown": {
                        "stabilizationWindowSeconds": 600,
                        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
                    },
                }
            },
            "scalingModifiers": {
                "formula": " + ".join(t["name"] for t in trigger_list),
                "target": str(per_worker),
                "metricType": "AverageValue",
            },
        },
        "triggers": trigger_list,
    }


def scaled_object(spec_: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": spec_["scaleTargetRef"]["name"],
            "labels": {
                "app.kubernetes.io/name": "lastevent",
                "app.kubernetes.io/component": "worker",
            },
        },
        "spec": spec_,
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # stream names hold braces (the partition's hash tag): quoted, for the reader's sake
    style = '"' if "{" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(argv: list[str] | None = None) -> str:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--partitions", type=int, default=defaults.partitions)
    parser.add_argument("--prefix", default=defaults.key_prefix)
    parser.add_argument("--model", default=defaults.model_name, help="the model its workers serve")
    parser.add_argument("--name", default=NAME, help="the worker Deployment it scales")
    parser.add_argument(
        "--cluster", action="store_true", help="Redis Cluster (redis-cluster-streams)"
    )
    parser.add_argument(
        "--per-worker",
        type=int,
        default=defaults.worker_concurrency,
        help="requests one worker runs at once (LASTEVENT_WORKER_CONCURRENCY)",
    )
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument(
        "--patch", action="store_true", help="a JSON 6902 patch replacing the base's spec"
    )
    args = parser.parse_args(argv)
    spec_ = spec(
        args.prefix,
        args.partitions,
        name=args.name,
        model=args.model,
        cluster=args.cluster,
        per_worker=args.per_worker,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
    )
    doc: Any = (
        [{"op": "replace", "path": "/spec", "value": spec_}] if args.patch else scaled_object(spec_)
    )
    command = " ".join(["ops/k8s/scaledobject.py", *(argv if argv is not None else sys.argv[1:])])
    header = f"# Generated by `{command}`: edit that script, not this file.\n"
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000)


if __name__ == "__main__":
    sys.stdout.write(render())
