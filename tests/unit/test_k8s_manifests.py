"""The Kubernetes manifests under k8s/, each kustomization rendered: valid against the KubeRay v1
CRDs (unknown fields rejected) and the Kubernetes schemas, serveConfigV2 valid for Ray Serve, pools
that the Serve config requests advertised by the worker groups, and the security settings of
issue #5. No cluster needed.

Rendering: `render` below implements exactly the kustomize features k8s/ uses (resources, JSON 6902
patches with a kind/name target, images), so the tests run where no kustomize binary exists;
where `kubectl` is installed, its own `kubectl kustomize` output must equal ours.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from specdec.config import ServiceConfig
from specdec.tools import k8s, k8s_check

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
KUBERAY = REPO.parent / "shared" / "data" / "kuberay"
# The provider overlays: each puts draft and target on a node pool of its own by this label.
PROVIDER_POOL_LABELS = {
    "overlays/gke": "cloud.google.com/gke-nodepool",
    "overlays/eks": "eks.amazonaws.com/nodegroup",
    "overlays/aks": "kubernetes.azure.com/agentpool",
}
KUSTOMIZATIONS = ["base", "overlays/gpu", "overlays/cpu-demo", *PROVIDER_POOL_LABELS]
K8S_VERSION = "1.30.0"  # the oldest Kubernetes these manifests promise to work on
SERVE_PORTS = {8000, 9000}
ROUTER_SVC = "specdec-router"  # the Service clients (and the gateway) enter by
STANDARD_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


# --- rendering (the subset of kustomize that k8s/ uses) ---------------------------------------


def render(directory: Path) -> list[dict]:
    """`kustomize build directory` for resources, JSON 6902 patch files and images."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unknown, f"{directory}: the test renderer does not implement {sorted(unknown)}"
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        # A JSON round trip unshares YAML anchors, so that a patch changes one place only.
        docs += (
            render(path)
            if path.is_dir()
            else [json.loads(json.dumps(d)) for d in yaml.safe_load_all(path.read_text()) if d]
        )
    for patch in kustomization.get("patches", []):
        targets = [
            d
            for d in docs
            if d["kind"] == patch["target"]["kind"]
            and d["metadata"]["name"] == patch["target"]["name"]
        ]
        assert targets, f"{directory}: patch {patch['path']} matches nothing"
        for doc in targets:
            apply_json_patch(doc, yaml.safe_load((directory / patch["path"]).read_text()))
    for image in kustomization.get("images", []):
        for container in _containers(docs):
            name, _, tag = (
                container["image"].rpartition(":")
                if ":" in container["image"]
                else (container["image"], "", "")
            )
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def apply_json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove, in place."""
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
        if op["op"] == "remove" or op["op"] == "replace":
            node[key]  # noqa: B018 (a missing path is an error, as in kustomize)
        if op["op"] == "remove":
            del node[key]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(key, op["value"])
        elif op["op"] in ("add", "replace"):
            node[key] = op["value"]
        else:
            raise AssertionError(f"the test renderer does not implement op {op['op']!r}")


def _containers(node) -> list[dict]:
    """Every container and init container anywhere in node."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += [c for c in value if isinstance(c, dict) and "image" in c]
            found += _containers(value)
    elif isinstance(node, list):
        for item in node:
            found += _containers(item)
    return found


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def _one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


# --- checks, each returning its problems (the negative tests feed them broken copies) ---------


@pytest.fixture(scope="module")
def crd_validators() -> dict[str, jsonschema.protocols.Validator]:
    return k8s_check.crd_validators(kuberay_crds())


def kuberay_crds() -> list[dict]:
    """The KubeRay CRDs of ../shared/data (the test skips without them)."""
    if not KUBERAY.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {KUBERAY} (they come with ../shared/data)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [yaml.load(path.read_text(), Loader=loader) for path in KUBERAY.glob("ray.io_*.yaml")]


crd_errors = k8s_check.crd_errors


def _group_resources(group: dict) -> tuple[dict[str, float], list[str]]:
    """(custom resources a Ray group advertises, problems): from exactly one of its `resources`
    field and rayStartParams.resources."""
    field = {
        k: float(v) for k, v in group.get("resources", {}).items() if k not in STANDARD_RESOURCES
    }
    start = group.get("rayStartParams", {}).get("resources")
    start = yaml.safe_load(start.strip("'\"").replace("\\", "")) if start else {}
    both = sorted(set(field) & set(start))
    problems = [
        f"{group['groupName']}: {name} declared in both `resources` and rayStartParams"
        for name in both
    ]
    return {**start, **field}, problems


