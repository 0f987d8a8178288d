"""What Hugging Face's own mask restricts each attention layer to, read from the mask factory
that built it rather than from the mask's values.

HF's models build their attention masks with the factories of `transformers.masking_utils`
(`create_causal_mask`, `create_sliding_window_causal_mask`, `create_chunked_causal_mask`, ...),
one per layer type, and hand each layer its type's mask. The attention function receives the
mask, not the rule it came from, and a probe batch of a dozen tokens cannot tell a causal mask
from a sliding window or a chunk of 8192. So the survey forward runs with every factory the
model's modules import wrapped (`census`): each mask it returns is recorded with the rule its
factory applied, as that factory reads it from the config it was given (`sliding_window`,
`attention_chunk_size`), and the attention call that receives that mask (or a view of it) knows
its layer's `Horizon` at any length. Layers that call attention with a mask no wrapped factory
built (or none) keep the keywords they pass (`sliding_window`) as the only rule, and the probe's
value check.

`hf_masks` makes HF build its masks for padgraph's attention implementation (as for SDPA): by
default it builds none for a registered function.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

# factory name -> the rule its masks apply beyond causality and padding ("window", "chunk",
# "causal"), or "other" for masks that are not causal (bidirectional)
FACTORIES = {
    "create_causal_mask": "causal",
    "create_sliding_window_causal_mask": "window",
    "create_chunked_causal_mask": "chunk",
    "create_bidirectional_mask": "other",
    "create_bidirectional_sliding_window_mask": "other",
}
# keyword arguments that lay another rule over a factory's (image tokens, blocks)
OVERLAYS = ("or_mask_function", "and_mask_function", "block_sequence_ids")


@dataclass(frozen=True)
class Horizon:
    """What a layer's HF mask lets a query see beyond causality within its own request: keys
    less than `window` positions back (q - k < window), or keys of its own `chunk` of positions
    (q // chunk == k // chunk); None for either: no such limit. `rule` names the factory's rule
    ("causal", "window", "chunk", "other": a mask padgraph does not apply, e.g. an overlay)."""

    rule: str = "causal"
    window: int | None = None
    chunk: int | None = None


def rule_of(horizon: Horizon | None) -> tuple | None:
    """(window, chunk) of a Horizon, as `attention.with_rule` takes it (None: no rule read); a
    tuple of ints, so a compiled region guards on its values."""
    return None if horizon is None else (horizon.window, horizon.chunk)


def horizon_of(rule: str, config, kwargs: dict) -> Horizon:
    """The Horizon of a mask built by a factory of `rule` from `config` with `kwargs`."""
    if any(kwargs.get(k) is not None for k in OVERLAYS) or rule == "other":
        return Horizon("other")
    if rule == "window":
        return Horizon("window", window=getattr(config, "sliding_window", None))
    if rule == "chunk":
        return Horizon("chunk", chunk=getattr(config, "attention_chunk_size", None))
    return Horizon()


class Census:
    """Masks built during a forward, by identity: id(mask) -> its Horizon. The census holds each
    mask it records (`kept`), so no other tensor takes its id while it lasts."""

    def __init__(self):
        self.built: dict[int, Horizon] = {}
        self.kept: list[torch.Tensor] = []

    def of(self, mask) -> Horizon | None:
        """The Horizon of the mask an attention call received (or of the tensor it is a view
        of); None where no wrapped factory built it."""
        if not isinstance(mask, torch.Tensor):
            return None
        for t in (mask, mask._base):
            if t is not None and id(t) in self.built:
                return self.built[id(t)]
        return None

    def wrap(self, fn, rule: str):
        """`fn` recording the masks it builds with `rule`. Not recorded: a mask it returns as it
        was given (HF's factories pass a 4-D `attention_mask` through: no rule of theirs applied)
        and one already recorded (a factory that hands the call to another, as the causal ones
        do to the bidirectional ones where `config.is_causal` is False: the inner one's rule)."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        def factory(*args, **kwargs):
            out = fn(*args, **kwargs)
            named = dict(kwargs)
            if signature is not None:
                try:
                    named = {**signature.bind_partial(*args, **kwargs).arguments, **kwargs}
                except TypeError:
                    pass
            config = named.get("config", args[0] if args else None)
            if (isinstance(out, torch.Tensor) and out is not named.get("attention_mask")
                    and id(out) not in self.built):
                self.built[id(out)] = horizon_of(rule, config, named)
                self.kept.append(out)
            return out
        return factory


@contextlib.contextmanager
def census(model):
    """For the duration, every mask factory (`FACTORIES`) that `transformers.masking_utils` or a
    module of the model's classes holds is wrapped to record its masks in the yielded `Census`;
    restored after, also on error."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield Census()
        return
    rec = Census()
    # every module a class of the model comes from (HF's, remote code's, the user's own): only
    # the names bound to HF's own factories are swapped
    modules = {mu} | {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__ in sys.modules}
    originals = {name: getattr(mu, name, None) for name in FACTORIES}     # before any is swapped
    swapped = []
    for mod in modules:
        for name, rule in FACTORIES.items():
            fn = vars(mod).get(name)           # the module's own binding (no module __getattr__ run)
            if fn is not None and fn is originals[name]:
                setattr(mod, name, rec.wrap(fn, rule))
                swapped.append((mod, name, fn))
    try:
        yield rec
    finally:
        for mod, name, fn in swapped:
            setattr(mod, name, fn)


@contextlib.contextmanager
def hf_masks():
    """HF builds its masks for attention implementation "padgraph" (as for SDPA) for the
    duration; by default it builds none for a registered function. Restored after."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
        mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    except (ImportError, AttributeError):    # a transformers without the interface: no mask to compare
        yield
        return
    had = mapping.get("padgraph")
    mapping["padgraph"] = sdpa_mask
    try:
        yield
    finally:
        if had is None:
            mapping.pop("padgraph", None)
        else:
            mapping["padgraph"] = had
