"""Kubernetes helpers: the RayService's serveConfigV2 from the GPU Serve config, and the model
files a Ray pod needs.

``python -m specdec.tools.k8s render`` writes the two generated kustomize patches under ``k8s/``:
``deployments/config/gpu.yaml`` verbatim as the base's ``serveConfigV2`` (one source of truth),
and a CPU variant of it for the ``cpu-demo`` overlay. ``render --check`` fails when they are stale
(a unit test does the same).

``python -m specdec.tools.k8s models /models --roles draft target`` is the init container of the Ray
pods: it puts the bundled pair (converted from the ``qwen-coder`` part packages), a tiny random
pair, or any pair from the Hugging Face Hub or an object store at ``/models/draft`` and
``/models/target``, where the Serve config expects them.
"""

from __future__ import annotations

import argparse
import copy
import importlib.resources
import os
import sys
import uuid
from pathlib import Path

import yaml

from specdec.config import APPLICATION
from specdec.tools.args import RawDescriptionDefaultsHelpFormatter, run_standalone

MODEL_ROLES = ("draft", "target")
BASE_PATCH = Path("base/serve-config.yaml")
CPU_DEMO_PATCH = Path("overlays/cpu-demo/serve-config.yaml")
CPU_DEMO_MAX_REPLICAS = 2
CPU_DEMO_CACHE_BYTES = 1 << 30


def gpu_config_text() -> str:
    """The text of the shipped deployments/config/gpu.yaml."""
    return (importlib.resources.files("specdec.deployments") / "config" / "gpu.yaml").read_text()


def cpu_demo_config(gpu: dict) -> dict:
    """The GPU Serve config made to run on CPU pods: float32 on the CPU with the CPU's runner
    (dynamic), no GPUs or accelerator types requested, at most CPU_DEMO_MAX_REPLICAS replicas
    per deployment. Pools stay as they are."""
    config = copy.deepcopy(gpu)
    for app in config["applications"]:
        if app["name"] != APPLICATION:
            continue
        app["args"].update(
            dtype="float32",
            device="cpu",
            runner="dynamic",
            cache_capacity_bytes=CPU_DEMO_CACHE_BYTES,
        )
        for deployment in app["deployments"]:
            options = deployment.get("ray_actor_options", {})
            options.pop("num_gpus", None)
            options.pop("accelerator_type", None)
            scaling = deployment.get("autoscaling_config", {})
            if "max_replicas" in scaling:
                scaling["max_replicas"] = min(scaling["max_replicas"], CPU_DEMO_MAX_REPLICAS)
    return config


def serve_config_patch(op: str, text: str, source: str) -> str:
    """A JSON 6902 patch (kustomize ``patches``) that sets spec.serveConfigV2 to ``text``."""
    body = "".join(
        f"    {line}" if line.strip() else "\n" for line in text.splitlines(keepends=True)
    )
    return (
        f"# Generated from {source} by `python -m specdec.tools.k8s render`: do not edit.\n"
        f"- op: {op}\n  path: /spec/serveConfigV2\n  value: |\n{body}"
    )


def rendered_files(k8s_dir: str | os.PathLike = "k8s") -> dict[Path, str]:
    """{path: content} of every generated file under ``k8s_dir``."""
    root = Path(k8s_dir)
    gpu_text = gpu_config_text()
    cpu_text = (
        "# deployments/config/gpu.yaml for CPU pods (specdec.tools.k8s.cpu_demo_config)\n"
        + yaml.safe_dump(cpu_demo_config(yaml.safe_load(gpu_text)), sort_keys=False)
    )
    return {
        root / BASE_PATCH: serve_config_patch("add", gpu_text, "deployments/config/gpu.yaml"),
        root / CPU_DEMO_PATCH: serve_config_patch(
            "replace", cpu_text, "deployments/config/gpu.yaml (CPU variant)"
        ),
    }


# The seeded tiny random pair and the bundled pair; any other source is a Hub id or a URI.
NAMED_SOURCES = ("bundled", "tiny")