def pool_problems(rayservice: dict) -> list[str]:
    """Every custom resource a deployment requests is advertised by a worker group with enough
    capacity for the deployment's max_replicas (else the autoscaler never adds a node for it),
    every advertised pool is used, and GPU replicas land on groups with GPUs."""
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    problems, advertised = [], {}
    for group in groups:
        resources, group_problems = _group_resources(group)
        problems += group_problems
        advertised[group["groupName"]] = (group, resources)
    app = next(a for a in _serve_config(rayservice)["applications"] if a["name"] == k8s.APPLICATION)
    requested = set()
    for deployment in app["deployments"]:
        options = deployment.get("ray_actor_options", {})
        wanted = dict(options.get("resources", {}))
        if options.get("accelerator_type"):
            wanted[f"accelerator_type:{options['accelerator_type']}"] = 0.001
        replicas = deployment.get("autoscaling_config", {}).get("max_replicas", 1)
        requested |= set(wanted)
        for name, amount in wanted.items():
            hosts = [(g, r) for g, r in advertised.values() if name in r]
            capacity = sum(g["maxReplicas"] * r[name] for g, r in hosts)
            if capacity < amount * replicas:
                problems.append(
                    f"{deployment['name']}: {replicas} x {name}={amount} but the worker "
                    f"groups advertise {capacity}"
                )
            gpus = options.get("num_gpus", 0)
            for g, _ in hosts:
                limit = float(
                    g["template"]["spec"]["containers"][0]["resources"]["limits"].get(
                        "nvidia.com/gpu", 0
                    )
                )
                if limit < gpus:
                    problems.append(
                        f"{deployment['name']}: needs {gpus} GPU, {g['groupName']} "
                        f"pods have {limit}"
                    )
    for name, (_, resources) in advertised.items():
        unused = [r for r in resources if r.endswith("_pool") and r not in requested]
        problems += [f"{name}: advertises {r}, which no deployment requests" for r in unused]
    return problems


def _policies(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}


def _gateway_peer() -> dict:
    """The NetworkPolicy peer that k8s/gateway/gateway.yaml's proxy pods are: its namespace,
    and the label Gateway API implementations put on a Gateway's pods."""
    gateway = _one(_gateway_docs(), "Gateway")["metadata"]
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": gateway["namespace"]}},
        "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": gateway["name"]}},
    }


