"""Deploying a Serve config file to a running Ray cluster from Python, through Serve's public API.

This is what ``serve run CONFIG`` does, without blocking and without the dashboard's REST API
(``serve deploy`` needs it; tests and the local cluster run without a dashboard). The
application is built here, in the deploying process (``serve.run_many`` of the built
application, its deployments' options taken from the config), rather than by a build task the
Serve controller starts from the config's ``import_path``: the same application, one process
start fewer. KubeRay deploys the same config file by its ``import_path``.
"""

from __future__ import annotations

import dataclasses
import inspect
import socket
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

from specdec.cluster.processes import prepare_driver
from specdec.config import APPLICATION, SIDES, ModelConfig, SpecdecConfig
from specdec.errors import ConfigError

# Ray Serve reads the gRPC proxy's max receive (and send) message size from this variable of
# the proxy's environment; proxies inherit the Serve controller's runtime_env.
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
# The application builder this module builds; a config naming another is refused.
BUILDER = "specdec.deployments.app:build_app"


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ServeDeploySchema:
    """Parses and validates a Serve config; ``overrides`` update it.

    An override's key is a setting of the specdec app (its ``args``, e.g. ``dtype``), or, when
    it is dotted or a top-level field of a Serve config, a path in the Serve config (set_path:
    ``deployments.TargetModel.autoscaling_config.max_replicas``, ``http_options.port``,
    ``proxy_location``).
    A ``dtype`` or ``gemm`` override is the target's: where neither the overrides nor the config
    set ``draft_dtype`` (``draft_gemm``), the draft keeps the dtype and GEMM the config gives it:
    ``--dtype bfloat16`` on the shipped ``dtype: auto`` leaves the draft measuring its own (int8
    on a CPU) instead of following the target into bfloat16.

    Raises:
        FileNotFoundError, pydantic.ValidationError (with the offending field),
        specdec.errors.ConfigError (a dotted key that names nothing in a Serve config).
    """
    raw = yaml.safe_load(Path(path).read_text())
    overrides = dict(overrides or {})
    for key in [key for key in overrides if "." in key or key in ServeDeploySchema.model_fields]:
        set_path(raw, key, overrides.pop(key))
    for app in raw.get("applications", []):
        if app.get("name") == APPLICATION and overrides:
            args = app.setdefault("args", {})
            if {"dtype", "gemm"} & set(overrides) and "draft_dtype" not in overrides:
                keys = ("dtype", "gemm", "draft_dtype", "draft_gemm")
                models = ModelConfig(**{key: args[key] for key in keys if key in args})
                args.setdefault("draft_dtype", models.for_side("draft")[1])
                if "draft_gemm" not in overrides:
                    args.setdefault("draft_gemm", models.gemm_for("draft"))
            args.update(overrides)
    return ServeDeploySchema.model_validate(raw)


def set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    """Sets the dotted ``key`` of a raw Serve config to ``value``, making the dictionaries on
    the way. ``deployments.NAME.FIELD...`` is in the specdec application's entry for deployment
    NAME (added when the config has none); any other key starts at a top-level field of a Serve
    config (``http_options.port``, ``grpc_options.port``). Serve's schema then checks the value.

    Raises:
        specdec.errors.ConfigError naming ``key``: it starts at no Serve config field, names
            no field below a deployment, or passes through a value that is no mapping.
    """
    first, *rest = key.split(".")
    if first == "deployments":
        if len(rest) < 2:
            raise ConfigError(
                key, "must be deployments.NAME.FIELD (e.g. ...TargetModel.num_replicas)"
            )
        app = next((a for a in raw.get("applications", []) if a.get("name") == APPLICATION), None)
        if app is None:
            raise ConfigError(key, f"the config has no application named {APPLICATION!r}")
        name, *rest = rest
        entries = app.setdefault("deployments", [])
        node = next((d for d in entries if d.get("name") == name), None)
        if node is None:
            node = {"name": name}
            entries.append(node)
    elif first in ServeDeploySchema.model_fields:
        node, rest = raw, [first, *rest]
    else:
        fields = ["deployments", *ServeDeploySchema.model_fields]
        raise ConfigError(
            key, f"names no Serve config field; a dotted key starts at one of {fields}"
        )
    *parents, last = rest
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{part} is {node!r}, not a mapping")
    node[last] = value


