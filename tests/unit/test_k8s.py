"""ops/k8s: the Kubernetes manifests, built and checked offline (no cluster, no network).

``build`` does what ``kubectl kustomize`` does with the features ops/k8s uses (resources,
strategic-merge and JSON 6902 patches, images, a name suffix, labels) and refuses every
other one, so that a
kustomization it cannot build fails here instead of passing unchecked. Where kubectl is
installed, its build must be the same as ``kubectl kustomize``'s.

Every object built is validated: the built-in kinds against the Kubernetes OpenAPI
schemas (as JSON schemas) that the ``kubernetes-validate`` package bundles for each
Kubernetes version, strict (an unknown field is an error, as ``kubectl apply`` makes it
by default); the KEDA ScaledObject against ``SCALEDOBJECT_SCHEMA`` below: the part of
KEDA's CRD schema that ops/k8s uses, written here: no package on the registries we reach
ships that schema (cloudcoil-models-keda has pydantic models made from it, which ignore
unknown fields). Its HPA ``behavior`` is Kubernetes' own schema, from the same bundle.

Then what no schema knows: every LASTEVENT_* variable is a setting, the probes ask
routes the API has, the grace periods outlast the drains, each model's workers get a GPU,
and KEDA watches exactly the queue streams ``Keys`` names for each model's workers and the
configured partitions.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate
from litestar.exceptions import LitestarDeprecationWarning
from referencing import Registry, Resource

from service.api import app as api_app
from service.cli import _parser as cli_parser
from service.settings import PREFIX, Settings
from service.store.keys import QUEUE_GROUP, Keys, model_lane
from service.tokenize import ModelInfo

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"
BUILDS = {
    "base": K8S / "base",
    "redis-cluster": K8S / "overlays" / "redis-cluster",
    "two-models": K8S / "overlays" / "two-models",
}
# kustomizations built only as parts of those (one model's workers)
PARTS = {K8S / "base" / "worker", K8S / "overlays" / "two-models" / "qwen"}
# the oldest Kubernetes the manifests are for, and the newest kubernetes-validate knows
K8S_VERSIONS = ("1.31.0", "1.37.0")

SETTING_VARS = {PREFIX + f.name.upper() for f in dataclasses.fields(Settings)}
SECRETS = {"lastevent-database", "lastevent-redis"}  # the operator's (ops/k8s/README.md)

# How long a process may take after its drain, before it has exited (the grace period
# must cover drain + this). API: uvicorn's shutdown, then the lifespan closes the
# sweeper, tailer and pools. Worker (workers/__main__.py, workers/runner.py): the
# handover aborts (5 s), its watchers (5 s), the recorder if any (0.5 + 5 s), the engine,
# Redis and Postgres closes (5 s each), and the tasks left (5 s).
API_EXIT_S = 10
WORKER_EXIT_S = 5 + 5 + 5.5 + 3 * 5 + 5

ROLES = {  # Deployment/Job -> the lastevent subcommand its main container runs
    "lastevent-api": ["api"],
    "lastevent-worker": ["worker"],
    "lastevent-recorder": ["recorder"],
    "lastevent-migrate": ["migrate"],
}

# ---- a kustomize for what ops/k8s uses ----------------------------------------------------

BUILTIN_GROUPS = {"", "apps", "batch", "policy", "autoscaling", "networking.k8s.io"}
MERGED_BY_NAME = {"containers", "initContainers", "env", "volumes", "volumeMounts"}


def group_of(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def build(path: Path) -> list[dict[str, Any]]:
    kfile = path / "kustomization.yaml"
    kustomization = yaml.safe_load(kfile.read_text())
    known = {"apiVersion", "kind", "resources", "patches", "images", "nameSuffix", "labels"}
    unknown = set(kustomization) - known
    if unknown:
        raise NotImplementedError(f"{kfile}: {sorted(unknown)} (teach tests/unit/test_k8s.py)")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        target = path / entry
        if target.is_dir():
            objects += build(target)
        else:
            objects += [doc for doc in yaml.safe_load_all(target.read_text()) if doc is not None]
    ids = [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"{kfile}: an object twice: {ids}"
    for patch in kustomization.get("patches", []):
        apply_patch(objects, path, patch)
    for obj in objects:  # (kustomize's order: the patches, then the suffix and labels)
        obj["metadata"]["name"] += kustomization.get("nameSuffix", "")
    for entry in kustomization.get("labels", []):
        add_labels(objects, entry)
    for image in kustomization.get("images", []):
        set_image(objects, image)
    return objects


def add_labels(objects: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """``labels``: on every object; with ``includeSelectors`` on a Deployment's selector and
    pod template too."""
    if set(entry) - {"pairs", "includeSelectors"}:
        raise NotImplementedError(f"labels options {sorted(entry)}")
    pairs = entry["pairs"]
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        if entry.get("includeSelectors") and obj["kind"] == "Deployment":
            obj["spec"]["selector"]["matchLabels"].update(pairs)
            obj["spec"]["template"]["metadata"].setdefault("labels", {}).update(pairs)


def select(objects: list[dict[str, Any]], target: dict[str, str]) -> list[dict[str, Any]]:
    unknown = set(target) - {"group", "version", "kind", "name"}
    if unknown:
        raise NotImplementedError(f"patch target by {sorted(unknown)}")
    found = [
        o
        for o in objects
        if target.get("kind", o["kind"]) == o["kind"]
        and target.get("name", o["metadata"]["name"]) == o["metadata"]["name"]
        and target.get("group", group_of(o["apiVersion"])) == group_of(o["apiVersion"])
        and target.get("version", o["apiVersion"].rpartition("/")[2])
        == o["apiVersion"].rpartition("/")[2]
    ]
    assert found, f"no object matches the patch target {target}"
    return found


def apply_patch(objects: list[dict[str, Any]], base: Path, entry: dict[str, Any]) -> None:
    if set(entry) - {"path", "patch", "target"}:
        raise NotImplementedError(f"patch options {sorted(entry)}")
    doc = yaml.safe_load((base / entry["path"]).read_text() if "path" in entry else entry["patch"])
    if isinstance(doc, list):  # JSON 6902
        assert "target" in entry, "a JSON 6902 patch needs a target"
        for obj in select(objects, entry["target"]):
            for op in doc:
                json6902(obj, op)
        return
    target = entry.get("target") or {
        "group": group_of(doc["apiVersion"]),
        "kind": doc["kind"],
        "name": doc["metadata"]["name"],
    }
    for obj in select(objects, target):
        merge(obj, doc, builtin=group_of(obj["apiVersion"]) in BUILTIN_GROUPS, where=obj["kind"])


def merge(into: dict[str, Any], patch: dict[str, Any], *, builtin: bool, where: str) -> None:
    """A strategic merge: maps merge, null deletes; in built-in kinds the lists of
    MERGED_BY_NAME merge by name and lists of scalars are replaced; in a custom resource
    (no schema: kustomize knows no merge keys) every list is replaced."""
    for key, value in patch.items():
        here = f"{where}.{key}"
        if key.startswith("$"):
            raise NotImplementedError(f"{here}: patch directives")
        old = into.get(key)
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(old, dict):
            merge(old, value, builtin=builtin, where=here)
        elif builtin and isinstance(value, list) and key in MERGED_BY_NAME:
            old = old if isinstance(old, list) else []  # (none yet: the patch's)
            # (kustomize's order: the patch's items, then the others)
            merged = []
            for item in value:
                same = next((x for x in old if x.get("name") == item["name"]), None)
                if same is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merge(same, item, builtin=builtin, where=f"{here}[{item['name']}]")
                    merged.append(same)
            into[key] = merged + [x for x in old if all(x is not m for m in merged)]
        elif builtin and isinstance(value, list) and any(isinstance(v, dict) for v in value):
            raise NotImplementedError(f"{here}: a strategic merge of this list")
        else:
            into[key] = copy.deepcopy(value)


def json6902(obj: dict[str, Any], op: dict[str, Any]) -> None:
    if op["op"] not in ("add", "replace", "remove"):
        raise NotImplementedError(f"JSON 6902 op {op['op']}")
    tokens = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
    parent: Any = obj
    for token in tokens[:-1]:
        parent = parent[int(token)] if isinstance(parent, list) else parent[token]
    last = tokens[-1]
    if isinstance(parent, list):
        if op["op"] == "add":
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif op["op"] == "replace":
            parent[int(last)] = copy.deepcopy(op["value"])
        else:
            del parent[int(last)]
        return
    if op["op"] != "add":
        assert last in parent, f"{op['path']}: nothing to {op['op']}"
    if op["op"] == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(op["value"])


def set_image(objects: list[dict[str, Any]], image: dict[str, str]) -> None:
    if set(image) - {"name", "newName", "newTag", "digest"}:
        raise NotImplementedError(f"images: {sorted(image)}")
    for obj in objects:
        for c in containers(obj, init=True):
            name, sep, ref = split_image(c["image"])
            if name != image["name"]:
                continue
            if "digest" in image:
                sep, ref = "@", image["digest"]
            elif "newTag" in image:
                sep, ref = ":", image["newTag"]
            c["image"] = image.get("newName", name) + sep + ref


def split_image(image: str) -> tuple[str, str, str]:
    if "@" in image:
        name, sep, digest = image.partition("@")
        return name, sep, digest
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:  # no tag (a colon in the registry's host:port)
        return image, "", ""
    return name, sep, tag


def kubectl_kustomize(path: Path) -> list[dict[str, Any]] | None:
    """What the real kustomize (kubectl's) builds, where kubectl is installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


def same_objects(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def key(o: dict[str, Any]) -> tuple[str, str, str]:
        return o["apiVersion"], o["kind"], o["metadata"]["name"]

    return sorted(a, key=key) == sorted(b, key=key)


# ---- reading the built objects ------------------------------------------------------------


@functools.cache
def built(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(build(BUILDS[name]))


def find(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def pod_template(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]
    return None


def containers(obj: dict[str, Any], *, init: bool = False) -> list[dict[str, Any]]:
    template = pod_template(obj)
    if template is None:
        return []
    spec = template["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def main_container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = containers(obj)
    return only


def env_of(objects: tuple[dict[str, Any], ...], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment: its ConfigMaps' data, then its env (a value from a
    Secret or the pod's fields stands in as a placeholder; ``$(NAME)`` in a value is the
    variable defined before it, as the kubelet expands it)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"envFrom {source}"
        env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        else:
            (kind,) = var["valueFrom"]
            env[var["name"]] = f"<{kind}>"
    return env


def settings_of(objects: tuple[dict[str, Any], ...], container: dict[str, Any]) -> Settings:
    return Settings.from_env(env_of(objects, container))


def worker_deployments(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Every model's worker Deployment (``lastevent worker``)."""
    found = [
        o
        for o in objects
        if o["kind"] == "Deployment" and main_container(o).get("args") == ["worker"]
    ]
    assert found, "no worker Deployment"
    return found


def prestop_sleep_s(container: dict[str, Any]) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", f"a preStop hook this test cannot time: {command}"
    return float(command[1])


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"container {container['name']} has no port named {port!r}"
    return int(numbers[0])


def probes(container: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


@functools.cache
def api_routes() -> frozenset[str]:
    """The paths the API answers GET on (the app built as `lastevent api` builds it, with
    a stand-in model: nothing connects until its lifespan starts)."""
    model = mock.Mock(spec=ModelInfo, max_model_len=128)
    with mock.patch.object(ModelInfo, "load", return_value=model), warnings.catch_warnings():
        # (Litestar's notice about inferred dependencies is not this test's business)
        warnings.simplefilter("ignore", LitestarDeprecationWarning)
        app = api_app.create_app(Settings(redis_url="redis://127.0.0.1:1/0", auth="off"))
    return frozenset(r.path for r in app.routes if "GET" in getattr(r, "methods", ()))


# ---- schemas ------------------------------------------------------------------------------

DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"
STR = {"type": "string"}
INT = {"type": "integer"}
METRIC_TYPE = {"enum": ["AverageValue", "Value", "Utilization"]}


def obj_schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


SCALEDOBJECT_SCHEMA = obj_schema(
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"$ref": DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": obj_schema(
            {
                "scaleTargetRef": obj_schema(
                    {"apiVersion": STR, "kind": STR, "name": STR, "envSourceContainerName": STR},
                    ("name",),
                ),
                "pollingInterval": INT,
                "cooldownPeriod": INT,
                "initialCooldownPeriod": INT,
                "idleReplicaCount": INT,
                "minReplicaCount": INT,
                "maxReplicaCount": INT,
                "fallback": obj_schema(
                    {"failureThreshold": INT, "replicas": INT}, ("failureThreshold", "replicas")
                ),
                "advanced": obj_schema(
                    {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": obj_schema(
                            {
                                "name": STR,
                                "behavior": {
                                    "$ref": DEFS
                                    + "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"
                                },
                            }
                        ),
                        "scalingModifiers": obj_schema(
                            {
                                "formula": STR,
                                "target": STR,
                                "activationTarget": STR,
                                "metricType": METRIC_TYPE,
                            }
                        ),
                    }
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": obj_schema(
                        {
                            "type": STR,
                            "name": STR,
                            "metadata": {"type": "object", "additionalProperties": STR},
                            "authenticationRef": obj_schema(
                                {
                                    "name": STR,
                                    "kind": {
                                        "enum": [
                                            "TriggerAuthentication",
                                            "ClusterTriggerAuthentication",
                                        ]
                                    },
                                },
                                ("name",),
                            ),
                            "metricType": METRIC_TYPE,
                            "useCachedMetrics": {"type": "boolean"},
                        },
                        ("type", "metadata"),
                    ),
                },
            },
            ("scaleTargetRef", "triggers"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

# The trigger metadata KEDA's Redis Streams scalers read (the CRD takes any string map).
_STREAMS = {
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "usernameFromEnv",
    "passwordFromEnv",
    "enableTLS",
    "unsafeSsl",
}
TRIGGER_METADATA = {
    "redis-streams": _STREAMS
    | {"address", "host", "port", "addressFromEnv", "hostFromEnv", "portFromEnv", "databaseIndex"},
    "redis-cluster-streams": _STREAMS
    | {"addresses", "hosts", "ports", "addressesFromEnv", "hostsFromEnv", "portsFromEnv"},
}

QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@functools.cache
def scaledobject_validator(version: str) -> jsonschema.protocols.Validator:
    definitions = kubernetes_validate.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version
    )
    registry: Registry[Any] = Registry().with_resource(
        definitions["$id"], Resource.from_contents(definitions)
    )
    return jsonschema.Draft202012Validator(SCALEDOBJECT_SCHEMA, registry=registry)


def validate(obj: dict[str, Any], version: str) -> None:
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject":
        errors = list(scaledobject_validator(version).iter_errors(obj))
        assert not errors, f"{where}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
        )
        return
    assert group_of(obj["apiVersion"]) in BUILTIN_GROUPS, (
        f"{where}: no schema for {obj['apiVersion']}"
    )
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where} (Kubernetes {version}): {'.'.join(map(str, e.path))}: {e.message}")


# ---- the tests ----------------------------------------------------------------------------


def test_every_kustomization_is_checked() -> None:
    found = {p.parent for p in K8S.rglob("kustomization.yaml")}
    assert found == set(BUILDS.values()) | PARTS


@pytest.mark.parametrize("name", BUILDS)
def test_build_is_what_kubectl_builds(name: str) -> None:
    real = kubectl_kustomize(BUILDS[name])
    if real is None:
        pytest.skip("no kubectl here (the checks below use this test's own build)")
    assert same_objects(list(built(name)), real)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", BUILDS)
def test_objects_validate(name: str, version: str) -> None:
    objects = built(name)
    assert objects
    for obj in objects:
        validate(obj, version)
        assert DNS_NAME.match(obj["metadata"]["name"]), obj["metadata"]["name"]
        for c in containers(obj, init=True):
            for amounts in c.get("resources", {}).values():
                for resource, amount in amounts.items():
                    assert QUANTITY.match(str(amount)), f"{c['name']}: {resource}: {amount!r}"


@pytest.mark.parametrize("name", BUILDS)
def test_references_resolve(name: str) -> None:
    objects = built(name)
    for obj in objects:
        template = pod_template(obj)
        if template is None:
            continue
        spec = template["spec"]
        if obj["kind"] in ("Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= template["metadata"]["labels"].items()
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                find(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        volumes = {v["name"] for v in spec.get("volumes", [])}
        # a StatefulSet's pods also mount a claim of each of its volumeClaimTemplates
        volumes |= {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        for c in containers(obj, init=True):
            env_of(objects, c)  # every ConfigMap it takes exists
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] in SECRETS, f"{c['name']}: Secret {ref['name']}"
            names = [v["name"] for v in c.get("env", [])]
            assert len(names) == len(set(names)), f"{c['name']}: a variable twice"
    readme = (K8S / "README.md").read_text()
    for secret in SECRETS:
        assert secret in readme, f"ops/k8s/README.md does not say how to create {secret}"
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [
            o
            for o in objects
            if (t := pod_template(o)) is not None
            and service["spec"]["selector"].items() <= t["metadata"]["labels"].items()
        ]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            for o in selected:
                port_number(main_container(o), port["targetPort"])


@pytest.mark.parametrize("name", BUILDS)
def test_every_lastevent_variable_is_a_setting(name: str) -> None:
    objects = built(name)
    used: set[str] = set()
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            used |= set(obj["data"])
        for c in containers(obj, init=True):
            used |= {v["name"] for v in c.get("env", [])}
            settings_of(objects, c)  # and every value converts
    used = {v for v in used if v.startswith(PREFIX)}
    assert used, "no LASTEVENT_* variable found"
    assert used <= SETTING_VARS, (
        f"not settings (service/settings.py): {sorted(used - SETTING_VARS)}"
    )


@pytest.mark.parametrize("name", BUILDS)
def test_each_role_runs_its_command(name: str) -> None:
    objects = built(name)
    for obj_name, args in ROLES.items():
        kind = "Job" if obj_name == "lastevent-migrate" else "Deployment"
        assert main_container(find(objects, kind, obj_name))["args"] == args
    for obj in objects:
        for c in containers(obj, init=True):
            if split_image(c["image"])[0] == "lastevent" and "command" not in c:
                try:
                    cli_parser().parse_args(c["args"])
                except SystemExit:
                    pytest.fail(f"{c['name']}: `lastevent {' '.join(c['args'])}` is no command")


@pytest.mark.parametrize("name", BUILDS)
def test_api_probes_ask_real_routes(name: str) -> None:
    objects = built(name)
    routes = api_routes()
    deployment = find(objects, "Deployment", "lastevent-api")
    api = main_container(deployment)
    settings = settings_of(objects, api)
    assert settings.host == "0.0.0.0", "the API must listen on the pod's address for its probes"
    assert {p["containerPort"] for p in api["ports"]} == {settings.port}
    paths = {kind: probe["httpGet"]["path"] for kind, probe in probes(api)}
    # ready: Redis and Postgres answer; live: the process answers (no dependency, so that
    # an outage of Postgres does not restart every API pod)
    assert paths == {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for kind, probe in probes(api):
        assert probe["httpGet"]["path"] in routes, f"{kind}: no route {probe['httpGet']['path']}"
        assert port_number(api, probe["httpGet"]["port"]) == settings.port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(settings.port)
    assert annotations["prometheus.io/path"] in routes


@pytest.mark.parametrize("name", BUILDS)
def test_api_grace_period_covers_its_drain(name: str) -> None:
    objects = built(name)
    deployment = find(objects, "Deployment", "lastevent-api")
    api = main_container(deployment)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    needed = prestop_sleep_s(api) + settings_of(objects, api).drain_s + API_EXIT_S
    assert prestop_sleep_s(api) > 0, "no preStop hook: the endpoint removal races SIGTERM"
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed}"


@pytest.mark.parametrize("name", BUILDS)
def test_worker_gets_a_gpu_and_time_to_drain(name: str) -> None:
    objects = built(name)
    for deployment in worker_deployments(objects):
        check_worker(objects, deployment)
    assert main_container(find(objects, "Deployment", "lastevent-recorder"))["args"] == ["recorder"]


def check_worker(objects: tuple[dict[str, Any], ...], deployment: dict[str, Any]) -> None:
    worker = main_container(deployment)
    settings = settings_of(objects, worker)
    assert settings.engine == "vllm"
    resources = worker["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == settings.vllm_tensor_parallel_size
    assert int(resources["requests"].get("nvidia.com/gpu", 1)) == settings.vllm_tensor_parallel_size
    # a liveness probe would kill a worker loading its model (minutes)
    assert not dict(probes(worker)), "probes on the worker"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    needed = prestop_sleep_s(worker) + settings.worker_drain_s + WORKER_EXIT_S
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed}"
    # KEDA owns the replica count: an apply must not reset it
    assert "replicas" not in deployment["spec"]
    assert not settings.recorder_in_worker


@pytest.mark.parametrize("name", BUILDS)
def test_each_models_workers_are_apart_and_accepted_by_the_api(name: str) -> None:
    """One Deployment per model, whose selectors do not overlap (each would adopt the
    other's pods), each model one the API pods accept (LASTEVENT_MODELS)."""
    objects = built(name)
    workers = worker_deployments(objects)
    models = [settings_of(objects, main_container(d)).model_name for d in workers]
    assert len(models) == len(set(models)), models
    selectors = [d["spec"]["selector"]["matchLabels"] for d in workers]
    for d, selector in zip(workers, selectors, strict=True):
        for other in workers:
            if other is not d:
                labels = other["spec"]["template"]["metadata"]["labels"]
                assert not selector.items() <= labels.items(), d["metadata"]["name"]
    api = settings_of(objects, main_container(find(objects, "Deployment", "lastevent-api")))
    assert set(models) <= set(api.model_dirs), (models, api.model_dirs)


@pytest.mark.parametrize("name", BUILDS)
def test_model_dir_is_on_the_models_volume(name: str) -> None:
    objects = built(name)
    for deployment in [find(objects, "Deployment", "lastevent-api"), *worker_deployments(objects)]:
        claims = {
            v["name"]
            for v in deployment["spec"]["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        for c in containers(deployment, init=True):
            model_dir = settings_of(objects, c).resolved_model_dir
            mounts = [Path(m["mountPath"]) for m in c["volumeMounts"] if m["name"] in claims]
            assert any(m in model_dir.parents for m in mounts), f"{c['name']}: {model_dir}"


@pytest.mark.parametrize("name", BUILDS)
def test_worker_and_recorder_pods_are_scraped(name: str) -> None:
    objects = built(name)
    for deployment in [
        *worker_deployments(objects),
        find(objects, "Deployment", "lastevent-recorder"),
    ]:
        obj_name = deployment["metadata"]["name"]
        settings = settings_of(objects, main_container(deployment))
        port = settings.metrics_port
        assert port, f"{obj_name}: LASTEVENT_METRICS_PORT=0 serves no metrics"
        assert settings.host == "0.0.0.0", f"{obj_name}: /metrics only on {settings.host}"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }
        assert port_number(main_container(deployment), "metrics") == port


@pytest.mark.parametrize("name", BUILDS)
def test_keda_watches_every_partition_queue(name: str) -> None:
    objects = built(name)
    scaled_objects = [o for o in objects if o["kind"] == "ScaledObject"]
    targets = sorted(o["spec"]["scaleTargetRef"]["name"] for o in scaled_objects)
    # one per model's workers
    assert targets == sorted(d["metadata"]["name"] for d in worker_deployments(objects))
    for obj in scaled_objects:
        check_scaled_object(objects, obj["spec"])


def check_scaled_object(objects: tuple[dict[str, Any], ...], scaled: dict[str, Any]) -> None:
    target = find(
        objects,
        scaled["scaleTargetRef"].get("kind", "Deployment"),
        scaled["scaleTargetRef"]["name"],
    )
    (container,) = [
        c
        for c in containers(target)
        if c["name"] == scaled["scaleTargetRef"]["envSourceContainerName"]
    ]
    env = env_of(objects, container)
    settings = Settings.from_env(env)
    keys = Keys(settings.key_prefix, settings.partitions)
    # the queues of the model its target's workers serve
    lane = model_lane(settings.model_name)
    streams = [keys.queue(p, lane) for p in keys.all_partitions]
    kind = "redis-cluster-streams" if settings.redis_cluster else "redis-streams"
    triggers = scaled["triggers"]

    lag = [t for t in triggers if "lagCount" in t["metadata"]]
    pending = [t for t in triggers if "pendingEntriesCount" in t["metadata"]]
    assert len(lag) + len(pending) == len(triggers)
    assert [t["metadata"]["stream"] for t in lag] == streams
    assert [t["metadata"]["stream"] for t in pending] == streams
    url = urlsplit(settings.redis_url or "")
    for t in triggers:
        meta = t["metadata"]
        assert t["type"] == kind
        assert meta["consumerGroup"] == QUEUE_GROUP
        assert set(meta) <= TRIGGER_METADATA[kind], (
            f"{t['name']}: {set(meta) - TRIGGER_METADATA[kind]}"
        )
        # KEDA reads the address from the worker container's environment (host:port)
        address_var = meta["addressesFromEnv" if settings.redis_cluster else "addressFromEnv"]
        assert f"{url.hostname}:{url.port or 6379}" in env[address_var].replace(" ", "").split(",")
        if not settings.redis_cluster:
            assert int(meta.get("databaseIndex", "0")) == int(url.path.strip("/") or 0)
    # one composed metric: waiting + running jobs of every partition, per worker slot
    names = [t["name"] for t in triggers]
    assert len(set(names)) == len(names)
    modifiers = scaled["advanced"]["scalingModifiers"]
    assert sorted(modifiers["formula"].split(" + ")) == sorted(names)
    assert modifiers.get("metricType", "AverageValue") == "AverageValue"
    assert 0 < float(modifiers["target"]) <= settings.worker_concurrency
    # a worker runs one claim loop per partition, each taking from its slots
    assert settings.partitions <= settings.worker_concurrency
    assert scaled["minReplicaCount"] >= 1, "scaled to zero, a request waits for a model load"


# ---- the Redis Cluster overlay ----------------------------------------------------------

REDIS_OPS = ROOT / "ops" / "redis-cluster"
SHARD_LABEL = "lastevent.dev/redis-shard"
HOSTNAME = "kubernetes.io/hostname"


def redis_shards(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The StatefulSets of the Redis Cluster's shards, by name."""
    found = [
        o
        for o in objects
        if o["kind"] == "StatefulSet" and SHARD_LABEL in o["spec"]["selector"]["matchLabels"]
    ]
    return sorted(found, key=lambda o: o["metadata"]["name"])


def selects(selector: dict[str, str], template: dict[str, Any]) -> bool:
    labels: dict[str, str] = template["metadata"]["labels"]
    return selector.items() <= labels.items()


def test_redis_cluster_two_replicas_per_primary_on_other_hosts() -> None:
    """At `replica` a promoted replica needs a replica of its own to confirm to: each
    shard is a primary and two replicas, no two of them on one host (nor two of the
    primaries at creation), at most one of them drained at a time."""
    objects = built("redis-cluster")
    api = settings_of(objects, main_container(find(objects, "Deployment", "lastevent-api")))
    assert api.redis_cluster and api.durability == "replica"
    shards = redis_shards(objects)
    assert len(shards) == 3, "three primaries"
    assert api.partitions >= len(shards), "a primary with no partition"
    for sts in shards:
        name = sts["metadata"]["name"]
        # a primary and its two replicas
        assert sts["spec"]["replicas"] == 3, f"{name}: replicas {sts['spec']['replicas']}"
        template = sts["spec"]["template"]
        shard = sts["spec"]["selector"]["matchLabels"]
        assert selects(shard, template)
        assert sts["spec"].get("podManagementPolicy") == "Parallel", f"{name}: one pod at a time"
        terms = template["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        # no two nodes of the shard on one host
        assert any(
            t["topologyKey"] == HOSTNAME
            and t["labelSelector"]["matchLabels"].items()
            >= {SHARD_LABEL: shard[SHARD_LABEL]}.items()
            and selects(t["labelSelector"]["matchLabels"], template)
            and not t.get("matchLabelKeys")
            for t in terms
        ), f"{name}: two nodes of the shard may share a host"
        # nor two pods of one ordinal: the shards' first nodes on three hosts
        assert any(
            t["topologyKey"] == HOSTNAME
            and t.get("matchLabelKeys") == ["apps.kubernetes.io/pod-index"]
            and SHARD_LABEL not in t["labelSelector"]["matchLabels"]
            and all(
                selects(t["labelSelector"]["matchLabels"], o["spec"]["template"]) for o in shards
            )
            for t in terms
        ), f"{name}: two primaries at creation may share a host"
        budgets = [
            o
            for o in objects
            if o["kind"] == "PodDisruptionBudget" and o["spec"]["selector"]["matchLabels"] == shard
        ]
        assert [b["spec"] for b in budgets] == [
            {"maxUnavailable": 1, "selector": {"matchLabels": shard}}
        ], f"{name}: no budget of one"


def test_redis_cluster_job_makes_the_cluster_of_exactly_its_pods() -> None:
    """The Job's shards are the StatefulSets' pods, each by the name it announces; the
    nodes find each other by a Service that publishes pods before they are ready, and
    lastevent and KEDA reach the cluster by one that resolves to the ready ones."""
    objects = built("redis-cluster")
    shards = redis_shards(objects)
    announced = []
    for sts in shards:
        governing = find(objects, "Service", sts["spec"]["serviceName"])
        assert governing["spec"]["clusterIP"] == "None"
        assert governing["spec"].get("publishNotReadyAddresses") is True
        assert selects(governing["spec"]["selector"], sts["spec"]["template"])
        node = main_container(sts)
        env = {
            v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            for v in node["env"]
        }
        assert env == {
            "POD_NAME": "metadata.name",
            "POD_NAMESPACE": "metadata.namespace",
            "REDIS_PASSWORD": None,  # from the Secret lastevent-redis
            "REDISCLI_AUTH": None,
        }
        suffix = f".{governing['metadata']['name']}.$(POD_NAMESPACE).svc"
        assert node["command"] == ["sh", "/etc/redis-cluster/start.sh"]
        assert node["args"] == ["--cluster-announce-hostname", "$(POD_NAME)" + suffix]
        mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
        assert mounts["/data"] in {
            t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]
        }
        assert port_number(node, "redis") == 6379
        name = sts["metadata"]["name"]
        announced.append(" ".join(f"{name}-{i}{suffix}" for i in range(sts["spec"]["replicas"])))
    job = find(objects, "Job", "redis-cluster-create")
    create = main_container(job)
    assert create["command"] == ["sh", "/etc/redis-cluster/create.sh"]
    values = {v["name"]: v.get("value") for v in create["env"]}
    assert values["REDIS_CLUSTER_SHARDS"] == "; ".join(announced)
    # the scripts and redis.conf are mounted from the ConfigMap of ops/redis-cluster's copies
    for obj in [*shards, job]:
        (volume,) = [v for v in obj["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        assert volume["configMap"]["name"] == "redis-cluster"
        mounts = {m["name"]: m["mountPath"] for m in main_container(obj)["volumeMounts"]}
        assert mounts[volume["name"]] == "/etc/redis-cluster"
    # lastevent's URL and KEDA's addresses: the Service of the ready nodes
    api = main_container(find(objects, "Deployment", "lastevent-api"))
    url = urlsplit(settings_of(objects, api).redis_url or "")
    service = find(objects, "Service", url.hostname or "")
    assert not service["spec"].get("publishNotReadyAddresses")
    assert all(selects(service["spec"]["selector"], o["spec"]["template"]) for o in shards)
    assert env_of(objects, api)["REDIS_ADDRESSES"] == f"{url.hostname}:{url.port}"


def test_redis_cluster_files_are_ops_copies() -> None:
    """The overlay's ConfigMap carries ops/redis-cluster's files, unchanged (kustomize
    reads no file outside the overlay): after editing one there, copy it here."""
    configmap = find(built("redis-cluster"), "ConfigMap", "redis-cluster")
    files = {p.name: p.read_text() for p in sorted(REDIS_OPS.iterdir())}
    assert set(configmap["data"]) == set(files)
    for name, text in files.items():
        assert configmap["data"][name] == text, (
            f"ops/redis-cluster/{name} changed: copy it into the ConfigMap of "
            "ops/k8s/overlays/redis-cluster/redis-cluster.yaml (each line indented 4 spaces)"
        )


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("k8s_scaledobject", K8S / "scaledobject.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_scaledobjects_are_generated() -> None:
    generator = load_generator()
    base = (K8S / "base" / "scaledobject.yaml").read_text()
    assert base == generator.render([]), "regenerate: see ops/k8s/scaledobject.py"
    overlay = (K8S / "overlays" / "redis-cluster" / "scaledobject-patch.yaml").read_text()
    args = ["--partitions", "6", "--cluster", "--patch"]
    assert overlay == generator.render(args), "regenerate: see ops/k8s/scaledobject.py"
    second = (K8S / "overlays" / "two-models" / "scaledobject-qwen.yaml").read_text()
    args = ["--model", "Qwen2.5-0.5B-Instruct", "--name", "lastevent-worker-qwen"]
    assert second == generator.render(args), "regenerate: see ops/k8s/scaledobject.py"


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("partitions", [1, 3, 16])
def test_generator_names_the_streams_keys_names(partitions: int, cluster: bool) -> None:
    generator = load_generator()
    args = ["--partitions", str(partitions), "--prefix", "tenant-x", *(["--cluster"] * cluster)]
    obj = yaml.safe_load(generator.render(args))
    validate(obj, K8S_VERSIONS[0])
    keys = Keys("tenant-x", partitions)
    lane = model_lane(Settings().model_name)
    for kind in ("lagCount", "pendingEntriesCount"):
        streams = [
            t["metadata"]["stream"] for t in obj["spec"]["triggers"] if kind in t["metadata"]
        ]
        assert streams == [keys.queue(p, lane) for p in range(partitions)]


# ---- the kustomize above, on its own ------------------------------------------------------


def test_build_patches_like_kustomize(tmp_path: Path) -> None:
    def write(path: Path, *docs: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump_all(docs))

    env = [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    container = {"name": "c", "image": "lastevent:gpu", "env": env}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": {"spec": {"containers": [container]}}},
    }
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "s"},
        "spec": {"triggers": [{"type": "a"}, {"type": "b"}], "x": 1},
    }
    write(tmp_path / "base" / "kustomization.yaml", {"resources": ["d.yaml", "so.yaml"]})
    write(tmp_path / "base" / "d.yaml", deployment)
    write(tmp_path / "base" / "so.yaml", scaled)
    env_patch = [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]
    smp = {
        **deployment,
        "spec": {"template": {"spec": {"containers": [{"name": "c", "env": env_patch}]}}},
    }
    crd_patch = {**scaled, "spec": {"triggers": [{"type": "c"}], "x": None}}
    json_patch = [{"op": "add", "path": "/metadata/labels", "value": {"l": "v"}}]
    kustomization = {
        "resources": ["../base"],
        "patches": [
            {"patch": yaml.safe_dump(smp)},
            {"patch": yaml.safe_dump(crd_patch)},
            {"patch": yaml.safe_dump(json_patch), "target": {"kind": "ScaledObject"}},
        ],
        "images": [{"name": "lastevent", "newName": "registry.example:5000/le/lastevent"}],
    }
    write(tmp_path / "overlay" / "kustomization.yaml", kustomization)

    d, so = build(tmp_path / "overlay")
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert c["env"] == [*env_patch, env[0]]  # merged by name
    assert c["image"] == "registry.example:5000/le/lastevent:gpu"
    assert so["spec"] == {"triggers": [{"type": "c"}]}  # a custom resource's list: replaced
    assert so["metadata"]["labels"] == {"l": "v"}

    real = kubectl_kustomize(tmp_path / "overlay")
    assert real is None or same_objects([d, so], real)

    write(tmp_path / "overlay" / "kustomization.yaml", {**kustomization, "namespace": "x"})
    with pytest.raises(NotImplementedError):
        build(tmp_path / "overlay")