def network_policy_problems(docs: list[dict]) -> list[str]:
    """Ingress and egress of the specdec pods: Serve's ports (8000, 9000) only from the gateway's
    pods or the RayService's own, never from every namespace or every pod; every peer names
    pods; egress only to the RayService's pods and the cluster DNS (port 53), the head's
    autoscaler to the Kubernetes API (443, 6443) in a policy of the head alone, and the worker
    pods' model downloads to HTTPS (443) in MODEL_DOWNLOADS."""
    policies = _policies(docs)
    main = policies.get("specdec")
    if main is None:
        return ["no NetworkPolicy `specdec`"]
    problems = []
    if sorted(main.get("policyTypes", [])) != ["Egress", "Ingress"]:
        problems.append(f"specdec: policyTypes {main.get('policyTypes')}, not Ingress and Egress")
    own = {"podSelector": main["podSelector"]}
    admitted_gateway = False
    for index, rule in enumerate(main.get("ingress", [])):
        peers = rule.get("from")
        if not peers:
            problems.append(f"ingress {index}: admits every source")
            continue
        ports = {p["port"] for p in rule.get("ports", [])} or None  # None: every port
        for peer in peers:
            if not peer.get("podSelector", {}).get("matchLabels"):
                problems.append(f"ingress {index}: a peer names no pods: {peer}")
            if ports is None or ports & SERVE_PORTS:
                if peer == _gateway_peer():
                    admitted_gateway = True
                elif peer != own:
                    problems.append(f"ingress {index}: Serve's ports admitted from {peer}")
    if not admitted_gateway:
        problems.append("no ingress rule admits the gateway's pods to Serve's ports")
    egress = main.get("egress")
    if not egress:
        problems.append("specdec: no egress rules")
    for index, rule in enumerate(egress or []):
        for peer in rule.get("to") or [{}]:
            if peer == own:
                continue
            dns = peer.get("podSelector", {}).get("matchLabels") == {"k8s-app": "kube-dns"}
            ports = {p["port"] for p in rule.get("ports", [])}
            if not dns or ports != {53}:
                problems.append(f"egress {index}: to {peer} on {sorted(ports) or 'every port'}")
    for name, spec in policies.items():
        if name == "specdec":
            continue
        if name == MODEL_DOWNLOADS:
            problems += _download_policy_problems(spec)
            continue
        labels = spec["podSelector"].get("matchLabels", {})
        if labels.get("app.kubernetes.io/component") != "head" or spec["policyTypes"] != ["Egress"]:
            problems.append(f"{name}: not an egress policy of the head alone")
        for rule in spec.get("egress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            if not ports or not ports <= {443, 6443}:
                problems.append(f"{name}: egress beyond the Kubernetes API: {rule}")
    return problems


# The one egress policy of the model pods beyond the RayService: HTTPS, for the init
# containers' downloads of a Hub id or URI (k8s/base/models.yaml).
MODEL_DOWNLOADS = "specdec-model-downloads"


def _download_policy_problems(spec: dict) -> list[str]:
    """The downloads policy selects only worker pods (router, draft, target), only for egress,
    and admits HTTPS (443) only."""
    problems = []
    expressions = {e["key"]: e for e in spec["podSelector"].get("matchExpressions", [])}
    components = expressions.get("app.kubernetes.io/component", {})
    if components.get("operator") != "In" or "head" in components.get("values", ["head"]):
        problems.append(f"{MODEL_DOWNLOADS}: selects more than the worker pods: {spec}")
    if spec.get("policyTypes") != ["Egress"]:
        problems.append(f"{MODEL_DOWNLOADS}: not an egress policy alone")
    for rule in spec.get("egress", []):
        if {p["port"] for p in rule.get("ports", [])} != {443}:
            problems.append(f"{MODEL_DOWNLOADS}: egress beyond HTTPS: {rule}")
    return problems


def _gateway_docs() -> list[dict]:
    return [
        d
        for path in sorted((K8S / "gateway").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]


# --- the tests --------------------------------------------------------------------------------


def test_generated_serve_configs_are_current():
    for path, text in k8s.rendered_files(K8S).items():
        assert path.read_text() == text, (
            f"{path} is stale; run `python -m specdec.tools.k8s render`"
        )


@pytest.mark.skipif(
    not shutil.which("kubectl"),
    reason="kubectl not installed: only the test renderer renders k8s/ here",
)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_test_renderer_agrees_with_kubectl_kustomize(kustomization):
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / kustomization)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(out), key=key) == sorted(render(K8S / kustomization), key=key)


def test_custom_resources_match_the_kuberay_crds(rendered, crd_validators):
    name, docs = rendered
    custom = [d for d in docs if d["apiVersion"].startswith("ray.io/")]
    assert [d["kind"] for d in custom] == ["RayService"]
    for doc in custom:
        assert crd_errors(doc, crd_validators) == [], name


def test_builtin_kinds_match_the_kubernetes_schemas(rendered):
    name, docs = rendered
    builtin = [d for d in docs if not d["apiVersion"].startswith("ray.io/")]
    assert "NetworkPolicy" in {d["kind"] for d in builtin}
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_serve_config_is_valid_for_ray_serve(rendered):
    name, docs = rendered
    rayservice = _one(docs, "RayService")
    config = ServeDeploySchema.model_validate(_serve_config(rayservice))
    if name == "overlays/cpu-demo":
        assert "cuda" not in rayservice["spec"]["serveConfigV2"]
    else:  # the one source of truth, verbatim
        assert rayservice["spec"]["serveConfigV2"] == k8s.gpu_config_text()
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert (
        ports["serve"] == config.http_options.port
        and ports["serve-grpc"] == config.grpc_options.port
    )
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_worker_groups_advertise_what_the_serve_config_requests(rendered):
    name, docs = rendered
    assert pool_problems(_one(docs, "RayService")) == []


