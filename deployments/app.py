"""The Serve application builder: ``import_path: specdec.deployments.app:build_app``.

The model pair and the engine settings come from the application's ``args`` in the Serve config,
never from code; replica resources and autoscaling come from the config's ``deployments``.
"""

from __future__ import annotations

import dataclasses
import os

from ray.serve import Application

from specdec.session_model import DEFAULT_CACHE_CAPACITY_BYTES
from specdec.deployments.draft import DraftModel
from specdec.deployments.router import RouterOptions, SpeculativeRouter
from specdec.deployments.target import TargetModel


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """How the draft and target deployments load their models."""

    dtype: str = "float32"
    device: str = "cpu"
    cache_capacity_bytes: int = DEFAULT_CACHE_CAPACITY_BYTES


def build_app(args: dict) -> Application:
    """Builds router -> (draft, target) from the config's args.

    Required args: ``draft_model``, ``target_model`` (directories, cached ids or .gguf paths;
    ``~`` and environment variables are expanded). Optional: ModelArgs fields (dtype, device,
    cache_capacity_bytes) and RouterOptions fields (max_speculative_tokens, draft_top_n,
    call_timeout_s, unavailable_after_s, draft_pool, target_pool).

    Raises:
        ValueError: a missing model or an unknown argument.
    """
    args = dict(args)
    for key in ("draft_model", "target_model"):
        if not args.get(key):
            raise ValueError(f"application args must set {key}")
        args[key] = os.path.expandvars(os.path.expanduser(str(args[key])))
    model_fields = {f.name for f in dataclasses.fields(ModelArgs)}
    router_fields = {f.name for f in dataclasses.fields(RouterOptions)}
    unknown = set(args) - model_fields - router_fields
    if unknown:
        raise ValueError(f"unknown application args: {sorted(unknown)}")
    model_args = dataclasses.asdict(ModelArgs(**{k: v for k, v in args.items() if k in model_fields}))
    router_args = {k: v for k, v in args.items() if k in router_fields}
    draft = DraftModel.bind(args["draft_model"], **model_args)
    target = TargetModel.bind(args["target_model"], **model_args)
    return SpeculativeRouter.bind(draft, target, **router_args)
