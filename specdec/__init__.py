"""specdec: lossless speculative decoding, served on Ray.

The core (this package, minus ``specdec.deployments`` and ``specdec.cluster``) never imports Ray.
The public names below are imported lazily, so that light users (the gRPC client, the CLI) do not
pay for importing torch and transformers.
"""

import importlib

_EXPORTS = {
    "Completion": "specdec.decoding.round_loop",
    "ConfigError": "specdec.errors",
    "InvalidRequestError": "specdec.errors",
    "ModelLoadError": "specdec.errors",
    "SamplingParams": "specdec.decoding.sampling",
    "SpecdecConfig": "specdec.config",
    "SpeculationConfig": "specdec.config",
    "SpeculationStats": "specdec.decoding.stats",
    "SpeculativeEngine": "specdec.engine",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
