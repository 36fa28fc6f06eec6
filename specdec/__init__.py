"""specdec: lossless speculative decoding, served on Ray.

The core (this package, minus ``specdec.deployments`` and ``specdec.cluster``) never imports Ray.
"""

from specdec.engine import SpeculativeEngine
from specdec.errors import InvalidRequestError, ModelLoadError
from specdec.round_loop import Completion
from specdec.sampling import SamplingParams
from specdec.stats import SpeculationStats

__all__ = ["Completion", "InvalidRequestError", "ModelLoadError", "SamplingParams",
           "SpeculationStats", "SpeculativeEngine"]
__version__ = "0.1.0"
