"""`Decoder`: an unmodified Hugging Face causal LM decoding greedily through padgraph.

    prefill   eager, once per `generate`: the left-padded prompts through the model, the
              registered attention function storing every real token's K/V at its slot
    decode    the padgraph program `hf_decode`: one token per request and call, bucketed by
              requests; the body is the model's own forward with `use_cache=False`

The body derives every piece of attention metadata (slot written, keys read) from the padded
view: a padded lane (input 0, position 0, request row 0) writes the sink slot 0 and reads it only.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

import padgraph as pg

from . import attention
from .attention import Decode, Prefill
from .cache import SINK, PagedCache
from .support import attention_modules, cache_shape, check_supported, device_of

PROGRAM = "hf_decode"


def decode_program(buckets: pg.Buckets) -> pg.Program:
    """One new token per request: its id, its position, its request row in the slot table."""
    bs = pg.Axis("bs")
    return pg.Program(
        PROGRAM,
        inputs={
            "input_ids": pg.Input((bs,), torch.int64, pad=0),
            "positions": pg.Input((bs,), torch.int64, pad=0),            # padded lanes: position 0 ...
            "req_pool_indices": pg.Input((bs,), torch.int64, pad=SINK),  # ... of sink row 0 -> slot 0
        },
        outputs={"next_token": pg.Output((bs,), torch.int64)},
        state={"kv": pg.State(sink=SINK), "req_to_token": pg.State(sink=SINK)},
        buckets=buckets,
    )


@contextlib.contextmanager
def serving(model, experts: str | None = None):
    """The model's attention implementation set to padgraph's (and, given `experts`, its MoE
    experts implementation set to `experts`) for the duration, restored after, also on error:
    the model stays the user's, and HF's own calls run as before."""
    cfg = model.config
    before = cfg._attn_implementation, getattr(cfg, "_experts_implementation", None)
    swap = experts is not None and before[1] is not None and before[1] != experts
    cfg._attn_implementation = attention.NAME
    if swap:
        cfg._experts_implementation = experts
    try:
        yield
    finally:
        cfg._attn_implementation = before[0]
        if swap:
            cfg._experts_implementation = before[1]


def graph_safe_experts(device: torch.device) -> str | None:
    """The MoE experts implementation a CUDA graph can hold, on a GPU. HF's "eager" experts
    pick the experts hit with `nonzero()`, and "grouped_mm" reads its per-expert offsets on the
    host (`offs.tolist()` in transformers' fallback, and inside `torch._grouped_mm` for fp32):
    host syncs that capture refuses. "batched_mm" gathers each (token, expert) pair's weights and
    runs one batched matmul: fixed shapes, no sync, the same arithmetic per pair."""
    if device.type != "cuda":
        return None
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return "batched_mm" if "batched_mm" in ALL_EXPERTS_FUNCTIONS else None


class DecodeBody:
    """The decode program's body: the model's forward over the padded view, greedy next token."""

    def __init__(self, model, kernel=None, regional: bool = False):
        """regional: the model's layers are compiled regions; each attention module then holds
        its layer's cache for the call (`attention.bound`), so one graph serves every layer."""
        self.model, self.kernel = model, kernel
        self.modules = attention_modules(model) if regional else None

    def __call__(self, x):
        batch = Decode(x.kv, x.req_to_token, x.req_pool_indices, x.positions, self.kernel,
                       bound=self.modules is not None)
        with attention.bound(self.modules, x.kv):
            logits = self.model(input_ids=x.input_ids[:, None], position_ids=x.positions[:, None],
                                use_cache=False, padgraph_batch=batch).logits         # [bs, 1, vocab]
        return {"next_token": logits[:, -1].argmax(-1)}                                # [bs]


def compile_spec(torch_compile, model):
    """The Decoder's `torch_compile` as pg.compile's.

    False / None: no compilation (HF's eager forward inside padgraph's graphs).
    True or "layers": regional, size-oblivious (True falls back to "whole", with a warning, for a
        decoder without exactly one ModuleList of layers): the decoder layers compiled as regions that share
        one graph (per distinct layer kind: Gemma's sliding and full layers are two), with the
        decoder's other per-step modules (final norm, rotary embedding); the embedding, lm_head
        and argmax run eagerly inside the captured graph. On the H200 this warmed a Llama-1B
        ladder of 12 buckets in 9.8 s against 29.0 s for "whole", at the same step time within
        3 % (results/bench_hf.md).
    "whole": the whole forward traced once, size-obliviously, for the ladder (bucket 1 compiles
        a graph of its own where an op guards on a batch of one: transformers 5.17's rotary).
    True, "layers" and "whole" run the `group_linears` graph pass: the linears that read one
        input (q / k / v, gate / up) run as one kernel launch at decode batch sizes
        (backends/triton/grouped_linear.py), with the model's weights where they are.
    A dict: pg.compile's `torch_compile` as given."""
    if torch_compile is None or torch_compile is False:
        return None
    from padgraph.backends.triton.grouped_linear import group_linears
    whole = {"size_oblivious": True, "passes": [group_linears]}
    if torch_compile is True or torch_compile == "layers":
        try:
            return {"regions": layer_regions(model), **whole}
        except pg.ContractValueError as e:
            if torch_compile == "layers":
                raise
            warnings.warn(f"padgraph.hf.Decoder: {e}; torch_compile=True compiles the whole forward instead",
                          RuntimeWarning, stacklevel=3)
            return whole
    if torch_compile == "whole":
        return whole
    if isinstance(torch_compile, str):
        raise pg.ContractValueError(f"padgraph.hf.Decoder: torch_compile must be False, True, \"layers\", "
                                    f"\"whole\" or a pg.compile torch_compile dict, got {torch_compile!r}")
    return torch_compile


def layer_regions(model) -> list:
    """The decoder's layers (its ModuleList) and its other children but the embedding: the modules
    a regional compile of an HF decoder covers."""
    decoder = model.get_decoder()
    layers = [c for c in decoder.children() if isinstance(c, torch.nn.ModuleList)]
    if len(layers) != 1:
        raise pg.ContractValueError(f"padgraph.hf.Decoder: torch_compile=\"layers\" needs one ModuleList of "
                                    f"layers in {type(decoder).__name__}, found {len(layers)}")
    rest = [c for c in decoder.children() if not isinstance(c, (torch.nn.ModuleList, torch.nn.Embedding,
                                                                 torch.nn.Dropout))]
    return [*layers[0], *rest]


def triton_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype):
    """padgraph's Triton paged decode attention where it runs (a CUDA device) at the model's
    precision (fp16 / bf16: its fp32 dots would run in TF32), else None (torch's SDPA)."""
    if device.type != "cuda" or backend == "reference" or dtype not in (torch.float16, torch.bfloat16):
        return None
    from padgraph.backends.triton.attention import decode_attention
    return decode_attention


