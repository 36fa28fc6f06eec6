"""A real local Ray cluster (head + draft-pool node + target-pool node) serving tiny models.

One cluster and one deployment for the whole integration session: starting Ray costs tens of
seconds on two cores. The config is the shipped local config with test-sized numbers: free
ports, the tiny pair, two fixed target replicas (so a replica can be killed mid-request) unless
a test autoscales. The router's timeouts are the shipped ones (120 s a call, UNAVAILABLE after
180 s): what the fault tests show is what a user's deploy does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from local_service import LOCAL_CONFIG, free_port, serving

from specdec import SamplingParams


def write_config(
    tmp: Path,
    draft: Path,
    target: Path,
    autoscaling: dict[str, dict] | None = None,
    target_env: dict[str, str] | None = None,
    target_replicas: int = 2,
    **args: object,
) -> tuple[Path, int]:
    """The shipped local config with the tiny pair and free ports; ``target_env`` adds
    environment variables to the TargetModel replicas'.

    Without ``autoscaling``: fixed replicas (``target_replicas`` targets: two, so that a test
    can kill one, each then on one OpenMP thread; a module that kills none starts one less).
    With it: {deployment name: fields} replace each named deployment's autoscaling_config
    fields (the shipped delays are minutes), and the model replicas run one OpenMP thread
    (_single_threaded).
    ``args`` replace the application's settings (e.g. dtype="bfloat16").
    """
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    port = free_port()
    config["grpc_options"]["port"] = port
    config["http_options"]["port"] = free_port()
    app = config["applications"][0]
    app["args"].pop("draft_dtype", None)  # the tiny pair runs in float32 on both sides
    app["args"].update(
        draft_model=str(draft),
        target_model=str(target),
        dtype="float32",
        cache_capacity_bytes=64 * 1024**2,
    )
    app["args"].update(args)
    for deployment in app["deployments"]:
        if deployment["name"] == "TargetModel":
            deployment["ray_actor_options"]["runtime_env"]["env_vars"].update(target_env or {})
        if autoscaling is None:
            deployment.pop("autoscaling_config")
            deployment["num_replicas"] = (
                target_replicas if deployment["name"] == "TargetModel" else 1
            )
            if deployment["name"] == "TargetModel" and target_replicas > 1:
                _single_threaded(deployment)  # the replicas share the host's cores
        else:
            deployment["autoscaling_config"].update(autoscaling.get(deployment["name"], {}))
            _single_threaded(deployment)
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def _single_threaded(deployment: dict) -> None:
    """One OpenMP thread for a model deployment whose replicas share the host's cores (the
    router sets none), as each replica of a real deploy has cores of its own. The tiny models
    gain nothing from a second, and two replicas with two spinning threads each on two cores
    slowed each other's small forwards many times over: starting together, each took 7-11 s to
    check the tiny target's stored exact widths, 0.4 s alone (AVX2-only EPYC); a busy replica
    starved one that was starting (a TargetModel replica took 105 s to initialise under 6
    streams, 10 s idle), so the scale-up came after the load had ended."""
    env = deployment.get("ray_actor_options", {}).get("runtime_env", {}).get("env_vars", {})
    if "OMP_NUM_THREADS" in env:
        env["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def tiny_service(tiny_pair):
    """A factory: ``with tiny_service(tmp, autoscaling=None, target_env=None,
    target_replicas=2, **args) as (client, info, address):`` the tiny pair served on a fresh
    local cluster of its own (see write_config, serving)."""
    pytest.importorskip("ray")

    def start(tmp, autoscaling=None, target_env=None, target_replicas=2, **args):
        config = write_config(tmp, *tiny_pair, autoscaling, target_env, target_replicas, **args)
        return serving(tmp, *config)

    return start


@pytest.fixture(scope="session")
def reference(engine):
    """reference(prompt, n): the in-process engine's target-only greedy token ids, what every
    greedy output over the service must equal."""
    return lambda prompt, n: engine.generate(prompt, SamplingParams(max_new_tokens=n), 0).token_ids


@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_service):
    """(client, ClusterInfo): the tiny pair deployed on a fresh local cluster."""
    # One prefill per batch (batch_prefill_s 0): concurrent new prompts on the tiny pair then
    # wait for later batches, as they do on a CPU, where a second of prefill is one prompt.
    with tiny_service(tmp_path_factory.mktemp("cluster"), batch_prefill_s=0) as (client, info, _):
        yield client, info


def pytest_collection_modifyitems(items):
    """Tests that start clusters of their own run before those on the shared ``served`` one: a
    process is the Ray driver of one cluster at a time, and ``served`` stays connected from
    its first use to the end of the session. The sort is stable, so the order within each
    group stays the files' order (test_serving's last test removes the target pool)."""
    items.sort(key=lambda item: "served" in getattr(item, "fixturenames", ()))