def app_config(config: ServeDeploySchema) -> SpecdecConfig | None:
    """The specdec application's args, parsed as build_app parses them (None: no application
    named "specdec").

    Raises:
        specdec.errors.ConfigError: a missing, unknown or invalid setting (named first).
    """
    for app in config.applications:
        if app.name == APPLICATION:
            return SpecdecConfig.from_args(app.args)
    return None


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """A Serve config file, parsed and validated once (ServeConfig.load), then passed whole.

    Attributes:
        path: the YAML file it was read from.
        schema: Serve's validated config, the specdec application's args overridden.
        app: the specdec application's settings, parsed from those args as build_app parses
            them (app_config); None without an application named "specdec".
    """

    path: Path
    schema: ServeDeploySchema
    app: SpecdecConfig | None

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ServeConfig:
        """Reads, validates and parses ``path`` (load_config, then app_config).

        Raises:
            FileNotFoundError, pydantic.ValidationError, specdec.errors.ConfigError (the
            application's args, named first).
        """
        schema = load_config(path, overrides)
        return cls(Path(path), schema, app_config(schema))

    @property
    def grpc_port(self) -> int:
        """The port Serve's gRPC proxy listens on (grpc_options.port)."""
        return self.schema.grpc_options.port

    @property
    def http_base_url(self) -> str:
        """The OpenAI API's base URL on this machine: ``http://HOST:PORT/PREFIX/v1`` from
        http_options and the specdec application's route_prefix (a wildcard host as
        127.0.0.1)."""
        options = self.schema.http_options
        host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
        app = next((a for a in self.schema.applications if a.name == APPLICATION), None)
        prefix = (app.route_prefix or "/").rstrip("/") if app is not None else ""
        return f"http://{host}:{options.port}{prefix}/v1"

    def with_settings(self, **settings: Any) -> ServeConfig:
        """A copy with the specdec application's named settings replaced, in its args and in
        ``app`` alike (no application: unchanged).

        Raises:
            specdec.errors.ConfigError naming an unknown or invalid setting.
        """
        if self.app is None or not settings:
            return self
        app = self.app.with_settings(**settings)
        applications = [
            a.model_copy(update={"args": {**a.args, **settings}}) if a.name == APPLICATION else a
            for a in self.schema.applications
        ]
        schema = self.schema.model_copy(update={"applications": applications})
        return dataclasses.replace(self, schema=schema, app=app)


def local_models(config: ServeConfig) -> dict[str, Any]:
    """Settings that point the config's models at folders on this machine: a ``bundled:`` model
    converted in the dtype that side's replicas load (specdec.config.ModelConfig.for_side), a
    Hub id or URI fetched (specdec.models.sources.fetch, at the side's revision, which the
    settings then clear); for a fetched target, ``served_model_name`` is the Hub id or URI
    unless the config names one. Local paths are left as they are.

    Converting the bundled pair takes minutes the first time, a download as long as it takes;
    doing it here, in the process that deploys (with progress bars, and with this shell's
    HF_TOKEN), keeps the replicas from doing it concurrently in their constructors, and a
    missing model fails before anything is deployed. Only for clusters on this machine: the
    folders are local paths.

    Raises:
        specdec.errors.ModelLoadError: the pair is not installed or fails its checksum, or a
            model cannot be fetched.
    """
    from specdec.models import bundled, sources

    if config.app is None:
        return {}
    models, settings = config.app.models, {}
    for side in SIDES:
        spec, dtype = models.for_side(side)
        if spec.startswith(bundled.SPEC_PREFIX):
            settings[f"{side}_model"] = bundled.resolve(spec, dtype)
        elif sources.is_remote(spec):
            settings[f"{side}_model"] = sources.fetch(spec, models.revision_for(side))
            settings[f"{side}_revision"] = None
            if side == "target" and config.app.service.served_model_name is None:
                settings["served_model_name"] = spec
    return settings


