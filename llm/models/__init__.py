"""Reference models over paged caches: a Llama-like target (K/V cache), a DeepSeek-like target
(MLA latent cache, MoE), a hybrid target (attention and Mamba2 layers, recurrent state in slot
pools), a tensor-parallel Llama rank, and their draft heads (`DraftHead`: EagleHead, MTPHead)."""
from .deepseek import DeepSeekConfig, DeepSeekModel, LatentCache
from .draft_head import DraftHead
from .eagle_head import EagleHead
from .hybrid import HybridCache, HybridConfig, HybridModel
from .llama import LlamaConfig, LlamaModel
from .mtp_head import MTPHead

__all__ = ["DeepSeekConfig", "DeepSeekModel", "DraftHead", "EagleHead", "HybridCache", "HybridConfig",
           "HybridModel", "LatentCache", "LlamaConfig", "LlamaModel", "MTPHead"]
