"""The Serve application builder: ``import_path: specdec.deployments.app:build_app``.

The model pair and the engine settings come from the application's ``args`` in the Serve config,
never from code; replica resources and autoscaling come from the config's ``deployments``.
"""

from __future__ import annotations

from ray.serve import Application

from specdec.config import SpecdecConfig
from specdec.deployments.draft import DraftModel
from specdec.deployments.router import SpeculativeRouter
from specdec.deployments.target import TargetModel


def build_app(args: dict) -> Application:
    """Builds router -> (draft, target) from the config's args.

    The args are parsed once into a SpecdecConfig (specdec.config: ``draft_model`` and
    ``target_model`` required, every other setting optional), which every deployment receives
    whole.

    Raises:
        specdec.errors.ConfigError: a missing, unknown or invalid setting, named first in the
            message; Serve then reports the application as DEPLOY_FAILED.
    """
    config = SpecdecConfig.from_args(args)
    draft = DraftModel.bind(config)
    target = TargetModel.bind(config)
    return SpeculativeRouter.bind(draft, target, config)
