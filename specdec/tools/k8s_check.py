"""`specdec k8s check OVERLAY`: a pre-flight of a Kubernetes cluster for specdec's manifests,
before `kubectl apply -k OVERLAY`.

It reads the cluster through ``kubectl`` (its kubeconfig and context; nothing is changed) and
the overlay through ``kubectl kustomize``, then checks what would otherwise show as pods that
never start or never scale:

- the KubeRay operator's CRDs are installed, at the API version the manifests use, and the
  RayService validates against the cluster's own CRD schema (unknown fields rejected, as
  Kubernetes would prune them silently); the operator's version, read from its image tag, is at
  least MIN_KUBERAY;
- each GPU worker group's required node affinity matches nodes that have GPUs (else only a
  node pool the cluster autoscaler creates with those labels can run it: a warning);
- every PersistentVolumeClaim can bind: a default StorageClass exists when it names none, and a
  ReadWriteMany claim is not on a provisioner that only offers ReadWriteOnce;
- the Secrets the pods need exist (a warning for the optional ones).

ClusterFacts.gather reads the cluster; preflight is the checks, a pure function of the facts and
the rendered manifests, which the tests drive with the KubeRay CRDs of ../shared/data.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import yaml

# The oldest KubeRay operator the manifests are written for (its CRDs' fields, auth options).
MIN_KUBERAY = (1, 7)
# Block-storage CSI provisioners that offer ReadWriteOnce only: a ReadWriteMany claim on them
# stays Pending.
RWO_ONLY_PROVISIONERS = frozenset(
    {
        "ebs.csi.aws.com",
        "pd.csi.storage.gke.io",
        "disk.csi.azure.com",
        "kubernetes.io/aws-ebs",
        "kubernetes.io/gce-pd",
        "kubernetes.io/azure-disk",
        "rancher.io/local-path",
    }
)
_DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
_GPU = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One result: ``level`` "error" (the deployment would not work) or "warning"."""

    level: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


@dataclasses.dataclass(frozen=True)
class ClusterFacts:
    """What the checks read of a cluster (each a list of Kubernetes objects as dicts).

    Attributes:
        crds: the CustomResourceDefinitions of ray.io.
        operator_images: the images of the KubeRay operator's Deployments.
        nodes, storage_classes: as `kubectl get ... -o json` lists them.
        secrets: the names of the Secrets in the target namespace.
    """

    crds: list[dict]
    operator_images: list[str]
    nodes: list[dict]
    storage_classes: list[dict]
    secrets: frozenset[str]

    @classmethod
    def gather(cls, kubectl: Callable[[list[str]], Any], namespace: str) -> ClusterFacts:
        """Reads the cluster through ``kubectl(args) -> the parsed JSON output`` (Kubectl).

        Raises:
            RuntimeError: kubectl failed (no cluster, no permission), with its message.
        """
        items = lambda *args: kubectl(["get", *args, "-o", "json"])["items"]  # noqa: E731
        crds = [c for c in items("crd") if c["spec"]["group"] == "ray.io"]
        operators = items("deployments", "-A", "-l", "app.kubernetes.io/name=kuberay-operator")
        images = [
            c["image"] for d in operators for c in d["spec"]["template"]["spec"]["containers"]
        ]
        return cls(
            crds=crds,
            operator_images=images,
            nodes=items("nodes"),
            storage_classes=items("storageclasses"),
            secrets=frozenset(s["metadata"]["name"] for s in items("secrets", "-n", namespace)),
        )


