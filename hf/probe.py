"""The Decoder's probe: before a `Decoder` serves a model, a small left-padded batch (3 ragged
rows) is prefilled and decoded a few steps through the path it serves with (its `Target`'s
`forward_extend` and `forward_decode` over a scratch cache of the Target's own layout, run
eagerly: the attention function, the cache sites, the recurrent pools) and through the model's
own code twice: its `generate(do_sample=False)` (HF's attention, mask and cache: the tokens a
Decoder promises) and its full-recompute forward (HF's attention and mask, no cache) over the
tokens generate chose. padgraph's logits at every forward must agree with both within the
dtype's tolerance, so a model whose generate and forward disagree (a layer that reads another
pass's cached keys rather than its own, state its cache does not keep) is served by neither.
Where they do not agree, `UnsupportedModelError` names the reference, the first decoder layer
whose output differs (forward hooks on the layers in every run) and the likely cause: an HF mask
that is not causal-and-window (chunked, dynamic), or state the layer keeps that no attention
call sees. Where the model's generate fails, its forward alone is the reference.

The rule is structural: whatever an architecture does that padgraph does not reproduce shows in
its tokens' logits, and is refused at `Decoder(...)` rather than served with other tokens.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from padgraph.llm.batch import Batch
from padgraph.llm.kv import FIRST

from .attention import Layer, Prefill
from .masks import hf_masks
from .errors import UnsupportedModelError

ROWS, STEPS, PROMPT = 3, 3, 10
# relative error allowed: ||ours - theirs|| / ||theirs|| per row, at the model's dtype
# (a layer served wrongly gives O(1): a dropped sink, a missed window or state, another mask)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}


def rel_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max over rows of ||ours - theirs|| / ||theirs||: rows [n, ...]."""
    a, b = ours.float().flatten(1), theirs.float().flatten(1)
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp(min=1e-12)).max())


def probe_batch(vocab: int, max_len: int, device):
    """ROWS left-padded prompts with lengths P, P - 2, P - 5 (at least 1):
    (input_ids [ROWS, P], attention_mask [ROWS, P]), P = min(PROMPT, max_len - STEPS)."""
    P = max(1, min(PROMPT, max_len - STEPS))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(vocab, 2), (ROWS, P), generator=g)
    mask = torch.ones(ROWS, P, dtype=torch.int64)
    for row, short in enumerate((0, 2, 5)):
        mask[row, :min(short, P - 1)] = 0
    return (ids * mask).to(device), mask.to(device)


@dataclass
class Taps:
    """Forward hooks on the decoder layers: each forward's last-position outputs [n, H] per layer,
    in call order (`steps` splits them by forward)."""

    layers: list
    seen: list = field(default_factory=list)

    @contextlib.contextmanager
    def on(self):
        hooks = [m.register_forward_hook(self.hook) for m in self.layers]
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()

    def hook(self, module, args, out):
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            self.seen.append(hidden[:, -1].detach())

    def take(self) -> list:
        """What was seen since the last take, cleared."""
        seen, self.seen = self.seen, []
        return seen

    def steps(self, n: int) -> list[list]:
        """The taps of n forwards that each made as many layer calls ([] each where they did not)."""
        per, left = divmod(len(self.seen), n)
        return [self.seen[i * per:(i + 1) * per] for i in range(n)] if not left else [[] for _ in range(n)]


def decoder_layers(model) -> tuple[str, list]:
    """The decoder's layer list (its one ModuleList of modules) and its path, or ("", [])."""
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and path.endswith("layers"):
            return path, list(m)
    return "", []


@dataclass
class MaskCheck(Prefill):
    """A prefill that also compares, for every attention call, HF's mask with the one padgraph
    attends with (real query rows only); the first disagreement is kept."""

    differs: str | None = None

    def observe(self, module, q, k, v, layer: Layer, mask, kwargs):
        if self.differs is not None or mask is None or mask.dim() != 4:
            return
        ours = self.visible(layer)                                                     # [n, P, P]
        theirs = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0           # [n, P, P]
        rows = self.valid[:, :, None].expand_as(ours)
        if mask.dtype != torch.bool and bool(((mask[:, 0] != 0) & (mask[:, 0] > torch.finfo(mask.dtype).min)
                                              & rows).any()):
            self.differs = f"layer {module.layer_idx}: HF's attention mask carries finite biases (a dynamic mask)"
        elif theirs.shape == ours.shape and bool(((theirs != ours) & rows).any()):
            within = " and ".join(w for w in (f"a sliding window of {layer.sliding_window}" if layer.sliding_window
                                             else "", f"chunks of {layer.chunk}" if layer.chunk else "") if w)
            self.differs = (f"layer {module.layer_idx}: HF's attention mask is not causal within "
                            f"{within or 'the request'} (a chunked or other mask of its own) as padgraph's "
                            f"attention is")