def test_model_init_containers_convert_in_the_serving_dtype(rendered):
    name, docs = rendered
    rayservice = _one(docs, "RayService")
    args = next(a for a in _serve_config(rayservice)["applications"] if a["name"] == "specdec")[
        "args"
    ]
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (init,) = group["template"]["spec"]["initContainers"]
        command = init["command"]
        assert command[:5] == ["python", "-m", "specdec.tools.k8s", "models", "/models"]
        if "tiny" not in command:  # a bundled source converts in --dtype
            # dtype auto loads the stored bfloat16 checkpoint and casts it per candidate.
            stored = "bfloat16" if args["dtype"] == "auto" else args["dtype"]
            assert command[command.index("--dtype") + 1] == stored, group["groupName"]


def _required_node_terms(pod: dict) -> list[dict]:
    """The match expressions a pod's node affinity requires (every node selector term's)."""
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [e for term in required["nodeSelectorTerms"] for e in term["matchExpressions"]]


def test_gpu_groups_select_nodes_by_labels_their_nodes_already_carry(rendered):
    """No hand-set label: the base and overlays/gpu pick the GPU class by NVIDIA feature
    discovery's nvidia.com/gpu.product (both groups alike), each provider overlay puts draft
    and target on node pools of their own by the provider's node-pool label."""
    name, docs = rendered
    spec = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert spec["enableInTreeAutoscaling"] is True
    assert {"upscalingMode", "idleTimeoutSeconds", "resources"} <= set(spec["autoscalerOptions"])
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    if name == "overlays/cpu-demo":
        assert "nvidia.com/gpu" not in yaml.safe_dump(docs)
        return
    selectors = []
    for group_name in ("draft-gpu", "target-gpu"):
        pod = groups[group_name]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        assert 1 <= groups[group_name]["minReplicas"] <= groups[group_name]["maxReplicas"]
        assert "nodeSelector" not in pod, "a label set by hand"
        selectors.append(_required_node_terms(pod))
    if name in PROVIDER_POOL_LABELS:
        assert selectors[0] != selectors[1], "draft and target share a node pool"
        assert {e["key"] for terms in selectors for e in terms} == {PROVIDER_POOL_LABELS[name]}
    else:
        assert selectors[0] == selectors[1]
        ((expression,),) = {tuple(map(repr, terms)) for terms in selectors}
        assert "nvidia.com/gpu.product" in expression and "H100" in expression


