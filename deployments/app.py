"""The Serve application builder: ``import_path: specdec.deployments.app:build_app``.

The model pair and the engine settings come from the application's ``args`` in the Serve config,
never from code; replica resources and autoscaling come from the config's ``deployments``
(applied by Serve on KubeRay; by build_app's ``deployment_options`` when `specdec serve` deploys
through Serve's public API, specdec.deployments.deploy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import Application, Deployment

from specdec.config import SpecdecConfig
from specdec.deployments.draft import DraftModel
from specdec.deployments.router import SpeculativeRouter
from specdec.deployments.target import TargetModel
from specdec.errors import ConfigError

DEPLOYMENTS: tuple[Deployment, ...] = (DraftModel, TargetModel, SpeculativeRouter)


def build_app(
    args: dict, deployment_options: Mapping[str, Mapping[str, Any]] | None = None
) -> Application:
    """Builds router -> (draft, target) from the config's args.

    The args are parsed once into a SpecdecConfig (specdec.config: ``draft_model`` and
    ``target_model`` required, every other setting optional), which every deployment receives
    whole. ``deployment_options`` ({deployment name: Deployment.options() keyword arguments},
    e.g. the config's ``autoscaling_config``) replace the named deployments' options from code,
    as a Serve config's ``deployments`` entries do.

    Raises:
        specdec.errors.ConfigError: a missing, unknown or invalid setting, or options for a
            deployment that does not exist, named first in the message; Serve then reports the
            application as DEPLOY_FAILED.
    """
    config = SpecdecConfig.from_args(args)
    options = dict(deployment_options or {})
    names = [deployment.name for deployment in DEPLOYMENTS]
    for name in options:
        if name not in names:
            raise ConfigError("deployments", f"no deployment named {name!r}; there are {names}")

    def configured(deployment: Deployment) -> Deployment:
        return deployment.options(**options.get(deployment.name, {}))

    draft = configured(DraftModel).bind(config)
    target = configured(TargetModel).bind(config)
    return configured(SpeculativeRouter).bind(draft, target, config)