class Decoder:
    """Greedy decoding of a Hugging Face `PreTrainedModel` through padgraph's paged cache and
    decode program, with no change to the model and no HF cache.

    max_batch: requests per `generate`; max_len: prompt (padding included) plus new tokens.
    backend: "cuda" (CUDA graphs) or "reference" (eager, any device); torch_compile: False, True
    (the decoder layers compiled as regions sharing one graph), "whole" (the whole forward) or a
    `pg.compile` torch_compile dict (`compile_spec`); buckets: the decode ladder (default `pg.Buckets.default(max_batch)`);
    options: passed to `pg.compile` (e.g. the cuda backend's `warmup`, `restore_state`).
    draft: `Eagle(...)` decodes speculatively with an EAGLE head (distilled here unless given)
    through padgraph.llm's prefill / draft / verify / draft-extend programs; the tokens stay the
    model's greedy ones. Without it, `generate` is `prefill` (eager) then `step` (one
    decode-program call) per new token.
    Raises `UnsupportedModelError` for a model with a mixer that is not attention (Mamba, ...),
    and with `draft` for attention the paged kernels do not compute (soft-cap, short windows).
    """

    def __init__(self, model, *, max_batch: int, max_len: int, backend: str = "cuda", torch_compile=False,
                 buckets=None, draft=None, **options):
        check_supported(model)
        attention.register()
        self.model, self.max_batch, self.max_len = model, max_batch, max_len
        device = device_of(model)
        self.rows = torch.arange(1, max_batch + 1, device=device)                     # [max_batch] request rows
        self.experts = graph_safe_experts(device)
        self.speculative, self.last_stats = None, None
        if draft is not None:
            from .speculative import Speculative
            engine = {"torch_compile": bool(torch_compile), "compile_options": options,
                      "buckets": pg.Buckets(buckets) if buckets is not None else None}
            self.speculative = Speculative(model, draft, max_batch=max_batch, max_len=max_len,
                                           backend=backend, engine_options=engine)
            return
        self.cache = PagedCache(cache_shape(model), max_batch, max_len, device)
        ladder = pg.Buckets(buckets) if buckets is not None else pg.Buckets.default(max_batch)
        self.program = decode_program(ladder)
        spec = compile_spec(torch_compile, model)
        self.body = DecodeBody(model, triton_decode_kernel(backend, device, self.cache.shape.dtype),
                               regional=bool(spec and spec.get("regions")))
        with self.serving(), torch.no_grad():
            try:
                self.runner = pg.compile(self.program, self.body, backend=backend, state=self.state(),
                                         copy_outputs=True, torch_compile=spec, **options)
            except pg.CaptureError as e:
                if not (torch_compile is True or torch_compile in ("layers", "whole")):
                    raise
                warnings.warn(f"padgraph.hf.Decoder: size-oblivious compilation of {type(model).__name__}'s "
                              f"forward failed ({e}); compiling with torch's dynamic shapes (bucket 1 compiles "
                              f"a graph of its own)", RuntimeWarning, stacklevel=2)
                self.runner = pg.compile(self.program, self.body, backend=backend, state=self.state(),
                                         copy_outputs=True, torch_compile={**spec, "size_oblivious": False},
                                         **options)

    def serving(self):
        return serving(self.model, self.experts)

    def _greedy_only(self, what: str) -> None:
        if self.speculative is not None:
            raise pg.ContractRuntimeError(
                f"padgraph.hf.Decoder.{what}: this Decoder decodes with a draft head (draft=...), through "
                f"padgraph.llm's engine (decoder.speculative.engine); {what} belongs to the greedy decode program")

    def state(self) -> dict:
        return {"kv": self.cache.kv, "req_to_token": self.cache.req_to_token}

    # ---- the two phases ---------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts [n, P] into request rows 1..n: (first new tokens [n], prompt lengths [n])."""
        self._greedy_only("prefill")
        valid = attention_mask.bool()                                                  # [n, P]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)                         # HF's rule for left pads
        rows = self.rows[:input_ids.shape[0], None]                                    # [n, 1]
        slots = torch.where(valid, self.cache.req_to_token[rows, positions].long(), SINK)   # [n, P]
        batch = Prefill(self.cache.kv, slots, positions, valid)
        with self.serving(), torch.no_grad():
            logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1,
                                padgraph_batch=batch).logits                           # [n, 1, vocab]
        return logits[:, -1].argmax(-1), valid.sum(-1)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode call: tokens [n] at positions [n] of requests 1..n -> next tokens [n]."""
        self._greedy_only("step")
        with self.serving(), torch.no_grad():
            return self.runner(input_ids=tokens, positions=positions,
                               req_pool_indices=self.rows[:tokens.shape[0]]).next_token

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 16) -> torch.Tensor:
        """Greedy tokens as `model.generate(input_ids, attention_mask=..., do_sample=False,
        max_new_tokens=...)` returns them: [n, P + new], prompts left-padded."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids, attention_mask = input_ids.to(self.rows.device), attention_mask.to(self.rows.device)
        check_request(self, input_ids, attention_mask, max_new_tokens)
        if self.speculative is not None:
            with torch.no_grad():
                new, self.last_stats = self.speculative.generate(input_ids, attention_mask, max_new_tokens)
            return torch.cat([input_ids, finish_at_eos(self.model, new)], 1)
        token, lens = self.prefill(input_ids, attention_mask)
        new = [token]
        for i in range(max_new_tokens - 1):
            new.append(self.step(new[-1], lens + i))
        return torch.cat([input_ids, finish_at_eos(self.model, torch.stack(new, 1))], 1)

    def check(self, trials: int = 4, seed: int = 0):
        """`pg.check` of the decode body over random valid calls, on copies of the cache: a
        `pg.CheckResult`. With a draft head: of each of the engine's runner programs (verify,
        draft, draft-extend, ...), a dict of program name -> `pg.CheckResult`."""
        if self.speculative is not None:
            from padgraph.llm import checks
            return checks.check(self.speculative.engine, trials=trials, seed=seed)
        state = {"kv": [t.clone() for t in self.cache.kv], "req_to_token": self.cache.req_to_token.clone()}
        with self.serving(), torch.no_grad():
            return pg.check(self.program, self.body, state=state, sample=self.sample, trials=trials, seed=seed)

    def sample(self, gen: torch.Generator) -> dict:
        """Raw decode inputs of a random valid call: distinct request rows, positions in range."""
        n = int(torch.randint(1, self.max_batch + 1, (), generator=gen))
        vocab = self.model.config.get_text_config().vocab_size
        device = self.rows.device
        return {"input_ids": torch.randint(0, vocab, (n,), generator=gen).to(device),
                "positions": torch.randint(0, self.max_len, (n,), generator=gen).to(device),
                "req_pool_indices": (torch.randperm(self.max_batch, generator=gen)[:n] + 1).to(device)}


