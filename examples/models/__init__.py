"""Example models for padgraph over paged caches: a Llama-like target (K/V cache), a DeepSeek-like
target (MLA latent cache, MoE), and their draft heads (`DraftHead`: EagleHead, MTPHead)."""