def prepare_models(
    dest: str | os.PathLike,
    roles: list[str],
    source: str = "bundled",
    dtype: str = "bfloat16",
    sources: dict[str, str] | None = None,
    revisions: dict[str, str | None] | None = None,
) -> list[Path]:
    """Makes ``dest/<role>`` a model directory for each role; returns those paths. Also makes
    ``dest/.calibration``, the replicas' calibration cache on the same volume.

    A role already present is left alone: a shared volume filled by another pod, or your own model
    copied there. Each role's source is ``sources[role]``, else ``source``:

    - ``bundled`` converts the bundled pair once into ``dest/.bundled`` (file locks and atomic
      renames make concurrent pods on a shared volume convert once);
    - ``tiny`` writes the seeded tiny random pair, the same in every pod;
    - a Hugging Face Hub id (at ``revisions[role]``, None: main; HF_TOKEN applies) is
      downloaded into ``dest/.hub``, a folder URI (``s3://``, ``gs://``, ...) copied into
      ``dest/.uri`` (specdec.models.sources.fetch).

    ``dest/<role>`` is a relative link to what was converted or fetched, so it resolves in every
    pod that mounts the volume.

    Raises:
        ModelLoadError: bundled part packages missing from the image, a failed conversion, or a
            model that cannot be fetched.
        ValueError: an unknown role.
    """
    from specdec.models import sources as model_sources

    root = Path(dest)
    if unknown := set(roles) - set(MODEL_ROLES):
        raise ValueError(f"roles must be among {list(MODEL_ROLES)}, got {sorted(unknown)}")
    (root / ".calibration").mkdir(parents=True, exist_ok=True)
    revisions = revisions or {}
    for role in roles:
        if (root / role).exists():  # here before, or written with the other role (tiny)
            continue
        spec = (sources or {}).get(role) or source
        if spec == "tiny":
            from specdec.models.tiny import save_pair

            save_pair(root, noise=0.05)  # as `specdec tiny-models`: both roles
            continue
        if spec == "bundled":
            from specdec.models import bundled

            folder = bundled.converted_path(role, dtype, root / ".bundled")
        elif model_sources.is_remote(spec):
            cache = root / (".hub" if "://" not in spec else ".uri")
            folder = Path(model_sources.fetch(spec, revisions.get(role) or None, cache))
        else:
            raise ValueError(
                f"the {role} source must be one of {list(NAMED_SOURCES)}, a Hub id or a URI, "
                f"got {spec!r}"
            )
        link = root / f".{role}.{uuid.uuid4().hex}"  # unique: pods may race on a shared volume
        link.symlink_to(os.path.relpath(folder, root))
        os.replace(link, root / role)
    return [root / role for role in roles]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The subcommands of `specdec k8s` / `python -m specdec.tools.k8s`: render, models (their
    help in the formatter of ``parser``)."""
    commands = parser.add_subparsers(dest="command", required=True)
    formatter = parser.formatter_class
    render = commands.add_parser(
        "render", help="write the generated files under k8s/", formatter_class=formatter
    )
    render.add_argument("--k8s-dir", default="k8s", help="the kustomize tree to write into")
    render.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    check = commands.add_parser(
        "check",
        help="pre-flight a cluster for an overlay: KubeRay, GPU nodes, storage, secrets",
        formatter_class=formatter,
    )
    check.add_argument("overlay", help="the kustomization to check (e.g. k8s/overlays/gke)")
    check.add_argument("--namespace", default="default", help="where the RayService goes")
    check.add_argument("--kubeconfig", help="kubectl's kubeconfig (default: kubectl's own)")
    check.add_argument("--context", help="the kubeconfig context (default: its current one)")
    models = commands.add_parser(
        "models",
        help="put the model pair where the Serve config expects it",
        formatter_class=formatter,
    )
    models.add_argument("dest", help="folder for draft/ and target/ (the pods' model volume)")
    models.add_argument(
        "--roles",
        nargs="+",
        default=list(MODEL_ROLES),
        choices=MODEL_ROLES,
        help="the models to put there",
    )
    models.add_argument(
        "--source",
        default="bundled",
        help="where both models come from, unless --draft / --target say: bundled (convert the "
        "shipped pair), tiny (the seeded tiny random pair), a Hugging Face Hub id or a folder URI",
    )
    for role in MODEL_ROLES:
        models.add_argument(
            f"--{role}",
            help=f"the {role}'s source, as --source (an empty value: --source's)",
        )
        models.add_argument(
            f"--{role}-revision",
            help=f"the Hub revision of a Hub-id {role} (an empty value: main)",
        )
    models.add_argument(
        "--dtype", default="bfloat16", help="dtype of the bundled conversion, as in the config"
    )


def main(args: argparse.Namespace) -> int:
    """``models``: prepare_models, printing each path and its target; returns 0. ``render``:
    writes the stale generated files, or with --check lists them on stderr; returns 1 when
    --check found any, else 0. ``check``: the pre-flight (specdec.tools.k8s_check), each
    finding a line; returns 1 when any is an error.

    Raises:
        specdec.errors.ModelLoadError, ValueError: as prepare_models. RuntimeError: kubectl
        failed (check).
    """
    if args.command == "check":
        return preflight_command(args)
    if args.command == "models":
        sources = {role: getattr(args, role) for role in MODEL_ROLES}
        revisions = {role: getattr(args, f"{role}_revision") for role in MODEL_ROLES}
        prepared = prepare_models(
            args.dest, args.roles, args.source, args.dtype, sources, revisions
        )
        for path in prepared:
            print(f"{path} -> {path.resolve()}")
        return 0
    stale = [
        path
        for path, text in rendered_files(args.k8s_dir).items()
        if not path.exists() or path.read_text() != text
    ]
    for path in stale:
        if args.check:
            print(f"stale: {path} (run: python -m specdec.tools.k8s render)", file=sys.stderr)
        else:
            path.write_text(rendered_files(args.k8s_dir)[path])
            print(f"wrote {path}")
    return 1 if args.check and stale else 0


def preflight_command(args: argparse.Namespace) -> int:
    """``check``: renders the overlay and reads the cluster with kubectl, prints the findings."""
    from specdec.tools.k8s_check import ClusterFacts, Kubectl, preflight

    kubectl = Kubectl(args.kubeconfig, args.context)
    findings = preflight(ClusterFacts.gather(kubectl, args.namespace), kubectl.render(args.overlay))
    for finding in findings:
        print(finding)
    errors = sum(f.level == "error" for f in findings)
    print(f"{args.overlay}: {errors} errors, {len(findings) - errors} warnings")
    return 1 if errors else 0


if __name__ == "__main__":
    run_standalone(
        add_cli_args,
        main,
        prog="python -m specdec.tools.k8s",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
