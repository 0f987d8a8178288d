"""Which Hugging Face models padgraph.hf serves, and the cache each needs.

A model is served when every token mixer is either an attention module that calls HF's attention
interface (padgraph's registered function then sees every call's q, k, v) or a recurrent mixer
that keeps its state only through HF's cache API (`recurrent.Step`). `survey` runs the model once
with a recording batch and returns each call (its layer, widths, scale, window, soft-cap, sinks);
`survey_states` runs it once with a recording cache and returns each recurrent state (its layer,
kind, shape, dtype); the cache is sized from what they saw. A module that keeps state across
tokens any other way is refused by what it is, not by its parameter names: a module that takes a
cache argument, or holds a state-decay `A_log`, and neither calls attention below it nor belongs
to a layer whose state went through the recording cache. The numerical probe
(`probe.check_decode`) then catches what a survey cannot see (state kept anywhere else).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch

from . import attention, masks
from .attention import Layer
from .masks import Census, Horizon, rule_of
from .cache import Shape, Site
from .errors import NotBoundError, UnsupportedModelError
from .recurrent import Recording, StateSpec, cache_argument

# a parameter every state-space mixer HF ships has (the state decay A = -exp(A_log))
_RECURRENT_PARAM = "A_log"
# forward arguments through which a module reads or writes state kept across tokens
STATE_ARGS = ("past_key_values", "past_key_value", "cache", "cache_params", "layer_past", "cache_position",
              "use_cache", "conv_state", "ssm_state", "recurrent_state", "past_state")
# keywords HF's layers hand the attention function that padgraph applies or that change nothing
KNOWN_KWARGS = {"padgraph_batch", "sliding_window", "softcap", "s_aux", "dropout", "scaling", "position_ids",
                "cache_position", "output_attentions", "use_cache", "is_causal", "position_embeddings",
                "past_key_values", "past_key_value", "logits_to_keep", "return_dict", "output_hidden_states"}


@contextlib.contextmanager
def serving(model, experts: str | None = None, horizons: dict | None = None):
    """The model's attention implementation set to padgraph's (and, given `experts`, its MoE
    experts implementation set to `experts`; given `horizons`, each attention module's mask rule
    bound on it as `attention.HORIZON`) for the duration, restored after, also on error: the
    model stays the user's, and HF's own calls run as before."""
    cfg = model.config
    before = cfg._attn_implementation, getattr(cfg, "_experts_implementation", None)
    swap = experts is not None and before[1] is not None and before[1] != experts
    bound = {m: getattr(m, attention.HORIZON, None) for m in (horizons or {})}
    cfg._attn_implementation = attention.NAME
    if swap:
        cfg._experts_implementation = experts
    for m, h in (horizons or {}).items():
        setattr(m, attention.HORIZON, rule_of(h))
    try:
        yield
    finally:
        cfg._attn_implementation = before[0]
        if swap:
            cfg._experts_implementation = before[1]
        for m, h in bound.items():
            if h is None:
                delattr(m, attention.HORIZON)
            else:
                setattr(m, attention.HORIZON, h)


@dataclass(frozen=True)
class Call:
    """One attention call of a forward: the module, its path, its widths and what it asks for."""

    module: torch.nn.Module
    path: str
    layer_idx: int | None
    n_heads: int
    n_kv_heads: int
    k_dim: int
    v_dim: int
    layer: Layer
    unknown: tuple[str, ...]    # keywords padgraph neither applies nor knows to be inert
    mask: Horizon | None = None  # the rule of HF's mask for the call (`masks.census`), None: unknown


@dataclass
class Recorder:
    """A batch that records every attention call; its output is zeros of the right shape."""

    paths: dict
    calls: list
    census: Census = field(default_factory=Census)

    def observe(self, module, q, k, v, layer: Layer, mask, kwargs):
        unknown = tuple(sorted(k for k, val in kwargs.items()
                               if k not in KNOWN_KWARGS and val is not None and val is not False))
        self.calls.append(Call(module, self.paths.get(module, "?"), getattr(module, "layer_idx", None),
                               q.shape[1], k.shape[1], k.shape[-1], v.shape[-1], layer, unknown,
                               self.census.of(mask)))

    def attend(self, module, q, k, v, layer: Layer):
        return q.new_zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1])          # [b, n, h, dv]


def survey(model) -> list[Call]:
    """Every attention call of one forward over two rows of three tokens (the first left-padded
    by one, so HF's masks are built as tensors), in call order, each with the rule of the mask HF
    built for it (`masks.census`)."""
    attention.register()
    device = device_of(model)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device=device)
    with serving(model), torch.no_grad(), masks.hf_masks(), masks.census(model) as built:
        rec = Recorder({m: p for p, m in model.named_modules()}, [], built)
        model(input_ids=mask.clone(), attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              use_cache=False, padgraph_batch=rec)
    return rec.calls


@dataclass(frozen=True)
class Served:
    """What a Decoder serves of a model: its attention calls and its recurrent states."""

    calls: list
    states: tuple[StateSpec, ...]


def check_served(model, recurrent: bool = True) -> Served:
    """The model's attention calls and (`recurrent`) the states its recurrent mixers keep through
    HF's cache API, or UnsupportedModelError naming the first module padgraph.hf cannot serve and
    why. Without a stateful module the survey is the attention-only one, unchanged."""
    name = type(model).__name__
    interface = getattr(model, "_supports_attention_backend", False)
    calls = survey_calls(model) if interface else quiet_survey(model)
    named = {m for m in model.modules() if "Attention" in type(m).__name__}
    flagged = stateful_modules(model, {c.module for c in calls} if calls else named)
    states, failure = survey_states(model) if recurrent and flagged and linear_cache_api() else ((), "")
    kept = {s.layer_idx for s in states} | (cacheless_layers(model) if states else set())
    mixers = {m for _, m in flagged if getattr(m, "layer_idx", None) in kept}
    if not interface:
        if not mixers:          # a state-space mixer is the cause, if any
            refuse_stateful(model, named, recurrent, failure)
            raise no_interface(name)
        calls = survey_calls(model)     # a hybrid that does not declare the interface: is it used?
        if own_attention(model, calls, mixers):
            raise no_interface(name)
    refuse_stateful(model, {c.module for c in calls} | {d for m in mixers for d in m.modules()}, recurrent, failure)
    if not calls and not mixers:
        raise UnsupportedModelError(f"padgraph.hf.Decoder({name}): no layer called HF's attention interface")
    for c in calls:
        if c.layer_idx is None:
            raise UnsupportedModelError(f"padgraph.hf.Decoder({name}): attention module {c.path!r} "
                                        f"({type(c.module).__name__}) has no layer_idx to key its cache by "
                                        f"(padgraph keeps each call's keys and values by its module's layer_idx, "
                                        f"not by an index a layer hands its attention in the call)")
        if c.unknown:
            raise UnsupportedModelError(
                f"padgraph.hf.Decoder({name}): layer {c.path!r} passes {list(c.unknown)} to the attention "
                f"function; padgraph's attention applies scaling, sliding_window, softcap and s_aux only")
    return Served(calls, states)


def no_interface(name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"padgraph.hf.Decoder({name}): the model must support HF's attention interface "
        f"(_supports_attention_backend = True); {name} runs its own attention code, which no registered "
        f"attention function sees")


def own_attention(model, calls: list[Call], mixers: set) -> bool:
    """For a hybrid model that does not declare HF's attention interface: whether a module named
    like attention made no call to it in the survey and holds no caller or served mixer (it runs
    its own attention)."""
    served = {c.module for c in calls} | mixers
    return any("Attention" in type(m).__name__ and not any(c in served for c in m.modules())
               for m in model.modules())


def survey_calls(model) -> list[Call]:
    """`survey`, its failures as UnsupportedModelError naming the cause."""
    name = type(model).__name__
    try:
        return survey(model)
    except NotBoundError as e:
        raise UnsupportedModelError(
            f"padgraph.hf.Decoder({name}): an attention layer ran without the keyword arguments the model was "
            f"called with ({e}); its decoder layer does not pass them on to attention, so padgraph cannot tell "
            f"it where its keys and values go") from None
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
        raise UnsupportedModelError(
            f"padgraph.hf.Decoder({name}): the model's forward fails with padgraph's attention function "
            f"({type(e).__name__}: {e}, {raised_in(e)}); it reads something HF builds only for its own attention "
            f"implementations (a 4-D mask, its cache)") from e


def quiet_survey(model) -> list[Call] | None:
    """`survey`, or None where the forward fails with padgraph's attention function."""
    try:
        return survey(model)
    except (NotBoundError, RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError):
        return None


def survey_states(model) -> tuple[tuple[StateSpec, ...], str]:
    """The states the model's mixers keep through HF's linear-attention cache API, in call order,
    from one forward over two tokens with a recording cache, and ""; or () and what failed, where
    that forward fails (the mixers are then refused as stateful, by `refuse_stateful`, naming the
    failure: a model that reads its cache beyond that API, say)."""
    attention.register()
    rec, states = Recorder({m: p for p, m in model.named_modules()}, []), Recording()
    device = device_of(model)
    try:
        with serving(model), torch.no_grad():
            model(input_ids=torch.ones(1, 2, dtype=torch.int64, device=device),
                  position_ids=torch.arange(2, device=device)[None], use_cache=False, padgraph_batch=rec,
                  **{cache_argument(model): states})
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError, NotImplementedError,
            NotBoundError) as e:
        return (), f"{type(e).__name__}: {e}, {raised_in(e)}"
    return tuple(states.seen), ""


