"""The Serve application builder: ``import_path: specdec.deployments.app:build_app``.

The model pair and the engine settings come from the application's ``args`` in the Serve config,
never from code; replica resources and autoscaling come from the config's ``deployments``.
"""

from __future__ import annotations

import dataclasses
import os

from ray.serve import Application

from specdec.deployments.draft import DraftModel
from specdec.deployments.router import RouterOptions, SpeculativeRouter
from specdec.deployments.target import TargetModel
from specdec.engine import DEFAULT_MAX_SPECULATIVE_TOKENS
from specdec.models.session import DEFAULT_CACHE_CAPACITY_BYTES


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """How the draft and target deployments load their models.

    ``draft_dtype`` (default: ``dtype``) lets the draft run cheaper, e.g. "int8" on a CPU: the
    draft only steers proposals, so it changes speed, never the output.
    """

    dtype: str = "float32"
    draft_dtype: str | None = None
    device: str = "cpu"
    cache_capacity_bytes: int = DEFAULT_CACHE_CAPACITY_BYTES
    fixed_shape_verify: bool | None = None  # None: on in half precision (TargetVerifier)

    def for_side(self, side: str, max_speculative_tokens: int) -> dict:
        """Constructor arguments of the "draft" or "target" replica."""
        if side == "draft":
            return {
                "dtype": self.draft_dtype or self.dtype,
                "device": self.device,
                "cache_capacity_bytes": self.cache_capacity_bytes,
            }
        return {
            "dtype": self.dtype,
            "device": self.device,
            "cache_capacity_bytes": self.cache_capacity_bytes,
            "fixed_shape_verify": self.fixed_shape_verify,
            "max_speculative_tokens": max_speculative_tokens,
        }


def build_app(args: dict) -> Application:
    """Builds router -> (draft, target) from the config's args.

    Required args: ``draft_model``, ``target_model`` (directories, cached ids or .gguf paths;
    ``~`` and environment variables are expanded). Optional: ModelArgs fields (dtype, device,
    cache_capacity_bytes) and RouterOptions fields (max_speculative_tokens, draft_top_n,
    concurrent_prefill, dynamic_draft_length, call_timeout_s, unavailable_after_s, draft_pool,
    target_pool).

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
    model_args = ModelArgs(**{k: v for k, v in args.items() if k in model_fields})
    router_args = {k: v for k, v in args.items() if k in router_fields}
    k_max = router_args.get("max_speculative_tokens", DEFAULT_MAX_SPECULATIVE_TOKENS)
    draft = DraftModel.bind(args["draft_model"], **model_args.for_side("draft", k_max))
    target = TargetModel.bind(args["target_model"], **model_args.for_side("target", k_max))
    return SpeculativeRouter.bind(draft, target, **router_args)
