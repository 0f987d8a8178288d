"""A Hugging Face causal LM served through padgraph.hf: greedy decoding of left-padded prompts,
checked against the model's own `generate`.

No weights are downloaded: the model is a random init from a config. On a CPU a tiny fp32 model
runs on the reference backend; on a GPU a Llama-3.2-1B-shaped bf16 model on CUDA graphs.

    python examples/hf_generate.py [--model llama|qwen3|gemma3|mistral] [--torch-compile] [--eagle]

--eagle decodes speculatively: an EAGLE head is distilled from the model at `Decoder(...)` and
padgraph.llm's draft / verify programs run over the model's layers; the tokens stay its greedy ones.
(Gemma3's soft-caps and the short windows of this example's Mistral are refused with --eagle.)
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

import padgraph.hf

MODELS = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
          "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig"), "mistral": ("MistralForCausalLM", "MistralConfig")}


def build(name: str, gpu: bool):
    """A random model: Llama-3.2-1B-like on a GPU (bf16), tiny on a CPU (fp32)."""
    model_cls, cfg_cls = (getattr(transformers, n) for n in MODELS[name])
    size = (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64) if gpu else
            dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    cfg = cfg_cls(**size, sliding_window=64, bos_token_id=None, eos_token_id=None, pad_token_id=0)
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
           if args.eagle else f"ladder {list(dec.program.buckets)}")
    print(f"{args.model} on {'cuda' if gpu else 'cpu'}: Decoder ready in {ready:.1f} s ({how}); "
          f"{ids.shape[0]} prompts of lengths {mask.sum(1).tolist()}")
    print(out[:, ids.shape[1]:].tolist())
    print(f"rows equal to model.generate: {same}/{ids.shape[0]}" + (" (bf16 near-ties may differ)" if gpu else ""))


if __name__ == "__main__":
    main()
