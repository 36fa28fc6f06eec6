"""Deploying a Serve config file to a running Ray cluster from Python.

This is what ``serve run CONFIG`` does, without blocking and without the dashboard's REST API
(``serve deploy`` needs it; tests and the local cluster run without a dashboard).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from ray.serve._private import api as serve_api
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema

from specdec.cluster.processes import prepare_driver
from specdec.config import APPLICATION, SIDES, ModelConfig, SpecdecConfig

# Ray Serve reads the gRPC proxy's max receive (and send) message size from this variable of
# the proxy's environment; proxies inherit the Serve controller's runtime_env.
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ServeDeploySchema:
    """Parses and validates a Serve config; ``overrides`` update the specdec app's args.

    A ``dtype`` or ``gemm`` override is the target's: where neither the overrides nor the config
    set ``draft_dtype`` (``draft_gemm``), the draft keeps the dtype and GEMM the config gives it:
    ``--dtype bfloat16`` on the shipped ``dtype: auto`` leaves the draft measuring its own (int8
    on a CPU) instead of following the target into bfloat16.

    Raises:
        FileNotFoundError, pydantic.ValidationError (with the offending field).
    """
    raw = yaml.safe_load(Path(path).read_text())
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


def bundled_models(config: ServeConfig) -> dict[str, str]:
    """The converted directories of the config's ``bundled:`` models, as settings
    ({"draft_model": dir, ...}), converted in the dtype that side's replicas load
    (specdec.config.ModelConfig.for_side).

    Converting the bundled pair takes minutes the first time; doing it here, in the process
    that deploys (with progress bars), keeps replicas from converting concurrently in their
    constructors. Only for clusters on this machine: the directories are local paths.

    Raises:
        specdec.errors.ModelLoadError: the pair is not installed or fails its checksum.
    """
    from specdec.models import bundled

    if config.app is None:
        return {}
    converted = {}
    for side in SIDES:
        spec, dtype = config.app.models.for_side(side)
        if spec.startswith(bundled.SPEC_PREFIX):
            converted[f"{side}_model"] = bundled.resolve(spec, dtype)
    return converted


def resolve_bundled(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``overrides`` plus the converted directories of any ``bundled:`` model in the config
    (bundled_models), for callers that deploy by path.

    Raises:
        specdec.errors.ConfigError: the application's args are invalid (see app_config);
        specdec.errors.ModelLoadError: the pair is not installed or fails its checksum.
    """
    overrides = dict(overrides or {})
    return {**overrides, **bundled_models(ServeConfig.load(path, overrides))}


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
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        proxy_location=schema.proxy_location,
        controller_options=controller_options(config),
    )
    client.deploy_apps(schema, _blocking=False)
    wait_running([app.name for app in schema.applications], timeout_s)


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
