"""minispec: a from-scratch Llama-family transformer with a paged KV cache and exact speculative decoding."""

from .cache import BlockAllocator, CacheExhausted, PagedKVCache
from .checkpoint import CheckpointError
from .config import ModelConfig
from .model import Transformer
from .sampling import SamplingParams
from .speculative import PromptLookupDrafter, SpeculativeResult, SpeculativeStats

__all__ = ["BlockAllocator", "CacheExhausted", "CheckpointError", "ModelConfig", "PagedKVCache",
           "PromptLookupDrafter", "SamplingParams", "SpeculativeResult", "SpeculativeStats", "Transformer"]
__version__ = "0.1.0"