def reference_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's own last-position logits [n, vocab]: full recompute with HF's mask, positions
    counted over real tokens as HF's generate counts them."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                 logits_to_keep=1).logits[:, -1]


@dataclass
class Reference:
    """One run of the model's own code over the probe batch: its last-position logits at each
    forward ([n, vocab], the prefill's first) and its layers' taps per forward."""

    name: str
    logits: list
    taps: list


GENERATE, FORWARD = "generate", "forward (full recompute, no cache)"


def generated(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> tuple[Reference, torch.Tensor] | None:
    """`model.generate(do_sample=False)` over the probe batch, `steps` + 1 new tokens (none ends a
    row early; HF's own attention and cache, compilation off): its raw logits and taps, and the
    tokens it fed back [n, steps]; None where the model's generate fails."""
    from transformers import GenerationConfig
    extra = {"disable_compile": True} if hasattr(GenerationConfig(), "disable_compile") else {}
    taps = Taps(decoder_layers(model)[1])
    try:
        pad = model.generation_config.pad_token_id
        with taps.on():
            out = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=steps + 1,
                                 min_new_tokens=steps + 1, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=pad if pad is not None else 0, **extra)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError, NotImplementedError):
        return None
    logits = list(out.logits)[:steps + 1]
    return Reference(GENERATE, logits, taps.steps(len(logits))), out.sequences[:, ids.shape[1]:]


