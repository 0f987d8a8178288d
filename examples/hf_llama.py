"""A Hugging Face `LlamaForCausalLM` served through padgraph, with HF's own `StaticCache`.

Batched greedy decode of requests whose prompts have different lengths and that stop at different
times (each request has its own `max_new_tokens`), so the batch shrinks as it runs:

  prefill   eager, once: prompts left-padded to the longest, so every row writes the same cache
            column on every step (StaticCache has one write counter per layer, shared by all rows);
            `seen[row, col]` (a bool [rows, max_cache_len] state) marks the columns a row attends to.
  decode    one padgraph call per step: the padded view holds input_ids and position_ids at the
            bucket; `write_pos` is the shared cache column (the body sets each layer's counter
            from it, so a call depends on its inputs only). The cache is bound as batch-ordered
            state (`pg.State(rows=bs)`): raw lane i owns row i, and the body receives a StaticCache
            whose layer tensors are views of rows [0, bucket), rebuilt by padgraph once per bucket
            with the flatten/unflatten pair below. Padded lanes write only rows [n, bucket).
  shrink    when requests finish, the live rows are compacted into [0, n) by a row gather on every
            cache tensor and on `seen` (in place: the runner's storage never moves), so the next
            call lands in a smaller bucket. Rows past n hold stale data that no raw lane reads.

No weights are downloaded: the model is a random init from a LlamaConfig. On a CPU a tiny fp32
model runs on the reference backend; on a GPU a Llama-3.2-1B-shaped bf16 model runs on CUDA graphs.
The reference is HF's own `generate` (greedy, its StaticCache, eager) on the same left-padded
prompts, each request's tokens cut at its own max_new_tokens. The last line is
`tokens/s=… greedy_match=N/N vs_hf=…` (vs_hf: our tokens/s over generate's, prefill included in
both; generate keeps finished rows in its batch to the end, padgraph drops them). greedy_match
counts the requests whose tokens equal generate's; in bf16 on a GPU it also counts those whose
first divergence is at a near tie of generate's top-2 logits (the EAGLE oracle's rule: compiled
kernels round differently, and a random-init model's top-2 logits are often within an ulp); the
line before it says how many of each. In fp32 on the CPU the match must be exact.

    python examples/hf_llama.py                                   # CPU: tiny, fp32, reference
    python examples/hf_llama.py --device cuda [--torch-compile]   # GPU: 1B shape, bf16, cuda
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.cache_utils import Cache, StaticLayer

import padgraph as pg
from eagle import TIE_TOL, first_divergences, oracle_line   # the EAGLE oracle's bf16 near-tie rule
from request_checks import budget, prompt_ids


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=None, eos_token_id=None, pad_token_id=0)


def llama_1b_config() -> LlamaConfig:
    """Llama-3.2-1B's shapes (plain RoPE at theta 500000; no llama3 frequency scaling)."""
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       bos_token_id=None, eos_token_id=None, pad_token_id=0)