class Kubectl:
    """Runs ``kubectl`` with a kubeconfig and context, returning its parsed JSON (or YAML)."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None) -> None:
        self.base = ["kubectl"]
        if kubeconfig:
            self.base += ["--kubeconfig", kubeconfig]
        if context:
            self.base += ["--context", context]

    def __call__(self, args: list[str]) -> Any:
        return json.loads(self.run(args))

    def run(self, args: list[str]) -> str:
        """kubectl's standard output. Raises RuntimeError with its error output."""
        try:
            done = subprocess.run(
                [*self.base, *args], capture_output=True, text=True, timeout=120, check=False
            )
        except FileNotFoundError as err:
            raise RuntimeError("kubectl is not installed (or not on PATH)") from err
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def render(self, overlay: str) -> list[dict]:
        """The overlay's manifests (`kubectl kustomize`)."""
        return [d for d in yaml.safe_load_all(self.run(["kustomize", overlay])) if d]


def preflight(facts: ClusterFacts, docs: list[dict]) -> list[Finding]:
    """Every finding for deploying ``docs`` (rendered manifests) on the cluster of ``facts``."""
    return [
        *_kuberay(facts, docs),
        *_gpu_nodes(facts, docs),
        *_storage(facts, docs),
        *_secrets(facts, docs),
    ]


