"""`Decoder`: an unmodified Hugging Face causal LM decoding through padgraph.llm's engine, greedy
or sampled, with or without an EAGLE draft head.

The model becomes a padgraph.llm target (`Target`: its forwards run HF's model with padgraph's
attention function over the Target's own paged cache) and padgraph.llm's `Engine` serves it
(`engine.Served`): admission into the request-to-token table, the prefill (the prompts
left-padded through the model's forward, eagerly), then rounds of runner programs until every
row has ended:

    decode    without a head: the engine's decode program, one token per request, bucketed by
              requests; its body is the model's forward with `use_cache=False`, then
              `padgraph.llm.sampling.sample` over the logits with each request's parameters
              (temperature 0: exactly the argmax, so greedy tokens are the model's greedy ones)
    EAGLE     with `draft=Eagle()`: draft, verify and draft-extend (`speculative.py`)

A padded lane (input 0, position 0, request row 0, slot 0) writes the sink slot 0 and reads it
only; a hybrid model's recurrent mixers get HF's cache API over their lanes' rows of the
Target's recurrent pools (`recurrent.Step`), so a padded lane reads and writes only the pools'
sink row 0.

`Decoder(...)` refuses what it cannot serve exactly before anything is compiled: a survey of the
model's attention calls, the rule of the mask HF builds for each (read from its mask factory at
any length: windows, Llama 4's chunks; `masks`) and its recurrent states (`support.check_served`,
in `Target`), and a probe that runs a small ragged batch through the Target's prefill and decode
and through the model's own generate and forward (`probe.check_decode`).
"""
from __future__ import annotations

import warnings

import torch

import padgraph as pg

