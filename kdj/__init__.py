"""kdj: speculative decoding (DFlash, DDTree) for MoE and dense LLMs in JAX + Flax."""

from kdj.api import forward, generate
from kdj.config import ModelConfig
from kdj.handles import Drafter, Target
from kdj.loading import load_drafter, load_target
from kdj.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "Drafter",
    "ModelConfig",
    "Target",
    "Tokenizer",
    "forward",
    "generate",
    "load_drafter",
    "load_target",
    "load_tokenizer",
]