def strict_schema(schema: Any) -> Any:
    """An OpenAPI schema with ``additionalProperties: false`` on every object node that has
    properties, except where Kubernetes keeps unknown fields (x-kubernetes-preserve-unknown-
    fields): the fields Kubernetes would prune silently become errors."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict_schema(s) for name, s in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_schema(out[key])
    return out


def crd_validators(crds: list[dict], version: str = "v1") -> dict[str, Any]:
    """{kind: a jsonschema validator of its ``version``'s strict schema} for each CRD that
    serves that version."""
    import jsonschema

    validators = {}
    for crd in crds:
        for served in crd["spec"]["versions"]:
            if served["name"] == version:
                schema = strict_schema(served["schema"]["openAPIV3Schema"])
                validators[crd["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(schema)
    return validators


def crd_errors(doc: dict, validators: dict[str, Any]) -> list[str]:
    """``doc``'s schema errors, each as ``Kind/path: message``."""
    return [
        f"{doc['kind']}/{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validators[doc["kind"]].iter_errors(doc)
    ]


def _kuberay(facts: ClusterFacts, docs: list[dict]) -> Iterator[Finding]:
    ours = [d for d in docs if d.get("apiVersion", "").startswith("ray.io/")]
    version = ours[0]["apiVersion"].split("/")[1] if ours else "v1"
    validators = crd_validators(facts.crds, version)
    for doc in ours:
        if doc["kind"] not in validators:
            yield Finding(
                "error", f"no {doc['kind']} CRD serving ray.io/{version}: install KubeRay"
            )
            continue
        for error in crd_errors(doc, validators)[:5]:
            yield Finding("error", f"the cluster's CRD refuses {error}")
    versions = [v for v in map(_image_version, facts.operator_images) if v]
    if not versions:
        yield Finding("warning", "no kuberay-operator Deployment found: its version is unknown")
    elif max(versions) < MIN_KUBERAY:
        wanted = ".".join(map(str, MIN_KUBERAY))
        found = ".".join(map(str, max(versions)))
        yield Finding("error", f"KubeRay operator {found}; the manifests need {wanted} or newer")


def _image_version(image: str) -> tuple[int, ...] | None:
    match = re.search(r":v?(\d+)\.(\d+)", image)
    return tuple(map(int, match.groups())) if match else None


def _gpu_nodes(facts: ClusterFacts, docs: list[dict]) -> Iterator[Finding]:
    for group in _worker_groups(docs):
        pod = group["template"]["spec"]
        wants_gpu = any(_GPU in c.get("resources", {}).get("limits", {}) for c in pod["containers"])
        if not wants_gpu:
            continue
        terms = (
            pod.get("affinity", {})
            .get("nodeAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", {})
            .get("nodeSelectorTerms", [])
        )
        fitting = [
            n["metadata"]["name"]
            for n in facts.nodes
            if _matches(n["metadata"].get("labels", {}), terms, pod.get("nodeSelector", {}))
            and float(n["status"].get("allocatable", {}).get(_GPU, 0)) >= 1
        ]
        if not fitting:
            yield Finding(
                "warning",
                f"{group['groupName']}: no node with GPUs matches its node affinity "
                f"{_describe(terms, pod.get('nodeSelector'))}; it runs only once the cluster "
                "autoscaler adds nodes from a node pool that carries those labels",
            )


def _matches(labels: dict, terms: list[dict], selector: dict) -> bool:
    """Whether node ``labels`` satisfy a nodeSelector and any of the required terms."""
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    return not terms or any(all(_holds(labels, e) for e in t["matchExpressions"]) for t in terms)


def _holds(labels: dict, expression: dict) -> bool:
    key, op, values = expression["key"], expression["operator"], expression.get("values", [])
    return {
        "In": lambda: labels.get(key) in values,
        "NotIn": lambda: labels.get(key) not in values,
        "Exists": lambda: key in labels,
        "DoesNotExist": lambda: key not in labels,
    }.get(op, lambda: False)()


def _describe(terms: list[dict], selector: dict | None) -> str:
    parts = [f"{k}={v}" for k, v in (selector or {}).items()]
    for term in terms:
        parts += [
            f"{e['key']} {e['operator']} {e.get('values', [])}" for e in term["matchExpressions"]
        ]
    return "(" + "; ".join(parts) + ")"


def _storage(facts: ClusterFacts, docs: list[dict]) -> Iterator[Finding]:
    classes = {c["metadata"]["name"]: c for c in facts.storage_classes}
    default = next(
        (
            c
            for c in classes.values()
            if c["metadata"].get("annotations", {}).get(_DEFAULT_CLASS) == "true"
        ),
        None,
    )
    for claim in [d for d in docs if d["kind"] == "PersistentVolumeClaim"]:
        name, spec = claim["metadata"]["name"], claim["spec"]
        wanted = spec.get("storageClassName")
        storage_class = classes.get(wanted) if wanted else default
        if storage_class is None:
            what = f"StorageClass {wanted!r}" if wanted else "default StorageClass"
            yield Finding("error", f"PersistentVolumeClaim {name}: no {what} on the cluster")
            continue
        provisioner = storage_class.get("provisioner", "")
        if "ReadWriteMany" in spec.get("accessModes", []) and provisioner in RWO_ONLY_PROVISIONERS:
            yield Finding(
                "error",
                f"PersistentVolumeClaim {name} needs ReadWriteMany; StorageClass "
                f"{storage_class['metadata']['name']} ({provisioner}) offers ReadWriteOnce only: "
                "set storageClassName to a shared filesystem's class (NFS, Filestore, EFS, ...)",
            )


def _secrets(facts: ClusterFacts, docs: list[dict]) -> Iterator[Finding]:
    for name, optional in sorted(_secret_references(docs).items()):
        if name not in facts.secrets:
            level = "warning" if optional else "error"
            yield Finding(
                level, f"Secret {name} is missing ({'optional' if optional else 'needed'})"
            )


def _secret_references(docs: list[dict]) -> dict[str, bool]:
    """{Secret name: whether every reference to it is optional} over the manifests' pods
    (secretKeyRef, imagePullSecrets count as optional: a kubelet pulls without them)."""
    references: dict[str, bool] = {}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("secretKeyRef")
            if isinstance(ref, dict):
                name = ref["name"]
                references[name] = references.get(name, True) and bool(ref.get("optional"))
            for pull in (
                node.get("imagePullSecrets", [])
                if isinstance(node.get("imagePullSecrets"), list)
                else []
            ):
                references.setdefault(pull["name"], True)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(docs)
    return references


def _worker_groups(docs: list[dict]) -> list[dict]:
    groups = []
    for doc in docs:
        if doc["kind"] in ("RayService", "RayCluster"):
            spec = doc["spec"].get("rayClusterConfig", doc["spec"])
            groups += spec.get("workerGroupSpecs", [])
    return groups
