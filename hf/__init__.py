"""padgraph.hf: any Hugging Face causal LM served through padgraph with no glue.

    import padgraph.hf
    dec = padgraph.hf.Decoder(model, max_batch=16, max_len=512)      # backend="cuda" by default
    out = dec.generate(input_ids, attention_mask, max_new_tokens=32)  # as model.generate(...)
    out = dec.generate(input_ids, attention_mask, max_new_tokens=32, do_sample=True, temperature=0.7,
                       top_p=0.9, seed=0)                                # HF's sampling distribution
    eagle = padgraph.hf.Decoder(model, max_batch=16, max_len=512, draft=padgraph.hf.Eagle())  # EAGLE

The Decoder registers an attention function with transformers' `AttentionInterface` (as vLLM's
and SGLang's transformers backends do), runs the model with `use_cache=False` as a padgraph.llm
target (`Target`: the model's forwards over its own paged cache) and serves it with padgraph.llm's
engine, with or without a draft head: one admission, one sampler, one set of stop tokens;
transformers is an optional extra (`pip install padgraph[hf]`).

`generate` takes HF's generation keywords and `GenerationConfig` (the model's own generation
config is the default, as in HF): greedy or sampled (temperature, top-k, top-p, min-p in HF's
order, inside the engine's decode graph), end tokens finishing rows. A processor padgraph does
not apply (beams, repetition penalty, ...) is refused, never approximated.

A model is served with `model.generate`'s greedy tokens or refused at `Decoder(...)`, never served with
others: the Decoder surveys the model's attention calls (their key and value widths, sink logits,
several calls a layer) and the states its recurrent mixers keep through HF's cache (a hybrid's
SSM, convolution and delta-net states, held in a pool of one row per request), refuses a token
mixer that keeps state any other way without calling attention, reads each layer's mask rule
(sliding window, chunks) from the mask factory HF calls for it, and probes a small left-padded
batch through its Target against the model's own generate and forward, naming the first layer
that differs
(docs/hf_models.md lists what each architecture gets). Arguments
are checked: `ArgumentError` / `ArgumentTypeError` name the argument, the value and what is allowed.
"""
from .decoder import Decoder
from .errors import ArgumentError, ArgumentTypeError, NotBoundError, UnsupportedModelError
from .speculative import Eagle
from .target import Target

__all__ = ["Decoder", "Eagle", "Target", "ArgumentError", "ArgumentTypeError", "NotBoundError",
           "UnsupportedModelError"]
