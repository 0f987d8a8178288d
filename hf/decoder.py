"""`Decoder`: an unmodified Hugging Face causal LM decoding through padgraph, greedy or sampled.

    prefill   eager, once per `generate`: the left-padded prompts through the model, the
              registered attention function storing every real token's K/V at its slot; a
              hybrid model's mixers start from no state and leave theirs in rows 1..n of the
              recurrent pool
    decode    the padgraph program `hf_decode`: one token per request and call, bucketed by
              requests; the body is the model's own forward with `use_cache=False`, then
              `padgraph.llm.sampling.sample` over the logits with each request's parameters
              (temperature 0: exactly the argmax, so greedy tokens are the model's greedy ones)

The body derives every piece of attention metadata (slot written, keys read) from the padded
view: a padded lane (input 0, position 0, request row 0) writes the sink slot 0 and reads it only.
A hybrid model's recurrent mixers get HF's cache API over their lanes' rows of the recurrent pool
(`recurrent.Step`: gathered by request row before the forward, written back after), so a padded
lane reads and writes only the pool's sink row 0.

`Decoder(...)` refuses what it cannot serve exactly before anything is compiled: a survey of the
model's attention calls and recurrent states (`support.check_served`) and a probe that decodes a
small ragged batch through this path and through the model's own forward (`probe.check_decode`).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

import padgraph as pg

from padgraph.llm.programs import sampling_inputs
from padgraph.llm.sampling import PURPOSE_DECODE, SamplingParams, sample
from padgraph.llm.state import SamplingLanes

from . import arguments, attention, generation
from .attention import Decode, Prefill, Sites
from .cache import SINK, PagedCache
from .probe import Path, check_decode
from .recurrent import StateSpec, Step, cache_argument
from .speculative import Eagle, Speculative
from .errors import UnsupportedModelError
from .support import attention_modules, cache_shape, check_served, device_of, graph_safe_experts, raised_in, serving

PROGRAM = "hf_decode"


def decode_program(buckets: pg.Buckets, recurrent: bool = False) -> pg.Program:
    """One new token per request: its id, its position, its request row in the slot table, and
    its sampling parameters (`padgraph.llm.programs.sampling_inputs`: a padded lane is greedy).
    `recurrent`: a hybrid model's recurrent pool is state too, indexed by the same request row
    (a padded lane's row 0 is its sink)."""
    bs = pg.Axis("bs")
    state = {"kv": pg.State(sink=SINK), "req_to_token": pg.State(sink=SINK)}
    if recurrent:
        state["recurrent"] = pg.State(sink=SINK)
    return pg.Program(
        PROGRAM,
        inputs={
            "input_ids": pg.Input((bs,), torch.int64, pad=0),
            "positions": pg.Input((bs,), torch.int64, pad=0),            # padded lanes: position 0 ...
            "req_pool_indices": pg.Input((bs,), torch.int64, pad=SINK),  # ... of sink row 0 -> slot 0
            **sampling_inputs(bs),
        },
        outputs={"next_token": pg.Output((bs,), torch.int64)},
        state=state,
        buckets=buckets,
    )


class DecodeBody:
    """The decode program's body: the model's forward over the padded view, then each lane's
    next token drawn at its next position (greedy lanes: the argmax)."""

    def __init__(self, model, sites: Sites, kernel=None, modules=None, states: tuple[StateSpec, ...] = ()):
        """sites: the cache site of each attention call. modules: given, the model's layers are
        compiled regions; each attention module then holds its sites' caches for the call
        (`attention.bound`), so one graph serves every layer. states: a hybrid model's recurrent
        states, read from and written back to the view's `recurrent` pool at each lane's row."""
        self.model, self.sites, self.kernel, self.modules, self.states = model, sites, kernel, modules, states
        self.cache_arg = cache_argument(model) if states else None

    def logits(self, x) -> torch.Tensor:
        """The padded view's next-token logits [bs, vocab]."""
        sites = self.sites.fresh()
        batch = Decode(x.kv, x.req_to_token, x.req_pool_indices, x.positions, sites, self.kernel,
                       bound=self.modules is not None)
        step = Step.gathered(self.states, x.recurrent, x.req_pool_indices) if self.states else None
        with attention.bound(self.modules, x.kv, sites):
            logits = self.model(input_ids=x.input_ids[:, None], position_ids=x.positions[:, None],
                                use_cache=False, padgraph_batch=batch,
                                **({self.cache_arg: step} if step is not None else {})).logits   # [bs, 1, vocab]
        if step is not None:
            step.scatter(x.recurrent, x.req_pool_indices)                          # padded lanes: row 0
        return logits[:, -1]

    def __call__(self, x):
        token = sample(self.logits(x), x.temperature, x.top_k, x.top_p, x.min_p, x.seed, x.positions + 1,
                       PURPOSE_DECODE)                                                 # [bs]
        return {"next_token": token}


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
    """Decoding of a Hugging Face `PreTrainedModel` through padgraph's paged cache and decode
    program, with no change to the model and no HF cache: greedy (the model's own greedy tokens)
    or sampled (HF's `generate(do_sample=True)` distribution, each row its own random stream).

    max_batch: requests per `generate` (>= 1); max_len: prompt (padding included) plus new tokens
    (>= 2). backend: "cuda" (CUDA graphs) or "reference" (eager, any device); torch_compile: False, True
    (the decoder layers compiled as regions sharing one graph), "whole" (the whole forward) or a
    `pg.compile` torch_compile dict (`compile_spec`); buckets: the decode ladder (default `pg.Buckets.default(max_batch)`);
    options: passed to `pg.compile` (e.g. the cuda backend's `warmup`, `restore_state`).
    draft: `Eagle(...)` decodes speculatively with an EAGLE head (distilled here unless given)
    through padgraph.llm's prefill / draft / verify / draft-extend programs; greedy tokens stay the
    model's greedy ones, sampled rows keep its sampling distribution exactly (speculative
    sampling). Without it, `generate` is `prefill` (eager) then `step` (one decode-program call)
    per new token.
    probe: before compiling, decode a small ragged left-padded batch (3 rows, a prefill and 3
    steps) through this Decoder's attention, cache and body and through the model's own forward,
    and refuse the model unless the logits agree within the dtype's tolerance (`probe.py`).
    `probe=False` skips it (one prefill and 3 decode steps of 3 rows, twice): for a model already
    probed at this dtype and device, where that time or memory matters.
    Hybrid models (Mamba / Mamba2 SSMs, short convolutions, gated delta nets beside attention, or
    alone) are served where every recurrent mixer keeps its state through HF's cache API: that
    state lives in a pool of one row per request (`recurrent.py`), written by the prefill and read
    and rewritten by each decode step; a request's first forward never reads its row.
    Raises `UnsupportedModelError`, naming the layer and the cause, for a model it cannot serve
    exactly: a token mixer that keeps state another way and calls no attention (lightning
    attention, recurrent blocks with state of their own, ...), an attention keyword it does not
    apply, a probe whose logits differ; with `draft`, also any recurrent mixer and attention the
    paged kernels do not compute (soft-cap, short windows, sinks).
    Bad arguments raise `ArgumentError` / `ArgumentTypeError` (ContractError family).
    """

    def __init__(self, model, *, max_batch: int, max_len: int, backend: str = "cuda", torch_compile=False,
                 buckets=None, draft=None, probe: bool = True, **options):
        max_batch, max_len = check_options(model, max_batch, max_len, backend, torch_compile, draft, probe)
        served = check_served(model, recurrent=draft is None)   # a draft's engine keeps no recurrent state
        self.model, self.max_batch, self.max_len = model, max_batch, max_len
        device = device_of(model)
        self.rows = torch.arange(1, max_batch + 1, device=device)                     # [max_batch] request rows
        self.greedy = lanes_of(SamplingParams(), torch.zeros(max_batch, dtype=torch.int64, device=device))
        self.experts = graph_safe_experts(device)
        self.speculative, self.last_stats = None, None
        if draft is not None:
            engine = {"torch_compile": bool(torch_compile), "compile_options": options,
                      "buckets": pg.Buckets(buckets) if buckets is not None else None}
            self.speculative = Speculative(model, draft, max_batch=max_batch, max_len=max_len,
                                           backend=backend, engine_options=engine)
            return
        spec = compile_spec(torch_compile, model)
        ladder = pg.Buckets(buckets) if buckets is not None else pg.Buckets.default(max_batch)
        self.cache = PagedCache(cache_shape(model, served.calls, served.states), max_batch, max_len, device)
        self.sites = Sites(self.cache.shape.index())
        kernel = triton_decode_kernel(backend, device, self.cache.shape.dtype)
        self.probe_error = self.probe(kernel) if probe else None        # largest relative logit error
        self.program = decode_program(ladder, recurrent=bool(served.states))
        regional = attention_modules(model, served.calls) if spec and spec.get("regions") else None
        self.body = DecodeBody(model, self.sites, kernel, regional, served.states)
        self.runner = self.compiled(spec, torch_compile, backend, options)

    def compiled(self, spec, torch_compile, backend: str, options: dict):
        """pg.compile of the decode program; a size-oblivious trace that fails falls back to
        torch's dynamic shapes, with a warning."""
        with self.serving(), torch.no_grad():
            try:
                return pg.compile(self.program, self.body, backend=backend, state=self.state(),
                                  copy_outputs=True, torch_compile=spec, **options)
            except pg.CaptureError as e:
                if not (torch_compile is True or torch_compile in ("layers", "whole")):
                    raise
                warnings.warn(f"padgraph.hf.Decoder: size-oblivious compilation of {type(self.model).__name__}'s "
                              f"forward failed ({e}); compiling with torch's dynamic shapes (bucket 1 compiles "
                              f"a graph of its own)", RuntimeWarning, stacklevel=3)
                return pg.compile(self.program, self.body, backend=backend, state=self.state(),
                                  copy_outputs=True, torch_compile={**spec, "size_oblivious": False}, **options)

    def probe(self, kernel) -> float:
        """`probe.check_decode` over this Decoder's prefill, attention kernel and decode body:
        the largest relative logit error it saw, or UnsupportedModelError."""
        path = Path(prefill=lambda cache, ids, mask, cls: run_prefill(self.model, cache, self.sites, ids, mask, cls),
                    decode=DecodeBody(self.model, self.sites, kernel, states=self.cache.shape.states).logits,
                    serving=self.serving)
        try:
            return check_decode(self.model, self.cache.shape, path, self.max_len)
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            if isinstance(e, pg.ContractError):
                raise
            raise UnsupportedModelError(
                f"padgraph.hf.Decoder({type(self.model).__name__}): the probe batch (a ragged left-padded prefill "
                f"and decode steps) fails through padgraph's path ({type(e).__name__}: {e}, {raised_in(e)})") from e

    def serving(self):
        return serving(self.model, self.experts)

    def _greedy_only(self, what: str) -> None:
        if self.speculative is not None:
            raise pg.ContractRuntimeError(
                f"padgraph.hf.Decoder.{what}: this Decoder decodes with a draft head (draft=...), through "
                f"padgraph.llm's engine (decoder.speculative.engine); {what} belongs to the greedy decode program")

    def state(self) -> dict:
        state = {"kv": self.cache.kv, "req_to_token": self.cache.req_to_token}
        if self.cache.shape.states:
            state["recurrent"] = self.cache.recurrent
        return state

    # ---- the two phases ---------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                lanes: SamplingLanes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts [n, P] into request rows 1..n: (first new tokens [n], prompt lengths [n]).
        lanes: each row's sampling parameters (None: greedy)."""
        self._greedy_only("prefill")
        check_prompts(self, "padgraph.hf.Decoder.prefill", input_ids, attention_mask, 0)
        with self.serving(), torch.no_grad():
            logits, _ = run_prefill(self.model, self.cache, self.sites, input_ids, attention_mask)
        lens = attention_mask.bool().sum(-1)
        if lanes is None:
            return logits.argmax(-1), lens
        return sample(logits, lanes.temperature, lanes.top_k, lanes.top_p, lanes.min_p, lanes.seed, lens,
                      PURPOSE_DECODE), lens

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One greedy decode call: tokens [n] at positions [n] of requests 1..n -> next tokens [n]."""
        self._greedy_only("step")
        check_step(self, tokens, positions)
        return self._step(tokens, positions, self.greedy.head(tokens.shape[0]))

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, lanes: SamplingLanes) -> torch.Tensor:
        """`step` unchecked, for generate's loop (a check reads the tokens on the host: a sync a step)."""
        with self.serving(), torch.no_grad():
            return self.runner(input_ids=tokens, positions=positions, req_pool_indices=self.rows[:tokens.shape[0]],
                               **lanes.inputs()).next_token

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, *, generation_config=None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, eos_token_id=None, pad_token_id: int | None = None,
                 seed: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Tokens as `model.generate(input_ids, attention_mask=..., ...)` decodes them: [n, P + new],
        prompts left-padded. Greedy tokens are the model's own; sampled ones follow HF's distribution.
        input_ids: a [n, P] int64 tensor of ids in [0, vocab_size); attention_mask: None (all ones)
        or 0s and 1s of its shape, left-padded. The keywords are HF's and resolve as HF resolves them
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
        check_prompts(self, "padgraph.hf.Decoder.generate", input_ids, attention_mask, plan.max_new_tokens)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids, attention_mask = input_ids.to(self.rows.device), attention_mask.to(self.rows.device)
        n = input_ids.shape[0]
        seeds = (generation.row_seeds(n, seed, generator, self.rows.device) if not plan.params.greedy
                 else torch.zeros(n, dtype=torch.int64, device=self.rows.device))
        if self.speculative is not None:
            with torch.no_grad():
                new, self.last_stats = self.speculative.generate(input_ids, attention_mask, plan, seeds.tolist())
        else:
            new = self.decode(input_ids, attention_mask, plan, seeds)
        return torch.cat([input_ids, generation.finish_at_end(new, plan.eos, plan.pad)], 1)

    def decode(self, input_ids, attention_mask, plan: generation.Plan, seeds: torch.Tensor) -> torch.Tensor:
        """New tokens [n, plan.max_new_tokens]: prefill, then one decode call a token."""
        lanes = lanes_of(plan.params, seeds)
        token, lens = self.prefill(input_ids, attention_mask, None if plan.params.greedy else lanes)
        new = [token]
        for i in range(plan.max_new_tokens - 1):
            new.append(self._step(new[-1], lens + i, lanes))
        return torch.stack(new, 1)

    def check(self, trials: int = 4, seed: int = 0):
        """`pg.check` of the decode body over random valid calls, on copies of the cache: a
        `pg.CheckResult`. With a draft head: of each of the engine's runner programs (verify,
        draft, draft-extend, ...), a dict of program name -> `pg.CheckResult`."""
        trials = arguments.integer("padgraph.hf.Decoder.check", "trials", trials, 1)
        seed = arguments.integer("padgraph.hf.Decoder.check", "seed", seed, 0)
        if self.speculative is not None:
            from padgraph.llm import checks
            return checks.check(self.speculative.engine, trials=trials, seed=seed)
        state = {name: [t.clone() for t in v] if isinstance(v, list) else v.clone()
                 for name, v in self.state().items()}
        with self.serving(), torch.no_grad():
            return pg.check(self.program, self.body, state=state, sample=self.sample, trials=trials, seed=seed)

    def sample(self, gen: torch.Generator) -> dict:
        """Raw decode inputs of a random valid call: distinct request rows, positions in range,
        sampling parameters greedy and sampled (`padgraph.llm.checks.sampling_lanes`)."""
        from padgraph.llm.checks import sampling_lanes
        n = int(torch.randint(1, self.max_batch + 1, (), generator=gen))
        vocab = self.model.config.get_text_config().vocab_size
        device = self.rows.device
        raw = {"input_ids": torch.randint(0, vocab, (n,), generator=gen),
               "positions": torch.randint(0, self.max_len, (n,), generator=gen),
               "req_pool_indices": torch.randperm(self.max_batch, generator=gen)[:n] + 1,
               **sampling_lanes(gen, n, vocab)}
        return {k: v.to(device) for k, v in raw.items()}


def lanes_of(params: SamplingParams, seeds: torch.Tensor) -> SamplingLanes:
    """One lane per seed [n], each with `params` (on the seeds' device, no host sync)."""
    n = seeds.shape[0]
    return dataclasses.replace(SamplingLanes.of([params] * n, [0] * n, seeds.device), seed=seeds)


def run_prefill(model, cache: PagedCache, sites: Sites, input_ids, attention_mask, batch_cls=Prefill):
    """Left-padded prompts [n, P] into request rows 1..n of `cache`, through the model with
    padgraph's attention (the caller sets it): (last-position logits [n, vocab], the batch).
    A hybrid model's mixers start from no state (HF's first forward) and their states replace
    whatever rows 1..n of the recurrent pool held."""
    valid = attention_mask.bool()                                                      # [n, P]
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)                             # HF's rule for left pads
    rows = torch.arange(1, input_ids.shape[0] + 1, device=input_ids.device)[:, None]   # [n, 1]
    slots = torch.where(valid, cache.req_to_token[rows, positions].long(), SINK)       # [n, P]
    batch = batch_cls(cache.kv, slots, positions, valid, sites.fresh())
    states = cache.shape.states
    step = Step.fresh_rows(states, input_ids.shape[0], input_ids.device) if states else None
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                   logits_to_keep=1, padgraph_batch=batch,
                   **({cache_argument(model): step} if step is not None else {})).logits          # [n, 1, vocab]
    if step is not None:
        step.scatter(cache.recurrent, rows[:, 0])
    return logits[:, -1], batch


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


def check_step(dec: Decoder, tokens, positions) -> None:
    """`step`'s tokens [n] (ids in the vocabulary) and positions [n] (in 0..max_len-1), n <= max_batch."""
    where = "padgraph.hf.Decoder.step"
    arguments.token_ids(where, "tokens", tokens[None] if isinstance(tokens, torch.Tensor) and tokens.dim() == 1
                        else tokens, dec.model.config.get_text_config().vocab_size)
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != tokens.shape:
        arguments.fail(where, "positions", positions, f"an int64 tensor of tokens' shape {tuple(tokens.shape)}")
    if not 1 <= tokens.shape[0] <= dec.max_batch or not bool(((positions >= 0) & (positions < dec.max_len)).all()):
        arguments.fail(where, "tokens / positions", f"{tokens.shape[0]} requests at {positions.tolist()}",
                       f"1..max_batch={dec.max_batch} requests at positions in [0, max_len={dec.max_len})")


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