def recomputed(model, ids: torch.Tensor, mask: torch.Tensor, steps: int,
               tokens: torch.Tensor | None) -> tuple[Reference, torch.Tensor]:
    """The model's full-recompute forward after each of `steps` tokens: `tokens` [n, >= steps] fed
    in turn, or (None) its own greedy ones. (the Reference, the tokens fed [n, steps])"""
    taps, logits, per_step, fed = Taps(decoder_layers(model)[1]), [], [], []
    for t in range(steps + 1):
        with taps.on():
            logits.append(reference_logits(model, ids, mask))                         # [n, vocab]
        per_step.append(taps.take())
        if t == steps:
            break
        fed.append(tokens[:, t] if tokens is not None else logits[-1].argmax(-1))     # [n]
        ids, mask = torch.cat([ids, fed[-1][:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return Reference(FORWARD, logits, per_step), torch.stack(fed, 1) if fed else ids[:, :0]


def references(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> tuple[list[Reference], torch.Tensor]:
    """What padgraph must reproduce: the model's generate (the tokens a Decoder promises) and its
    full-recompute forward over the tokens generate chose (where its generate fails: over its own
    greedy tokens, alone). A model whose generate and forward disagree is served by neither."""
    gen = generated(model, ids, mask, steps)
    if gen is None:
        forward, tokens = recomputed(model, ids, mask, steps, None)
        return [forward], tokens
    ref, tokens = gen
    steps = len(ref.logits) - 1
    return [ref, recomputed(model, ids, mask, steps, tokens)[0]], tokens[:, :steps]


def scratch(target, n: int, length: int):
    """A cache of the Target's layout for n requests of `length` positions, request rows FIRST..,
    each owning its own slots: (cache, rows [n] int64)."""
    device = target.lm_head.weight.device
    cache = target.new_cache(target.cfg.n_layers, FIRST + n * length, length, FIRST + n)
    rows = torch.arange(FIRST, FIRST + n, device=device)
    cache.req_to_token[rows] = (FIRST + torch.arange(n * length, device=device).view(n, length)).int()
    return cache, rows


def packed(cache, rows, ids, mask) -> tuple[torch.Tensor, torch.Tensor, Batch]:
    """The left-padded prompts packed as padgraph.llm's prefill packs them: (tokens [n_tok],
    positions [n_tok], the extend's Batch)."""
    valid, lens = mask.bool(), mask.sum(-1)
    positions = torch.cat([torch.arange(int(k), device=ids.device) for k in lens])
    loc = cache.req_to_token[rows.repeat_interleave(lens), positions].long()
    qo = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).int()
    return ids[valid], positions, Batch(cache, cache.req_to_token, rows.int(), lens.int(), loc, qo_indptr=qo)


def check_decode(model, target, max_len: int) -> float:
    """UnsupportedModelError unless the Target's prefill and decode give the logits of the
    model's own generate and of its forward (`references`, within `TOLERANCE`) on a ragged
    left-padded probe batch over several steps, fed the tokens generate chose; else the largest
    relative error seen."""
    device = target.lm_head.weight.device
    ids, mask = probe_batch(model.config.get_text_config().vocab_size, max_len, device)
    n, P = ids.shape
    with torch.no_grad():
        refs, tokens = references(model, ids, mask, min(STEPS, max_len - P))
    steps = tokens.shape[1]
    cache, rows = scratch(target, n, P + steps)
    lens = mask.sum(-1)
    ours = Taps(decoder_layers(model)[1])
    prefills: list[MaskCheck] = []
    worst = 0.0
    with torch.no_grad():
        with hf_masks(), ours.on():
            logits, _ = target.forward_extend(*packed(cache, rows, ids, mask),
                                              prefill_cls=lambda *a: prefills.append(MaskCheck(*a)) or prefills[-1])
        for t in range(steps + 1):
            worst = max(worst, judge(model, t, logits, refs, ours.take(), prefills[0].differs, target.shape.dtype))
            if t == steps:
                return worst
            token, pos = tokens[:, t], lens + t                                        # [n], [n]
            batch = Batch(cache, cache.req_to_token, rows.int(), (pos + 1).int(), cache.req_to_token[rows, pos].long())
            with ours.on():
                logits, _ = target.forward_decode(token, pos, batch)


def judge(model, t: int, logits, refs: list[Reference], ours: list, mask_differs: str | None, dtype) -> float:
    """Step t's largest relative error over `refs`; raise naming the first reference the logits
    differ from and its first differing layer (`ours`: the step's layer taps, against the
    reference's)."""
    tol = TOLERANCE.get(dtype, 4e-2)
    errs = [rel_error(logits, ref.logits[t]) for ref in refs]
    off = [i for i, err in enumerate(errs) if err > tol]
    if not off:
        return max(errs)
    ref, err = refs[off[0]], errs[off[0]]
    theirs = ref.taps[t]
    layer_errs = [rel_error(a, b) for a, b in zip(ours, theirs)] if len(ours) == len(theirs) else []
    layers_path = decoder_layers(model)[0]
    first = next((i for i, e in enumerate(layer_errs) if e > tol), None)
    where = "the prefill" if t == 0 else f"decode step {t}"
    at = (f"layer {layers_path}.{first} is the first whose output differs ({layer_errs[first]:.2g})"
          if first is not None else "no decoder layer's output differs (the final norm or head does)")
    agrees = next((r.name for i, r in enumerate(refs) if i not in off), None)
    raise UnsupportedModelError(
        f"padgraph.hf.Decoder({type(model).__name__}): on a probe batch ({ROWS} left-padded rows), padgraph's "
        f"logits differ from the model's own {ref.name} at {where} (relative error {err:.2g} > {tol:g} for "
        f"{dtype}); {at}. Likely cause: {cause(t, mask_differs, agrees)}. Serving it would give other tokens "
        f"than model.generate")


def cause(t: int, mask_differs: str | None, agrees: str | None = None) -> str:
    """Why the logits likely differ: HF's mask where it is not padgraph's; the model's generate and
    forward disagreeing (padgraph `agrees` with one of them); state kept across tokens (t > 0);
    else an attention variant."""
    if mask_differs is not None:
        return mask_differs
    if agrees is not None:
        return (f"the model's own generate and forward disagree, and padgraph's logits agree with its {agrees}: "
                f"HF's cache keeps or reads other keys or state than the forward attends to (a window the config "
                f"names and the layers never apply, a layer that reads another pass's keys, state kept across "
                f"tokens that no cache holds)")
    if t > 0:
        return ("the layer keeps something across tokens that padgraph's attention cache does not hold "
                "(a recurrent or convolution state, or a cache HF's layer reads in its own way)")
    return ("the layer computes something padgraph's attention function does not reproduce (an attention "
            "variant or keyword HF's own attention applies)")