from . import arguments, generation
from .engine import PLAIN, Served
from .errors import UnsupportedModelError
from .probe import check_decode
from .speculative import Eagle, head_for
from .support import decoder_of, device_of, raised_in, serving
from .target import Target


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
    decoder = decoder_of(model)
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
    """Decoding of a Hugging Face `PreTrainedModel` through padgraph.llm's engine, with no change
    to the model and no HF cache: greedy (the model's own greedy tokens) or sampled (HF's
    `generate(do_sample=True)` distribution, each row its own random stream).

    max_batch: requests per `generate` (>= 1); max_len: prompt (padding included) plus new tokens
    (>= 2). backend: "cuda" (CUDA graphs) or "reference" (eager, any device); torch_compile: False, True
    (the decoder layers compiled as regions sharing one graph), "whole" (the whole forward) or a
    `pg.compile` torch_compile dict (`compile_spec`); buckets: the decode ladder (default `pg.Buckets.default(max_batch)`);
    options: passed to `pg.compile` (e.g. the cuda backend's `warmup`, `restore_state`).
    draft: `Eagle(...)` decodes speculatively with an EAGLE head (distilled here unless given)
    through padgraph.llm's prefill / draft / verify / draft-extend programs; greedy tokens stay the
    model's greedy ones, sampled rows keep its sampling distribution exactly (speculative
    sampling). Without it, the engine's decode program runs one token per request a round.
    probe: before compiling, run a small ragged left-padded batch (3 rows, a prefill and 3
    steps) through the Target's prefill and decode and through the model's own generate and
    full-recompute forward, and refuse the model unless the logits agree with both within the
    dtype's tolerance (`probe.py`). `probe=False` skips it (the Target's prefill and 3 decode
    steps of 3 rows, the model's generate of 4 tokens and 4 full forwards): for a model already
    probed at this dtype and device, where that time or memory matters. The survey (attention
    calls, mask rules, recurrent states) runs either way.
    Hybrid models (Mamba / Mamba2 SSMs, short convolutions, gated delta nets beside attention, or
    alone) are served where every recurrent mixer keeps its state through HF's cache API: that
    state lives in pools of one row per request row (`cache.py`), written by the prefill and read
    and rewritten by each decode step; a request's first forward never reads its row.
    Raises `UnsupportedModelError`, naming the layer and the cause, for a model it cannot serve
    exactly: a token mixer that keeps state another way and calls no attention (lightning
    attention, recurrent blocks with state of their own, ...), an attention keyword it does not
    apply, a probe whose logits differ; with `draft`, also any recurrent mixer and attention the
    paged kernels do not compute (soft-cap, short windows, sinks), and layers of several widths.
    Bad arguments raise `ArgumentError` / `ArgumentTypeError` (ContractError family).
    After a `generate`, `last_stats` holds the engine's `RunStats` of it.
    """

    def __init__(self, model, *, max_batch: int, max_len: int, backend: str = "cuda", torch_compile=False,
                 buckets=None, draft=None, probe: bool = True, **options):
        max_batch, max_len = check_options(model, max_batch, max_len, backend, torch_compile, draft, probe)
        self.model, self.max_batch, self.max_len, self.last_stats = model, max_batch, max_len, None
        spec = draft.spec if draft is not None else PLAIN
        compiled = compile_spec(torch_compile, model) if draft is None else None
        if draft is not None and draft.head is not None:
            self.target = draft.head.target
        else:
            kernel = triton_decode_kernel(backend, device_of(model), next(model.parameters()).dtype)
            self.target = Target(model, spec.reservation(max_len, overlap=True), draft=draft is not None, kernel=kernel,
                                 bound=bool(compiled and compiled.get("regions")))
        self.probe_error = self.probe() if probe else None        # largest relative logit error
        head, self.distilled = head_for(self.target, draft) if draft is not None else (None, None)

        def build(compiled) -> Served:
            return Served(self.target, head, spec, max_batch=max_batch, max_len=max_len, backend=backend,
                          options=engine_options(draft, torch_compile, compiled, buckets, options))

        self.served = build(compiled) if draft is not None else self.warmed(build, compiled, torch_compile)

    def warmed(self, build, compiled, torch_compile) -> Served:
        """`build(compiled)` with its decode runner compiled (on "cuda": its graphs captured for the
        ladder); a size-oblivious trace that fails falls back to torch's dynamic shapes, with a
        warning."""
        with self.serving(), torch.no_grad():
            served = build(compiled)
            try:
                served.worker.runner("decode")
                return served
            except pg.CaptureError as e:
                if not (torch_compile is True or torch_compile in ("layers", "whole")):
                    raise
                warnings.warn(f"padgraph.hf.Decoder: size-oblivious compilation of {type(self.model).__name__}'s "
                              f"forward failed ({e}); compiling with torch's dynamic shapes (bucket 1 compiles "
                              f"a graph of its own)", RuntimeWarning, stacklevel=3)
            served = build({**compiled, "size_oblivious": False})
            served.worker.runner("decode")
            return served

    @property
    def engine(self):
        """padgraph.llm's `Engine` serving this Decoder."""
        return self.served.engine

    @property
    def worker(self):
        """The engine's worker: its runner programs (`runner("decode")`), bodies and caches (`kv`)."""
        return self.served.worker

    def probe(self) -> float:
        """`probe.check_decode` over this Decoder's Target (its prefill, attention kernel and
        decode forward): the largest relative logit error it saw, or UnsupportedModelError."""
        try:
            return check_decode(self.model, self.target, self.max_len)
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            if isinstance(e, pg.ContractError):
                raise
            raise UnsupportedModelError(
                f"padgraph.hf.Decoder({type(self.model).__name__}): the probe batch (a ragged left-padded prefill "
                f"and decode steps) fails through padgraph's path ({type(e).__name__}: {e}, {raised_in(e)})") from e

    def serving(self):
        """The model's attention (and, on a GPU, MoE experts) set to padgraph's for the duration."""
        return serving(self.model, self.target.experts, self.target.horizons)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, *, generation_config=None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, eos_token_id=None, pad_token_id: int | None = None,
                 seed: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Tokens as `model.generate(input_ids, attention_mask=..., ...)` decodes them: [n, P + new],
        prompts left-padded. Greedy tokens are the model's own; sampled ones follow HF's distribution.
        input_ids: a [n, P] int64 tensor of ids in [0, vocab_size); attention_mask: 0s and 1s of its
        shape, left-padded, or None: as HF infers it (`input_ids != pad` where the pad token occurs
        in input_ids and is no end token, else all ones). The keywords are HF's and resolve as HF resolves them
        (given, then `generation_config`, then `model.generation_config`, then HF's defaults):
        do_sample, temperature, top_k, top_p, min_p (HF's processor order), max_new_tokens (else
        max_length - P), eos_token_id / pad_token_id (a row ends at an end token; pads follow it).
        A field whose HF processor padgraph does not apply (beams, repetition penalty, ...) is
        refused. seed (an int) or generator (a torch.Generator): where the rows' random streams
        come from (neither: torch's global generator); the same seed gives the same tokens."""
        check_request(self, input_ids, attention_mask, max_new_tokens)
        generation.check_stream(seed, generator)
        plan = generation.resolve(self.model, input_ids.shape[1], generation_config, do_sample=do_sample,
                                  temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                  pad_token_id=pad_token_id)
        if attention_mask is None:
            attention_mask = generation.inferred_mask(input_ids, plan)
        check_prompts(self, "padgraph.hf.Decoder.generate", input_ids, attention_mask, plan.max_new_tokens)
        n = input_ids.shape[0]
        seeds = (generation.row_seeds(n, seed, generator, "cpu") if not plan.params.greedy
                 else torch.zeros(n, dtype=torch.int64))
        with self.serving(), torch.no_grad():
            new, self.last_stats = self.served.generate(input_ids, attention_mask, plan, seeds.tolist())
        return torch.cat([input_ids, generation.finish_at_end(new, plan.eos, plan.pad)], 1)

    def check(self, trials: int = 4, seed: int = 0) -> dict:
        """`pg.check` of each of the engine's runner programs with a body (decode; with a draft
        head also verify, draft, draft-extend) over random valid calls a scheduler could make
        (`padgraph.llm.checks`): program name -> `pg.CheckResult`."""
        trials = arguments.integer("padgraph.hf.Decoder.check", "trials", trials, 1)
        seed = arguments.integer("padgraph.hf.Decoder.check", "seed", seed, 0)
        from padgraph.llm import checks
        with self.serving(), torch.no_grad():
            return checks.check(self.worker, names=list(self.worker.bodies), trials=trials, seed=seed)


def engine_options(draft, torch_compile, compiled, buckets, options: dict) -> dict:
    """The `WorkerOptions` fields of a Decoder's engine: the decode ladder, and how its runners
    compile. Without a draft head, `compiled` (`compile_spec`, or None) is the decode runner's
    pg.compile torch_compile; with one, the worker's own regional compile of the target's and the
    head's layers where `torch_compile` is set. options: pg.compile's other options."""
    ladder = pg.Buckets(buckets) if buckets is not None else None
    if draft is not None:
        return {"buckets": ladder, "torch_compile": bool(torch_compile), "compile_options": options}
    return {"buckets": ladder, "torch_compile": compiled is not None,
            "compile_options": {**options, **({"torch_compile": compiled} if compiled else {})}}


WHERE = "padgraph.hf.Decoder"


def check_options(model, max_batch, max_len, backend, torch_compile, draft, probe) -> tuple[int, int]:
    """The Decoder's arguments checked (ArgumentError / ArgumentTypeError): (max_batch, max_len)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config") or not hasattr(model, "generation_config"):
        arguments.fail(WHERE, "model", type(model).__name__, "a Hugging Face PreTrainedModel (a causal LM)",
                       arguments.ArgumentTypeError)
    max_batch = arguments.integer(WHERE, "max_batch", max_batch, 1)
    max_len = arguments.integer(WHERE, "max_len", max_len, 2)     # a prompt token and a new one
    if not isinstance(backend, str):
        arguments.fail(WHERE, "backend", backend, "a backend name (\"cuda\", \"reference\")", arguments.ArgumentTypeError)
    if not (torch_compile is None or isinstance(torch_compile, (bool, str, dict))):
        arguments.fail(WHERE, "torch_compile", torch_compile, "False, True, \"layers\", \"whole\" or a dict",
                       arguments.ArgumentTypeError)
    if draft is not None and not isinstance(draft, Eagle):
        arguments.fail(WHERE, "draft", draft, "None or padgraph.hf.Eagle(...)", arguments.ArgumentTypeError)
    arguments.flag(WHERE, "probe", probe)
    return max_batch, max_len


def check_request(dec: Decoder, input_ids, attention_mask, max_new_tokens) -> None:
    """ArgumentError / ArgumentTypeError naming what a generate call breaks, before anything runs
    (the new tokens' fit is checked once the call's generation config is resolved)."""
    where = "padgraph.hf.Decoder.generate"
    if not isinstance(input_ids, torch.Tensor):
        arguments.fail(where, "input_ids", input_ids, "a torch.Tensor [n, prompt_len] of int64 token ids",
                       arguments.ArgumentTypeError)
    if max_new_tokens is not None:
        max_new_tokens = arguments.integer(where, "max_new_tokens", max_new_tokens, 1)
    check_prompts(dec, where, input_ids, attention_mask, max_new_tokens or 0)


def check_prompts(dec: Decoder, where: str, input_ids, attention_mask, max_new_tokens: int) -> None:
    """Left-padded prompts that fit: n <= max_batch, prompt_len + max_new_tokens <= max_len."""
    def fail(what, expected, got):
        arguments.fail(where, what, got, expected)
    arguments.token_ids(where, "input_ids", input_ids, dec.model.config.get_text_config().vocab_size)
    n, P = input_ids.shape
    if attention_mask is not None:
        arguments.mask_of(where, "attention_mask", attention_mask, (n, P))
    if not 1 <= n <= dec.max_batch:
        fail("the number of prompts", f"in 1..max_batch={dec.max_batch}", n)
    if P + max_new_tokens > dec.max_len:
        fail("prompt_len + max_new_tokens", f"<= max_len={dec.max_len}", f"{P} + {max_new_tokens}")
    if attention_mask is None:
        return
    valid = attention_mask.bool()
    if not bool((valid[:, 1:] >= valid[:, :-1]).all()) or not bool(valid[:, -1].all()):
        fail("attention_mask", "left-padded (0s, then 1s to the last column, in every row)", attention_mask.tolist())