def cacheless_layers(model) -> set[int]:
    """The layers HF's own cache gives no storage (a DummyLayer: MoE or MLP blocks of a hybrid
    stack, layers that reuse another's keys): a block there that takes the cache keeps nothing
    in it. Empty where this transformers has no per-layer cache types."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    except (ImportError, AttributeError, TypeError, ValueError):
        return set()
    return {i for i, t in enumerate(types) if t == "dummy"}


def raised_in(e: BaseException) -> str:
    """Where an error was raised: the innermost frame's file stem, function and line."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "at an unknown place"
    code = tb.tb_frame.f_code
    return f"in {code.co_filename.rsplit('/', 1)[-1]}:{code.co_name} line {tb.tb_lineno}"


def stateful_modules(model, callers: set) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every module with parameters that keeps state across tokens (a cache
    argument, `STATE_ARGS`, or a state decay `A_log`) and is not `callers` or above one."""
    above = {m for c in callers for m in ancestors(model, c)}
    return [(path, module) for path, module in model.named_modules()
            if module not in above and any(True for _ in module.parameters()) and keeps_state(module)]


def linear_cache_api() -> bool:
    """Whether this transformers' `Cache` has the linear-attention interface its hybrid mixers
    keep their state through (older versions index the cache's own layers instead)."""
    from transformers.cache_utils import Cache
    return all(hasattr(Cache, n) for n in ("get_conv_state", "update_conv_state", "get_recurrent_state",
                                            "update_recurrent_state"))


def refuse_stateful(model, callers: set, recurrent: bool = False, failure: str = "") -> None:
    """UnsupportedModelError for a module that keeps state across tokens and is not `callers` or
    above one. `recurrent`: the message says what a served recurrent mixer needs; `failure`: why
    the forward through padgraph's recording cache failed, if it did."""
    flagged = stateful_modules(model, callers)
    name = type(model).__name__
    inner = [(p, m) for p, m in flagged if not any(q != p and (not p or q.startswith(p + ".")) for q, _ in flagged)]
    if not inner:       # the innermost flagged module: a mixer rather than the layer holding it
        return
    path, module = inner[0]
    args = [a for a in STATE_ARGS if a in forward_args(module)]
    why = f"takes {args} in its forward" if args else f"holds a state decay {_RECURRENT_PARAM}"
    served = ("attention layers through HF's AttentionInterface, and recurrent mixers that keep their state "
              "only through HF's cache (get_conv_state / update_conv_state, get_recurrent_state / "
              "update_recurrent_state)" + ("" if linear_cache_api() else
                                          f", which transformers {transformers_version()}'s Cache does not have")
              if recurrent else
              "attention layers only with a draft head (padgraph.llm's draft and verify programs keep no "
              "recurrent state of an HF model)")
    failed = (f"; the model's forward through padgraph's recurrent cache (HF's conv / recurrent state interface "
              f"only) fails ({failure})" if failure else "")
    raise UnsupportedModelError(
        f"padgraph.hf.Decoder({name}): layer {path!r} is a {type(module).__name__}, a token mixer that "
        f"keeps state across tokens ({why}) and calls no attention{failed}; padgraph.hf serves {served}, and "
        f"decoding without that state gives other tokens")


def keeps_state(module) -> bool:
    return hasattr(module, _RECURRENT_PARAM) or any(a in forward_args(module) for a in STATE_ARGS)


def ancestors(model, module) -> list:
    """`module` and every module above it in `model`."""
    out = []
    for path, m in model.named_modules():
        if m is module:
            parts = path.split(".") if path else []
            out = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
            break
    return out


def forward_args(module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_shape(model, calls: list[Call], states: tuple[StateSpec, ...] = ()) -> Shape:
    """The cache sites the calls write, the model's dtype, and the recurrent states."""
    sites = tuple(Site(c.layer_idx, c.n_kv_heads, c.k_dim, c.v_dim) for c in calls)
    return Shape(sites, next(model.parameters()).dtype, states)


def attention_modules(model, calls: list[Call] | None = None) -> list:
    """Every module that calls attention, in first-call order."""
    calls = survey(model) if calls is None else calls
    return list(dict.fromkeys(c.module for c in calls))


def decoder_of(model) -> torch.nn.Module:
    """The model's decoder (the module holding its layers): `get_decoder()`, or where that returns
    the causal LM itself (Llama 4's text model, whose base_model_prefix names no attribute), its
    one child that holds a ModuleList."""
    decoder = model.get_decoder()
    if decoder is not model:
        return decoder
    inner = [c for c in model.children() if any(isinstance(g, torch.nn.ModuleList) for g in c.children())]
    return inner[0] if len(inner) == 1 else decoder


def device_of(model) -> torch.device:
    return next(model.parameters()).device


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


def transformers_version() -> str:
    import transformers
    return transformers.__version__