def build_model(cfg: LlamaConfig, device, dtype, seed: int = 0) -> LlamaForCausalLM:
    """Random init, built on `device` in `dtype` (a 1B model initialises in seconds on a GPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()


# ---- StaticCache as state: its leaves are each layer's keys and values --------------------------
def flatten_cache(cache: StaticCache):
    """(leaves [keys0, values0, keys1, ...], context) for pg.State(flatten=)."""
    leaves = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    layers = tuple((type(l), l.max_cache_len, l.cumulative_length) for l in cache.layers)
    return leaves, (type(cache), layers)


def unflatten_cache(leaves, context, own_counters: bool = True) -> StaticCache:
    """A cache of the same class over `leaves` (views of rows [0, bucket)); it carries one
    `LayerCache` per layer for the decoder layers' hooks (see `LayerCache`). As the runner's
    state (own_counters): write counters of its own, which every call sets from its inputs, so
    a call never writes the caller's cache's counters and no input can alias them. The eager
    prefill's view shares the caller's (own_counters=False): they then say where the cache is."""
    cls, layers = context
    cache = cls.__new__(cls)
    Cache.__init__(cache, layers=[_static_layer(c, n, counter.clone() if own_counters else counter, k, v)
                                  for (c, n, counter), k, v in zip(layers, leaves[0::2], leaves[1::2])])
    cache.layer_views = [LayerCache(layer) for layer in cache.layers]
    return cache


class LayerCache(Cache):
    """One layer of a cache, as the Cache its decoder layer is handed: `update` ignores `layer_idx`.

    HF's attention calls `cache.update(k, v, self.layer_idx)`, which indexes `cache.layers`; dynamo
    specialises that int, so a compiled decoder layer would compile one graph per layer. Handed its
    own layer, every layer runs the same code on different tensors, and one graph serves all 16.
    """

    def __init__(self, layer: StaticLayer):
        Cache.__init__(self, layers=[layer])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[0].update(key_states, value_states, *args, **kwargs)


def hand_each_layer_its_cache(model: LlamaForCausalLM) -> None:
    """Forward pre-hooks on the decoder layers: layer i gets `cache.layer_views[i]` in place of a
    cache built by `unflatten_cache` (any other cache passes through). The layers take the cache
    as `past_key_values` (transformers 5.17) or as `cache` (its new name, 5.24). Once per model:
    a second runner over the same model finds the hooks in place."""
    def hook_for(i):
        def hook(module, args, kwargs):
            for name in ("cache", "past_key_values"):
                views = getattr(kwargs.get(name), "layer_views", None)
                if views is not None:
                    kwargs[name] = views[i]
            return args, kwargs
        return hook
    for i, layer in enumerate(model.model.layers):
        if getattr(layer, "_layer_cache_hook", None) is None:
            layer._layer_cache_hook = layer.register_forward_pre_hook(hook_for(i), with_kwargs=True)


def _static_layer(cls, max_cache_len: int, counter, keys, values) -> StaticLayer:
    layer = cls(max_cache_len=max_cache_len)
    layer.keys, layer.values = keys, values                    # [rows, n_kv_heads, max_cache_len, head_dim]
    layer.cumulative_length = counter                          # the write column (this view's own)
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.batch_size, layer.num_heads = keys.shape[:2]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.is_initialized = True
    return layer


def rows_view(cache: StaticCache, n: int) -> StaticCache:
    """The cache over rows [0, n): what the body of a call in bucket n receives."""
    leaves, context = flatten_cache(cache)
    return unflatten_cache([t[:n] for t in leaves], context, own_counters=False)


def new_cache(model: LlamaForCausalLM, max_rows: int, max_cache_len: int) -> tuple[StaticCache, torch.Tensor]:
    """(StaticCache of max_rows rows, seen [max_rows, max_cache_len] bool), allocated up front."""
    cfg, p = model.config, next(model.parameters())
    cache = StaticCache(config=cfg, max_cache_len=max_cache_len)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(max_rows, cfg.num_key_value_heads, head_dim, p.dtype, p.device)
    assert all(type(l) is StaticLayer for l in cache.layers), "this example handles full-attention layers"
    seen = torch.zeros(max_rows, max_cache_len, dtype=torch.bool, device=p.device)
    return cache, seen


# ---- the padgraph program -------------------------------------------------------------------------
def decode_program(ladder) -> pg.Program:
    bs = pg.Axis("bs")
    return pg.Program(
        "hf_llama_decode",
        inputs={
            "input_ids": pg.Input((bs,), torch.int64, pad=0),
            "position_ids": pg.Input((bs,), torch.int64, pad=0),
            "write_pos": pg.Input((1,), torch.int64),           # the cache column every row writes
        },
        outputs={"next_token": pg.Output((bs,), torch.int64)},
        state={"cache": pg.State(rows=bs, flatten=flatten_cache, unflatten=unflatten_cache),
               "seen": pg.State(rows=bs)},
        buckets=pg.Buckets(ladder),
    )


class DecodeStep:
    """The body: one greedy step of the HF model over the bucket's rows of the cache."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        hand_each_layer_its_cache(model)                         # one compiled graph for all layers

    def __call__(self, input_ids, position_ids, write_pos, cache: StaticCache, seen):
        seen.index_fill_(1, write_pos, True)                     # [rows, max_cache_len]: attend to the new column
        counters = [layer.cumulative_length for layer in cache.layers]
        torch._foreach_copy_(counters, [write_pos[0]] * len(counters))   # every row writes column write_pos
                                                                 # (a call depends on its inputs, not on a counter)
        # the mask as HF's SDPA takes it, [rows, 1, 1, max_cache_len] bool: HF uses a 4D mask as it is,
        # so no mask-building kernels run per step (the 2D `seen` would be expanded to this same mask)
        out = self.model(input_ids=input_ids[:, None], position_ids=position_ids[:, None],
                         attention_mask=seen[:, None, None, :], past_key_values=cache, use_cache=True)
        return out.logits[:, -1].argmax(-1)                      # [rows]

    def body(self, x):
        return {"next_token": self(x.input_ids, x.position_ids, x.write_pos, x.cache, x.seen)}


