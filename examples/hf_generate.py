"""A Hugging Face causal LM served through padgraph.hf: greedy decoding of left-padded prompts,
checked against the model's own `generate`, then sampling with HF's keywords (temperature, top-p)
inside the decode graph, reproducible from a seed.

No weights are downloaded: the model is a random init from a config. On a CPU a tiny fp32 model
runs on the reference backend; on a GPU a Llama-3.2-1B-shaped bf16 model on CUDA graphs.
Mistral's and Gemma 3's sliding windows (16 tokens) are shorter than the longer prompts plus new
tokens, so their layers attend within the window as HF's do. `Decoder(...)` first probes the model
(a small batch decoded both ways) and refuses one it would not decode exactly.

    python examples/hf_generate.py [--model llama|qwen3|gemma3|mistral] [--torch-compile] [--eagle]
                                   [--temperature 0.8] [--top-p 0.9]

Either way the Decoder serves the model through padgraph.llm's engine (its admission, sampler and
stop tokens). --eagle decodes speculatively: an EAGLE head is distilled from the model at
`Decoder(...)` and padgraph.llm's draft / verify programs run over the model's layers; the greedy
tokens stay its greedy ones and sampled ones follow its sampling distribution (speculative sampling).
(Gemma3's soft-caps and the short windows of this example's Mistral are refused with --eagle:
padgraph.llm's paged kernels attend to every key of a request.)
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

import padgraph.hf

MODELS = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
          "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"), "mistral": ("MistralForCausalLM", "MistralConfig")}


WINDOW = 16     # shorter than the longer prompts (8 .. 33 tokens) plus --new tokens


def build(name: str, gpu: bool):
    """A random model: Llama-3.2-1B-like on a GPU (bf16), tiny on a CPU (fp32)."""
    model_cls, cfg_cls = (getattr(transformers, n) for n in MODELS[name])
    size = (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64) if gpu else
            dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    window = dict(sliding_window=WINDOW) if name in ("mistral", "gemma3") else {}   # the others have none
    cfg = cfg_cls(**size, **window, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):
        return model_cls._from_config(cfg, dtype=torch.bfloat16 if gpu else torch.float32).eval()


def left_padded(n: int, vocab: int, device):
    """n random prompts of different lengths, left-padded: (input_ids [n, P], attention_mask [n, P])."""
    lens = [8 + 5 * i for i in range(n)]
    ids = torch.zeros(n, max(lens), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(lens):
        ids[i, -k:], mask[i, -k:] = torch.randint(1, vocab, (k,)), 1
    return ids.to(device), mask.to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=list(MODELS))
    ap.add_argument("--torch-compile", action="store_true")
    ap.add_argument("--eagle", action="store_true", help="EAGLE speculative decoding")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8, help="the sampled run's temperature")
    ap.add_argument("--top-p", type=float, default=0.9, help="the sampled run's top-p")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    model = build(args.model, gpu)
    ids, mask = left_padded(6, model.config.vocab_size, "cuda" if gpu else "cpu")

    # serving the model: these lines are all the glue there is
    t0 = time.perf_counter()
    draft = None
    if args.eagle:   # a few hundred training steps on the model's greedy outputs (CPU: a short run)
        draft = padgraph.hf.Eagle(distill={} if gpu else dict(n_seq=16, prompt_len=8, gen_len=16, steps=30))
    dec = padgraph.hf.Decoder(model, max_batch=8, max_len=128, backend="cuda" if gpu else "reference",
                              torch_compile=args.torch_compile, draft=draft)
    ready = time.perf_counter() - t0
    out = dec.generate(ids, attention_mask=mask, max_new_tokens=args.new)

    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=args.new)
    same = int((out == ref).all(1).sum())
    how = (f"EAGLE, {dec.last_stats.accepted / dec.last_stats.request_rounds:.2f} tokens per request-round"
           if args.eagle else f"decode ladder {list(dec.worker.programs['decode'].buckets)}")
    print(f"{args.model} on {'cuda' if gpu else 'cpu'}: Decoder ready in {ready:.1f} s ({how}); "
          f"{ids.shape[0]} prompts of lengths {mask.sum(1).tolist()}"
          + (f", sliding window {WINDOW}" if args.model in ("mistral", "gemma3") else ""))
    print(out[:, ids.shape[1]:].tolist())
    print(f"rows equal to model.generate: {same}/{ids.shape[0]}" + (" (bf16 near-ties may differ)" if gpu else ""))

    # sampling: HF's keywords, HF's distribution; a seed gives the same tokens again
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.new)
    out = dec.generate(ids, attention_mask=mask, seed=0, **sampling)
    again = dec.generate(ids, attention_mask=mask, seed=0, **sampling)
    print(f"sampled (temperature {args.temperature}, top-p {args.top_p}, seed 0): "
          f"{out[:2, ids.shape[1]:].tolist()} ...; the same seed again gives the same tokens: "
          f"{torch.equal(out, again)}")


if __name__ == "__main__":
    main()