def check_request(dec: Decoder, input_ids, attention_mask, max_new_tokens: int) -> None:
    """ContractValueError naming what a generate call breaks, before anything is written."""
    def fail(what, expected, got):
        raise pg.ContractValueError(f"padgraph.hf.Decoder.generate: {what} must be {expected}, got {got}")
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        fail("input_ids", "[n, prompt_len] int64", f"{tuple(input_ids.shape)} {input_ids.dtype}")
    n, P = input_ids.shape
    if attention_mask.shape != input_ids.shape:
        fail("attention_mask", f"input_ids' shape {(n, P)}", tuple(attention_mask.shape))
    if not 1 <= n <= dec.max_batch:
        fail("the number of prompts", f"in 1..max_batch={dec.max_batch}", n)
    if max_new_tokens < 1 or P + max_new_tokens > dec.max_len:
        fail("prompt_len + max_new_tokens", f"<= max_len={dec.max_len} (max_new_tokens >= 1)",
             f"{P} + {max_new_tokens}")
    valid = attention_mask.bool()
    if not bool((valid[:, 1:] >= valid[:, :-1]).all()) or not bool(valid[:, -1].all()):
        fail("attention_mask", "left-padded (0s, then 1s to the last column, in every row)", attention_mask.tolist())


def finish_at_eos(model, new: torch.Tensor) -> torch.Tensor:
    """HF's stopping: after a row's end-of-sequence token, pad tokens; output ends at the step by
    which every row has finished. new [n, T] -> [n, T'] (T' <= T)."""
    cfg = model.generation_config
    eos = cfg.eos_token_id
    if eos is None:
        return new
    eos = torch.as_tensor([eos] if isinstance(eos, int) else list(eos), device=new.device)
    is_eos = torch.isin(new, eos)                                                      # [n, T]
    ended = is_eos.long().cumsum(1)                                                    # [n, T]
    new = torch.where(ended - is_eos.long() > 0, cfg.pad_token_id if cfg.pad_token_id is not None else eos[0], new)
    done = (ended > 0).all(0).nonzero()                                                # steps where all rows ended
    return new if done.numel() == 0 else new[:, :int(done[0]) + 1]