# ---- the serving loop -----------------------------------------------------------------------------
@dataclass
class Batch:
    """The live rows, in cache-row order: row i holds request `req[i]`."""

    req: list[int]               # request id per row
    left: list[int]              # tokens still to generate per row
    next_ids: torch.Tensor       # [n] int64, device: the token each row feeds next
    position_ids: torch.Tensor   # [n] int64, device: that token's position in its request

    def select(self, keep: list[int]) -> "Batch":
        idx = torch.tensor(keep, device=self.next_ids.device)
        return Batch([self.req[i] for i in keep], [self.left[i] for i in keep],
                     self.next_ids[idx], self.position_ids[idx])


def prefill(model, cache: StaticCache, seen: torch.Tensor, prompts: list[list[int]]):
    """Left-padded eager prefill of all prompts into rows [0, n); returns (first tokens [n], width P)."""
    n, width = len(prompts), max(map(len, prompts))
    device = seen.device
    ids = torch.zeros(n, width, dtype=torch.int64)
    seen[:n].zero_()
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p)
        seen[i, width - len(p):width] = True
    mask = seen[:n, :width]                                                # [n, P]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)               # HF's rule for left padding
    view = rows_view(cache, n)
    for layer in view.layers:
        layer.cumulative_length.zero_()                                    # write columns [0, P)
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask, position_ids=position_ids,
                       past_key_values=view, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1].argmax(-1), width


def compact(cache: StaticCache, seen: torch.Tensor, keep: list[int]) -> None:
    """Move rows `keep` to [0, len(keep)) in place on every cache tensor and on seen."""
    idx = torch.tensor(keep, device=seen.device)
    for t in flatten_cache(cache)[0] + [seen]:
        t[:len(keep)] = t.index_select(0, idx)


def check_requests(model, seen: torch.Tensor, prompts: list[list[int]], max_new: list[int]) -> None:
    """Raise before any write unless the requests fit: at most one per cache row, non-empty 1-d
    prompts of integer ids in [0, vocab) and int max_new >= 1 each (request_checks: TypeError
    for a float, bool or string id or budget, else ValueError), and the longest prompt plus the
    largest budget (less the last token, never written) within the cache's columns."""
    rows, cols, vocab = seen.shape[0], seen.shape[1], model.config.vocab_size
    if len(prompts) != len(max_new):
        raise ValueError(f"{len(prompts)} prompts but {len(max_new)} max_new values")
    if not prompts or len(prompts) > rows:
        raise ValueError(f"{len(prompts)} requests for a cache of {rows} rows (1 .. {rows})")
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        prompt_ids(i, p, vocab)            # integer ids in [0, vocab), 1-d, non-empty
        budget(i, n, "max_new")
    need = max(map(len, prompts)) + max(max_new) - 1
    if need > cols:
        raise ValueError(f"the longest prompt ({max(map(len, prompts))}) plus the largest max_new "
                         f"({max(max_new)}) less one needs {need} cache columns; the cache has {cols}")


def check_bound(runner, cache, seen) -> None:
    """ValueError unless `cache` and `seen` hold the tensors the runner was compiled with: the
    prefill writes them and every decode step reads the runner's own (another cache of the same
    shape would give a wrong token from the second one on, silently)."""
    bound = {t.data_ptr() for _, t in runner.state.named()}
    if any(t.data_ptr() not in bound for t in [seen] + list(flatten_cache(cache)[0])):
        raise ValueError("serve: cache and seen must be the ones the runner was built with "
                         "(build_runner(model, cache, seen, ...)); got others")


