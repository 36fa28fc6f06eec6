"""`specdec k8s check` (specdec.tools.k8s_check): the pre-flight's findings on the rendered
provider overlay against cluster facts built from KubeRay's real CRDs (../shared/data), one
fault at a time; and its kubectl side where kubectl is installed."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
from test_k8s_manifests import K8S, kuberay_crds, render

from specdec.tools.k8s_check import ClusterFacts, Kubectl, preflight

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")


def _node(name: str, pool: str, gpus: int) -> dict:
    return {
        "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": pool}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)} if gpus else {}},
    }


def _storage_class(name: str, provisioner: str, default: bool = True) -> dict:
    annotations = {"storageclass.kubernetes.io/is-default-class": "true"} if default else {}
    return {"metadata": {"name": name, "annotations": annotations}, "provisioner": provisioner}


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render(K8S / "overlays/gke")


@pytest.fixture(scope="module")
def ready() -> ClusterFacts:
    """A GKE cluster ready for overlays/gke: KubeRay 1.7, both node pools with GPUs, a
    Filestore default class, every Secret."""
    return ClusterFacts(
        crds=kuberay_crds(),
        operator_images=["quay.io/kuberay/operator:v1.7.0"],
        nodes=[
            _node("a", "specdec-draft", 8),
            _node("b", "specdec-target", 8),
            _node("c", "default-pool", 0),
        ],
        storage_classes=[_storage_class("filestore", "filestore.csi.storage.gke.io")],
        secrets=frozenset(
            {"specdec-redis", "specdec-api-keys", "specdec-pull", "specdec-hf-token"}
        ),
    )


def _messages(facts: ClusterFacts, docs: list[dict], level: str) -> list[str]:
    return [f.message for f in preflight(facts, docs) if f.level == level]


def test_a_ready_cluster_has_no_findings(ready, docs):
    assert preflight(ready, docs) == []


def test_kuberay_missing_old_or_refusing_the_manifests_is_an_error(ready, docs):
    none = dataclasses.replace(ready, crds=[])
    assert any("no RayService CRD serving ray.io/v1" in m for m in _messages(none, docs, "error"))
    old = dataclasses.replace(ready, operator_images=["quay.io/kuberay/operator:v1.5.1"])
    assert _messages(old, docs, "error") == [
        "KubeRay operator 1.5; the manifests need 1.7 or newer"
    ]
    unknown = dataclasses.replace(ready, operator_images=[])
    assert any("version is unknown" in m for m in _messages(unknown, docs, "warning"))
    typo = copy.deepcopy(docs)
    rayservice = next(d for d in typo if d["kind"] == "RayService")
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["minReplica"] = 1
    (refused,) = _messages(ready, typo, "error")
    assert (
        "the cluster's CRD refuses RayService/spec/rayClusterConfig/workerGroupSpecs/1" in refused
    )


def test_a_gpu_group_no_node_can_run_is_named(ready, docs):
    no_target_pool = dataclasses.replace(ready, nodes=[ready.nodes[0], ready.nodes[2]])
    (warning,) = _messages(no_target_pool, docs, "warning")
    assert warning.startswith("target-gpu: no node with GPUs matches its node affinity")
    assert "cloud.google.com/gke-nodepool In ['specdec-target']" in warning
    no_gpus = dataclasses.replace(ready, nodes=[_node("a", "specdec-draft", 0), ready.nodes[1]])
    assert [w.split(":")[0] for w in _messages(no_gpus, docs, "warning")] == ["draft-gpu"]


def test_a_claim_that_cannot_bind_is_an_error(ready, docs):
    block = dataclasses.replace(
        ready, storage_classes=[_storage_class("pd", "pd.csi.storage.gke.io")]
    )
    (error,) = _messages(block, docs, "error")
    assert error.startswith("PersistentVolumeClaim specdec-models needs ReadWriteMany")
    no_default = dataclasses.replace(
        ready, storage_classes=[_storage_class("filestore", "x", default=False)]
    )
    errors = _messages(no_default, docs, "error")
    assert "PersistentVolumeClaim specdec-models: no default StorageClass on the cluster" in errors


def test_missing_secrets_are_named_and_the_optional_ones_only_warned(ready, docs):
    missing = dataclasses.replace(ready, secrets=frozenset({"specdec-redis"}))
    assert _messages(missing, docs, "error") == ["Secret specdec-api-keys is missing (needed)"]
    assert _messages(missing, docs, "warning") == [
        "Secret specdec-hf-token is missing (optional)",
        "Secret specdec-pull is missing (optional)",
    ]


def test_gather_reads_what_kubectl_lists():
    """The facts from kubectl's JSON: ray.io CRDs only, the operator's images, the names of
    the namespace's Secrets."""
    answers = {
        "crd": [{"spec": {"group": "ray.io"}}, {"spec": {"group": "example.com"}}],
        "deployments": [
            {"spec": {"template": {"spec": {"containers": [{"image": "kuberay:v1.7.0"}]}}}}
        ],
        "nodes": [{"metadata": {"name": "n"}}],
        "storageclasses": [],
        "secrets": [{"metadata": {"name": "s"}}],
    }
    asked = []

    def kubectl(args):
        asked.append(args)
        return {"items": answers[args[1]]}

    facts = ClusterFacts.gather(kubectl, "prod")
    assert facts.crds == [{"spec": {"group": "ray.io"}}]
    assert facts.operator_images == ["kuberay:v1.7.0"] and facts.secrets == {"s"}
    assert ["get", "secrets", "-n", "prod", "-o", "json"] in asked


@needs_kubectl
def test_kubectl_renders_the_overlay_and_reports_a_cluster_it_cannot_reach(tmp_path):
    def by_name(docs):  # kubectl orders by kind
        return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))

    assert by_name(Kubectl().render(str(K8S / "overlays/gke"))) == by_name(
        render(K8S / "overlays/gke")
    )
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    with pytest.raises(RuntimeError, match="kubectl get crd -o json: "):
        ClusterFacts.gather(Kubectl(str(config)), "default")
