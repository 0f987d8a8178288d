"""padgraph.hf: any Hugging Face causal LM served through padgraph with no glue.

    import padgraph.hf
    dec = padgraph.hf.Decoder(model, max_batch=16, max_len=512)      # backend="cuda" by default
    out = dec.generate(input_ids, attention_mask, max_new_tokens=32)  # as model.generate(do_sample=False)
    eagle = padgraph.hf.Decoder(model, max_batch=16, max_len=512, draft=padgraph.hf.Eagle())  # EAGLE

The Decoder registers an attention function with transformers' `AttentionInterface` (as vLLM's
and SGLang's transformers backends do), runs the model with `use_cache=False`, and owns the paged
KV cache and the decode program; transformers is an optional extra (`pip install padgraph[hf]`).
"""
from .decoder import Decoder, decode_program
from .errors import NotBoundError, UnsupportedModelError
from .speculative import Eagle
from .target import Target

__all__ = ["Decoder", "Eagle", "Target", "decode_program", "NotBoundError", "UnsupportedModelError"]