def serve(model, runner, cache, seen, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Greedy tokens per request: eager prefill, then one runner call per step; the batch shrinks.
    The requests are checked against the cache and the vocabulary before anything is written."""
    check_requests(model, seen, prompts, max_new)
    check_bound(runner, cache, seen)
    first, width = prefill(model, cache, seen, prompts)
    device = seen.device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    batch = Batch(list(range(len(prompts))), [k - 1 for k in max_new], first, lens.clone())
    cols = torch.arange(seen.shape[1], device=device)                      # write_pos values, no H2D per step
    steps = [(batch.req, first)]                                           # (request per row, tokens [n])
    write_pos = width
    while True:
        keep = [i for i, k in enumerate(batch.left) if k > 0]
        if not keep:
            break
        if len(keep) < len(batch.req):
            compact(cache, seen, keep)
            batch = batch.select(keep)
        nxt = runner(input_ids=batch.next_ids, position_ids=batch.position_ids,
                     write_pos=cols[write_pos:write_pos + 1]).next_token
        steps.append((batch.req, nxt))
        batch = Batch(batch.req, [k - 1 for k in batch.left], nxt, batch.position_ids + 1)
        write_pos += 1
    return _gather(steps, len(prompts))


def _gather(steps, n_req: int) -> list[list[int]]:
    out = [[] for _ in range(n_req)]
    for reqs, toks in steps:
        for r, t in zip(reqs, toks.tolist()):
            out[r].append(t)
    return out


def hf_generate(model, prompts: list[list[int]], max_new: list[int], gaps: bool = False):
    """HF's own greedy generate (its StaticCache, eager) on the left-padded batch; request i cut at
    max_new[i]. With gaps=True, returns (tokens, gaps): gaps[i][j] is the top-2 logit gap of HF's
    step j for request i (what the near-tie oracle judges; asking HF for logits slows it, so the
    timed call does not)."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=max(max_new), cache_implementation="static", disable_compile=True,
                         return_dict_in_generate=gaps, output_logits=gaps)
    seqs = out.sequences if gaps else out
    tokens = [row[width:width + k] for row, k in zip(seqs.tolist(), max_new)]
    if not gaps:
        return tokens
    top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values            # [n, steps, 2]
    gap = (top2[..., 0] - top2[..., 1]).tolist()
    return tokens, [g[:k] for g, k in zip(gap, max_new)]


def make_requests(n: int, vocab: int, max_prompt: int, max_new: int, seed: int = 0):
    """n prompts of lengths in [2, max_prompt] and new-token budgets in [min(2, max_new), max_new]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, max_prompt + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lens]
    return prompts, torch.randint(min(2, max_new), max_new + 1, (n,), generator=g).tolist()


def torch_compile_options(model: LlamaForCausalLM, how: str | None):
    """`torch_compile=` for pg.compile: None (HF's eager forward), "regions" (each decoder layer
    compiled; the layers share one graph, since each is handed its own `LayerCache`: the fast
    warm-up) or "whole" (the whole body, one compilation for the ladder)."""
    if how is None:
        return None
    if how == "regions":           # the layers, and the final norm and RoPE tables (a few kernels each eager)
        return {"fullgraph": True, "regions": [*model.model.layers, model.model.norm, model.model.rotary_emb]}
    if how == "whole":
        return {"fullgraph": True}
    raise ValueError(f"torch_compile: None, 'regions' or 'whole'; got {how!r}")


def build_runner(model, cache, seen, ladder, backend: str, **options):
    program = decode_program(ladder)
    step = DecodeStep(model)
    runner = pg.compile(program, step.body, backend=backend, state={"cache": cache, "seen": seen},
                        copy_outputs=True, **options)
    return runner, program, step


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


@dataclass
class Result:
    """One run of the example: our tokens and HF generate's, and the time each took."""

    ours: list[list[int]]
    ref: list[list[int]]
    ours_s: float
    hf_s: float
    stats: pg.Stats              # the runner's: calls per bucket, torch.compile graphs
    gaps: list[list[float]] | None = None   # HF's top-2 logit gap per request and step
    tie_tol: float = 0.0         # 0 in fp32 (exact match); bf16: eagle.TIE_TOL

    def judge(self):
        """(n exact, near ties, other divergences) of our tokens against HF's: the EAGLE oracle
        (`eagle.first_divergences`), HF's top-2 gaps deciding the ties."""
        return first_divergences(self.ref, self.ours, self.gaps, self.tie_tol)

    @property
    def match(self) -> int:
        exact, ties, _ = self.judge()
        return exact + len(ties)

    def line(self) -> str:
        n_tok = sum(map(len, self.ref))
        return (f"tokens/s={n_tok / self.ours_s:.1f} greedy_match={self.match}/{len(self.ref)} "
                f"vs_hf={self.hf_s / self.ours_s:.2f}")


