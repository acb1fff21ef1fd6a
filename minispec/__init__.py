"""minispec: a from-scratch Llama-family transformer with a paged KV cache and exact speculative decoding."""

from . import controls  # noqa: F401  (registers the negative-control samplers by name)
from .adaptive import AdaptiveK
from .cache import BlockAllocator, CacheExhausted, PagedKVCache
from .checkpoint import CheckpointError
from .config import ModelConfig
from .draft_loader import load_draft
from .drafters import Drafter, PromptLookupDrafter
from .feature_draft import FeatureDrafter
from .model import Transformer
from .sampling import SamplingParams
from .speculative import SpeculativeResult, SpeculativeStats
from .tree import DynamicTree

__all__ = ["AdaptiveK", "BlockAllocator", "CacheExhausted", "CheckpointError", "Drafter", "DynamicTree",
           "FeatureDrafter", "ModelConfig", "PagedKVCache", "PromptLookupDrafter", "SamplingParams",
           "SpeculativeResult", "SpeculativeStats", "Transformer", "load_draft"]
__version__ = "0.1.0"