def resolve_models(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``overrides`` plus local_models of the config, for callers that deploy by path.

    Raises:
        specdec.errors.ConfigError: the application's args are invalid (see app_config);
        specdec.errors.ModelLoadError: as local_models.
    """
    overrides = dict(overrides or {})
    return {**overrides, **local_models(ServeConfig.load(path, overrides))}


def deploy(
    config: ServeConfig | str | Path,
    address: str | None = None,
    overrides: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Deploys the config to the cluster at ``address`` and waits until it is RUNNING.

    ``config``: a ServeConfig, parsed once by the caller, or the path of one, loaded here with
    ``overrides`` (which a ServeConfig must already hold).

    Raises:
        ValueError: ``overrides`` given with a ServeConfig.
        specdec.errors.ConfigError: the specdec application's args are invalid, refused here
            before anything is deployed (see app_config).
        RuntimeError: an application failed to deploy (with Serve's message) or was not RUNNING
            within timeout_s seconds; or this process is already connected to another cluster.
    """
    if isinstance(config, ServeConfig):
        if overrides:
            raise ValueError("pass the overrides to ServeConfig.load, not with a ServeConfig")
    else:
        config = ServeConfig.load(config, overrides)
    if not ray.is_initialized():
        prepare_driver()  # a local cluster's auth mode and loopback address
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    elif not _same_cluster(address, connected := ray.get_runtime_context().gcs_address):
        # Deploying through the open connection would deploy to the wrong cluster, and then
        # wait for replicas that cluster may never place.
        raise RuntimeError(
            f"this process is connected to the Ray cluster at {connected}, "
            f"not {address}: call ray.shutdown() first"
        )
    schema = config.schema
    targets = [run_target(app) for app in schema.applications]  # ConfigError before starting
    serve.start(
        proxy_location=schema.proxy_location,
        http_options=schema.http_options.model_dump(),
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        controller_options=controller_options(config),
    )
    serve.run_many(
        targets, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False
    )
    wait_running([app.name for app in schema.applications], timeout_s)


def run_target(app: ServeApplicationSchema) -> serve.RunTarget:
    """A config's application, built in this process (specdec.deployments.app.build_app with
    the config's ``args``, and its ``deployments`` entries as each deployment's options), as
    Serve's RunTarget with the config's name, route prefix and logging config.

    Raises:
        specdec.errors.ConfigError: the application's import_path is not BUILDER, an entry of
            ``deployments`` names no deployment or sets an option Serve's public API has not,
            or its args are invalid (build_app).
    """
    from specdec.deployments.app import build_app  # torch and transformers: only when deploying

    if app.import_path != BUILDER:
        raise ConfigError(
            "import_path",
            f"{app.name}: specdec deploys {BUILDER}, got {app.import_path!r} "
            "(deploy other applications with `serve deploy`)",
        )
    options = {d.name: deployment_options(d, app.runtime_env) for d in app.deployments}
    return serve.RunTarget(
        build_app(app.args, options),
        name=app.name,
        route_prefix=app.route_prefix,
        logging_config=app.logging_config,
    )


# Deployment.options() keyword arguments; a config field outside them cannot be applied.
_OPTION_NAMES = frozenset(
    name for name in inspect.signature(serve.Deployment.options).parameters if name[0] != "_"
) - {"self", "func_or_class", "name", "version"}


def deployment_options(
    deployment: DeploymentSchema, app_runtime_env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A config's ``deployments`` entry as Deployment.options() keyword arguments: the fields
    it sets, with the application's runtime_env under the deployment's own (env_vars merged,
    the deployment's winning), as Serve merges them for a config deployed by import path.

    Raises:
        specdec.errors.ConfigError: a field Deployment.options() does not take.
    """
    options = deployment.model_dump(exclude_unset=True, exclude={"name"})
    for field in options:
        if field not in _OPTION_NAMES:
            raise ConfigError(
                f"deployments.{deployment.name}.{field}",
                "cannot be set through Serve's public API (Deployment.options)",
            )
    if app_runtime_env:
        actor = dict(options.get("ray_actor_options") or {})
        own = actor.get("runtime_env") or {}
        env_vars = {**app_runtime_env.get("env_vars", {}), **own.get("env_vars", {})}
        actor["runtime_env"] = {**app_runtime_env, **own, "env_vars": env_vars}
        options["ray_actor_options"] = actor
    return options


def controller_options(config: ServeConfig) -> dict[str, Any]:
    """The config's ``controller_options`` with the gRPC proxy's message size bound set to the
    specdec application's max_request_bytes (specdec.config.ServiceConfig), so that the gRPC
    proxy refuses a larger request (RESOURCE_EXHAUSTED) before it reaches a router. Serve
    applies it only when it starts its controller (a running Serve keeps its proxies)."""
    schema, app = config.schema, config.app
    options = schema.controller_options.model_dump() if schema.controller_options else {}
    if app is not None:
        runtime_env = options.get("runtime_env") or {}
        env_vars = dict(runtime_env.get("env_vars") or {})
        env_vars[GRPC_MAX_MESSAGE_ENV] = str(app.service.max_request_bytes)
        options["runtime_env"] = {**runtime_env, "env_vars": env_vars}
    return options


def _same_cluster(address: str | None, connected: str) -> bool:
    """Whether ``address`` (as given to ray.init) names the GCS at ``connected`` ("ip:port").
    None, "auto" and Ray Client addresses cannot be compared and count as the same."""
    if address in (None, "auto") or address.startswith("ray://"):
        return True
    host, _, port = address.rpartition(":")
    connected_host, _, connected_port = connected.rpartition(":")
    if port != connected_port:
        return False
    try:
        return socket.gethostbyname(host) == socket.gethostbyname(connected_host)
    except OSError:
        return host == connected_host


def wait_running(names: list[str], timeout_s: float) -> None:
    """Waits until every named application is RUNNING. Raises RuntimeError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {name: apps[name].status if name in apps else "NOT_STARTED" for name in names}
        failed = [name for name, state in states.items() if state == "DEPLOY_FAILED"]
        if failed:
            raise RuntimeError(
                f"application {failed[0]} failed to deploy: {apps[failed[0]].message}"
            )
        if all(state == "RUNNING" for state in states.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"applications not RUNNING after {timeout_s:.0f} s: {states}")
        time.sleep(1.0)