def test_draft_and_target_share_a_gpu_class_and_the_router_prefers_target_hosts(rendered):
    """The draft on the target's GPU class (a slower draft GPU eats the speedup), and router pods
    placed by preference on the hosts of target pods, spread one per host (docs/kubernetes.md,
    "Router placement"): the affinity's selector must match the target pods' own labels."""
    name, docs = rendered
    rayservice = _one(docs, "RayService")
    app = next(a for a in _serve_config(rayservice)["applications"] if a["name"] == "specdec")
    options = {d["name"]: d.get("ray_actor_options", {}) for d in app["deployments"]}
    # The GPU class lives in the groups' node affinity alone (a kustomize patch changes it, no
    # render step), never also in the Serve config.
    assert not any("accelerator_type" in o for o in options.values()), options
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    router = groups["router"]["template"]["spec"]["affinity"]
    target_group = next(g for g in groups.values() if "target_pool" in g["resources"])
    router_labels = groups["router"]["template"]["metadata"]["labels"]
    target_labels = target_group["template"]["metadata"]["labels"]
    for kind, labels in (("podAffinity", target_labels), ("podAntiAffinity", router_labels)):
        (term,) = router[kind]["preferredDuringSchedulingIgnoredDuringExecution"]
        selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert selector.items() <= labels.items(), (name, kind)
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_security(rendered):
    name, docs = rendered
    rayservice = _one(docs, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    head = cluster["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress")
    assert all(d.get("spec", {}).get("type") not in ("LoadBalancer", "NodePort") for d in docs)
    pods = [head["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    containers = _containers(docs) + [cluster["autoscalerOptions"]]
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["securityContext"]["runAsUser"] != 0
    for container in containers:
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), container.get("name")
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # The NetworkPolicy covers every Ray pod, in and out.
    policy = _policies(docs)["specdec"]
    selector = policy["podSelector"]["matchLabels"]
    assert all(selector.items() <= pod["metadata"]["labels"].items() for pod in pods)
    assert network_policy_problems(docs) == [], name
    # The router pods take the API keys from a Secret (service.api_keys_env's default name);
    # only the demo starts without it.
    router = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "router")
    (env,) = [
        e
        for e in router["template"]["spec"]["containers"][0]["env"]
        if e["name"] == ServiceConfig().api_keys_env
    ]
    secret = env["valueFrom"]["secretKeyRef"]
    assert secret["name"] == "specdec-api-keys" and secret["key"] == "keys"
    assert secret.get("optional", False) is (name == "overlays/cpu-demo")


def _group(rayservice: dict, component: str) -> dict:
    """The worker group whose pods carry app.kubernetes.io/component=component."""
    (group,) = [
        g
        for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        if g["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return group


def test_operations_upgrades_disruptions_and_a_head_that_can_die(rendered):
    """Issue 44 item 4: GCS fault tolerance on an external Redis (its password from a Secret),
    NewCluster upgrades whose old cluster outlives the router's drain, router pods given the
    drain to stop, a PodDisruptionBudget per group, and clients entering through the router
    pods only."""
    from specdec.deployments.router import DRAIN_S

    name, docs = rendered
    rayservice = _one(docs, "RayService")
    spec = rayservice["spec"]
    gcs = spec["rayClusterConfig"]["gcsFaultToleranceOptions"]
    redis = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] in gcs["redisAddress"]
    )
    assert gcs["redisPassword"]["valueFrom"]["secretKeyRef"]["name"]  # never a literal
    assert any(
        d["kind"] == "StatefulSet" and d["spec"]["serviceName"] == redis["metadata"]["name"]
        for d in docs
    )
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert spec["rayClusterDeletionDelaySeconds"] >= DRAIN_S
    router = _group(rayservice, "router")
    pod = router["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= DRAIN_S
    env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
    assert (
        DRAIN_S
        <= float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        < pod["terminationGracePeriodSeconds"]
    )
    assert router["minReplicas"] >= 2
    budgets = {
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: d["spec"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    assert set(budgets) == {"router", "draft", "target"}
    assert 1 <= budgets["router"]["minAvailable"] < router["minReplicas"]
    assert budgets["draft"]["maxUnavailable"] == budgets["target"]["maxUnavailable"] == 1
    for component, budget in budgets.items():
        labels = _group(rayservice, component)["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()
    (entry,) = [
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "specdec-router"
    ]
    assert entry["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert {p["port"] for p in entry["spec"]["ports"]} == SERVE_PORTS


# --- the checks have teeth --------------------------------------------------------------------


def test_gateway_terminates_tls_for_both_apis_and_routes_to_the_serve_service():
    """k8s/gateway: an HTTPS listener per API, each terminating TLS with a certificate; the
    HTTPRoute and GRPCRoute attach to their own listener and send the application's paths and
    services to the router pods' Service on Serve's HTTP and gRPC ports; the Gateway's namespace and
    name are what the NetworkPolicy admits (_gateway_peer)."""
    docs = _gateway_docs()
    assert sorted(d["kind"] for d in docs) == ["GRPCRoute", "Gateway", "HTTPRoute", "Namespace"]
    namespace, gateway = _one(docs, "Namespace"), _one(docs, "Gateway")
    kubernetes_validate.validate(namespace, K8S_VERSION, strict=True)
    assert gateway["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert all(d["apiVersion"] == "gateway.networking.k8s.io/v1" for d in docs[1:])
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    for listener in listeners.values():
        assert listener["protocol"] == "HTTPS" and listener["port"] == 443
        assert listener["tls"]["mode"] == "Terminate" and listener["tls"]["certificateRefs"]
        assert listener["allowedRoutes"]["namespaces"]["from"] == "Selector"
    base = render(K8S / "base")
    config = _serve_config(_one(base, "RayService"))
    # Clients enter through the router pods only (k8s/base/operations.yaml).
    (router,) = [d for d in base if d["kind"] == "Service" and d["metadata"]["name"] == ROUTER_SVC]
    ports = {
        "HTTPRoute": config["http_options"]["port"],
        "GRPCRoute": config["grpc_options"]["port"],
    }
    assert set(ports.values()) == {p["port"] for p in router["spec"]["ports"]}
    hostnames = set()
    for kind, port in ports.items():
        route = _one(docs, kind)
        (parent,) = route["spec"]["parentRefs"]
        assert parent["name"] == gateway["metadata"]["name"]
        assert parent["namespace"] == gateway["metadata"]["namespace"]
        listener = listeners[parent["sectionName"]]
        assert {"kind": kind} in listener["allowedRoutes"]["kinds"]
        assert route["spec"]["hostnames"] == [listener["hostname"]]
        hostnames.add(listener["hostname"])
        for rule in route["spec"]["rules"]:
            assert rule["backendRefs"] == [{"name": ROUTER_SVC, "port": port}]
    assert len(hostnames) == 2  # an HTTPRoute and a GRPCRoute may not share a hostname
    (http_rule,) = _one(docs, "HTTPRoute")["spec"]["rules"]
    _check_http_matches(http_rule["matches"], config)
    (grpc_rule,) = _one(docs, "GRPCRoute")["spec"]["rules"]
    services = {m["method"]["service"] for m in grpc_rule["matches"]}
    assert services == {"specdec.v1.SpeculativeDecoding", "grpc.health.v1.Health"}


def _check_http_matches(matches: list[dict], config: dict) -> None:
    """The HTTPRoute's path matches let through every route of the router's HTTP app (the API,
    health, their /specdec aliases) under the application's route prefix, and each match lets
    through at least one of them (never Serve's own /-/ routes)."""
    from specdec.deployments import http_health  # noqa: F401 - registers the health routes
    from specdec.deployments.http_api import ROUTE_PATHS

    prefix = next(a for a in config["applications"] if a["name"] == "specdec")["route_prefix"]
    paths = {prefix.rstrip("/") + path for path in ROUTE_PATHS}
    assert "/v1/chat/completions" in paths and "/specdec/v1/completions" in paths

    def passes(match: dict, path: str) -> bool:
        kind, value = match["path"]["type"], match["path"]["value"]
        return path == value if kind == "Exact" else path.startswith(value)

    assert {p for p in paths if not any(passes(m, p) for m in matches)} == set()
    assert [m for m in matches if not any(passes(m, p) for p in paths)] == []
    assert not any(passes(m, "/-/routes") or passes(m, "/-/healthz") for m in matches)


def test_network_policy_check_catches_open_ports_and_missing_egress():
    docs = render(K8S / "base")
    assert network_policy_problems(docs) == []

    def broken(change) -> list[str]:
        copied = copy.deepcopy(docs)
        change(_policies(copied))
        return network_policy_problems(copied)

    def open_ports(policies):  # the policy as it was: Serve's ports from anywhere
        policies["specdec"]["ingress"][0] = {"ports": [{"protocol": "TCP", "port": 9000}]}

    def every_namespace(policies):
        policies["specdec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}

    def no_egress(policies):
        del policies["specdec"]["egress"]
        policies["specdec"]["policyTypes"] = ["Ingress"]

    def egress_anywhere(policies):
        policies["specdec"]["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})

    def head_anywhere(policies):
        policies["specdec-head-egress"]["egress"][0]["ports"] = []

    assert any("every source" in p for p in broken(open_ports))
    assert any("Serve's ports admitted from" in p for p in broken(every_namespace))
    assert any("no egress" in p for p in broken(no_egress))
    assert any("egress 2" in p for p in broken(egress_anywhere))
    assert any("beyond the Kubernetes API" in p for p in broken(head_anywhere))

    def downloads_on_every_port(policies):
        policies[MODEL_DOWNLOADS]["egress"][0]["ports"] = []

    def downloads_from_the_head(policies):
        selector = policies[MODEL_DOWNLOADS]["podSelector"]["matchExpressions"]
        next(e for e in selector if e["key"].endswith("component"))["values"].append("head")

    assert any("egress beyond HTTPS" in p for p in broken(downloads_on_every_port))
    assert any("more than the worker pods" in p for p in broken(downloads_from_the_head))


def test_crd_validation_rejects_unknown_and_misplaced_fields(crd_validators):
    rayservice = _one(render(K8S / "overlays/gpu"), "RayService")
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["minReplica"] = 1  # typo
    assert any("minReplica" in e for e in crd_errors(broken, crd_validators))
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "securityContext"
    ]["runAsNonroot"] = True
    assert crd_errors(broken, crd_validators)
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["authOptions"]["mode"] = "tokens"
    assert crd_errors(broken, crd_validators)


def test_kubernetes_validation_rejects_unknown_fields():
    policies = [d for d in render(K8S / "base") if d["kind"] == "NetworkPolicy"]
    policy = copy.deepcopy(next(d for d in policies if d["metadata"]["name"] == "specdec"))
    policy["spec"]["ingress"][0]["port"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_pool_check_catches_mismatches():
    rayservice = _one(render(K8S / "overlays/gpu"), "RayService")
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    renamed = copy.deepcopy(rayservice)
    renamed["spec"]["serveConfigV2"] = rayservice["spec"]["serveConfigV2"].replace(
        "target_pool: 1", "target-pool: 1"
    )
    assert any("target-pool" in p for p in pool_problems(renamed))
    assert any("target_pool, which no deployment" in p for p in pool_problems(renamed))
    twice = copy.deepcopy(rayservice)
    twice["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["rayStartParams"]["resources"] = (
        '"{\\"draft_pool\\": 1}"'
    )
    assert any("both" in p for p in pool_problems(twice))
    small = copy.deepcopy(rayservice)
    small["spec"]["rayClusterConfig"]["workerGroupSpecs"][2]["maxReplicas"] = 2
    assert any("TargetModel" in p for p in pool_problems(small))
    no_gpu = copy.deepcopy(rayservice)
    limits = groups[1]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    del no_gpu["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][
        0
    ]["resources"]["limits"]["nvidia.com/gpu"]
    assert any("GPU" in p for p in pool_problems(no_gpu))


def test_renderer_applies_json_patch_ops():
    doc = {"a": {"b": [1, 2]}, "c": 1}
    apply_json_patch(
        doc,
        [
            {"op": "add", "path": "/a/b/1", "value": 9},
            {"op": "replace", "path": "/c", "value": 2},
            {"op": "remove", "path": "/a/b/0"},
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "add", "path": "/d~1e", "value": 4},
        ],
    )
    assert doc == {"a": {"b": [9, 2, 3]}, "c": 2, "d/e": 4}
    with pytest.raises(KeyError):
        apply_json_patch(doc, [{"op": "replace", "path": "/missing", "value": 0}])


@pytest.mark.parametrize("name", ["overlays/gpu", *PROVIDER_POOL_LABELS])
def test_every_pod_of_the_specdec_image_has_the_pull_secret(name):
    rayservice = _one(render(K8S / name), "RayService")["spec"]["rayClusterConfig"]
    pods = [rayservice["headGroupSpec"]] + rayservice["workerGroupSpecs"]
    for pod in pods:
        spec = pod["template"]["spec"]
        assert spec.get("imagePullSecrets") == [{"name": "specdec-pull"}], pod.get("groupName")


def test_prepare_models_links_the_bundled_pair_once(tmp_path, monkeypatch):
    from specdec.models import bundled

    converted = []

    def fake_convert(role, dtype, cache_dir):
        path = cache_dir / f"{role}-{dtype}"
        path.mkdir(parents=True)
        converted.append(role)
        return path

    monkeypatch.setattr(bundled, "converted_path", fake_convert)
    (tmp_path / "target").mkdir()  # your own target model, already on the volume
    paths = k8s.prepare_models(tmp_path, ["draft", "target"], "bundled", "bfloat16")
    assert converted == ["draft"]
    assert paths[0].resolve() == (tmp_path / ".bundled" / "draft-bfloat16").resolve()
    assert not paths[1].is_symlink()
    k8s.prepare_models(tmp_path, ["draft"], "bundled", "bfloat16")
    assert converted == ["draft"]
    with pytest.raises(ValueError, match="roles"):
        k8s.prepare_models(tmp_path, ["router"])


def test_prepare_models_links_a_uri_source_inside_the_volume(tmp_path, tiny_pair):
    """A role from a folder URI is copied under the volume and linked relatively (the link
    resolves in every pod that mounts the volume elsewhere); the calibration cache's folder is
    made beside the models; an unknown source is named."""
    volume = tmp_path / "models"
    (path,) = k8s.prepare_models(volume, ["target"], sources={"target": tiny_pair[1].as_uri()})
    link = path.readlink()
    assert not link.is_absolute() and link.parts[0] == ".uri"
    moved = tmp_path / "elsewhere"
    volume.rename(moved)
    config = (moved / "target" / "config.json").read_bytes()
    assert config == (tiny_pair[1] / "config.json").read_bytes()
    assert (moved / ".calibration").is_dir()
    with pytest.raises(ValueError, match="the draft source must be one of"):
        k8s.prepare_models(tmp_path / "other", ["draft"], sources={"draft": "no-such-thing"})