def run(device: torch.device, n_req: int, max_new: int, max_prompt: int, torch_compile=None,
        size_oblivious: bool = False) -> Result:
    """Build the model and the runner, serve the requests twice (the second timed), compare with HF.
    size_oblivious (with torch_compile): trace so that bucket 1 shares the other buckets' graphs."""
    gpu = device.type == "cuda"
    cfg = llama_1b_config() if gpu else tiny_config()
    model = build_model(cfg, device, torch.bfloat16 if gpu else torch.float32)
    prompts, budgets = make_requests(n_req, cfg.vocab_size, max_prompt, max_new)
    ladder = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < n_req] + [n_req]
    cache, seen = new_cache(model, ladder[-1], max(map(len, prompts)) + max(budgets))
    backend = "cuda" if gpu else "reference"
    opts = torch_compile_options(model, torch_compile)
    if opts is not None and size_oblivious:
        opts["size_oblivious"] = True
    (runner, _, _), compile_s = timed(lambda: build_runner(model, cache, seen, ladder, backend,
                                                           torch_compile=opts), device)
    print(f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {next(model.parameters()).dtype} on "
          f"{device}; backend={backend}, ladder {ladder}, compile {compile_s:.1f} s")
    print(f"{n_req} requests: prompt lengths {[len(p) for p in prompts]}, max_new_tokens {budgets}")
    serve(model, runner, cache, seen, prompts, budgets)                    # warm: first-call costs
    ours, ours_s = timed(lambda: serve(model, runner, cache, seen, prompts, budgets), device)
    with torch.no_grad():
        ref_logged, gaps = hf_generate(model, prompts, budgets, gaps=True)           # warm, and the gaps
        ref, hf_s = timed(lambda: hf_generate(model, prompts, budgets), device)
    assert ref == ref_logged, "HF's greedy generate gave different tokens on two identical calls"
    print(runner.stats.table())
    return Result(ours, ref, ours_s, hf_s, runner.stats, gaps, TIE_TOL if gpu else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when there is a GPU")
    ap.add_argument("--requests", type=int, default=None, help="number of requests (cpu 6, cuda 24)")
    ap.add_argument("--max-new", type=int, default=None, help="largest new-token budget (cpu 12, cuda 48)")
    ap.add_argument("--torch-compile", nargs="?", const="regions", default=None, choices=["regions", "whole"],
                    help="compile HF's forward inside padgraph: per decoder layer (default) or whole")
    ap.add_argument("--size-oblivious", action="store_true",
                    help="with --torch-compile: size-oblivious tracing, so bucket 1 shares the graphs "
                         "(H200: 5 graphs in 17.3 s of compiling calls, against 6 in 12.8 s without)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    n_req = (24 if gpu else 6) if args.requests is None else args.requests
    max_new = (48 if gpu else 12) if args.max_new is None else args.max_new
    if n_req < 1 or max_new < 1:
        ap.error(f"--requests and --max-new must be >= 1; got {n_req}, {max_new}")
    res = run(device, n_req, max_new,
              64 if gpu else 12, torch_compile=args.torch_compile, size_oblivious=args.size_oblivious)
    exact, ties, other = res.judge()
    print(oracle_line(exact, ties, other) + f"; tie tolerance {res.tie_tol}")
    for r, i, gap in ties + other:
        a, b = res.ours[r], res.ref[r]
        print(f"request {r}: first differs at token {i} (HF's top-2 gap {gap}): ours {a[i:i + 4]}, hf {b[i:i + 4]}")
    print(f"padgraph: {res.ours_s:.3f} s; HF generate: {res.hf_s:.3f} s; {sum(map(len, res.ref))} tokens")
    print(res.line())


if __name__ == "__main__":
    main()
