"""Sampling under the contract: per-request parameters, a counter-based random stream, the
sampler (`sample`, `sampling_probs`) and exact speculative acceptance (`verify_chain_sampled`,
`verify_tree_sampled`). Everything here is torch and graph-safe: fixed shapes from the arguments,
no host sync, no global generator. On CUDA tensors `sample` runs the Triton kernels of
`padgraph.backends.triton.sampling`, which return the same tokens bit for bit, and
`sampling_probs` takes its top-k / top-p thresholds from them (no sort); under torch.compile
`sample` and `sampling_probs` are opaque ops (their integers must not be fused).

The distribution, in Hugging Face's processor order (`GenerationMixin._get_logits_processor`:
temperature, top-k, top-p, min-p), on fp32 logits `l` of one row:

1. x = l * (1 / temperature) (fp32, the reciprocal once per row: HF divides, which differs
   in the last bit of x only). NaN counts as -inf; if any x is +inf the row's mass is
   spread evenly over its +inf entries. d = x - max(x) <= 0.
2. Weights in fixed point, w = floor(exp(d) * 2**40) as int64, through `fixed_exp` (a
   polynomial of IEEE adds and multiplies, so the kernel computes the same integers; tokens with
   exp(d) < 2**-40 weigh 0). Sums of integers do not depend on their order: every threshold
   and the draw below are exact and identical in any implementation.
3. top-k (k in 1..V-1): keep d >= the k-th largest d (ties at the boundary all kept, as HF's).
4. top-p (< 1): keep d_i if the weight of the kept tokens with d > d_i is < top_p * their total
   (fp64 comparison; the top token always stays; ties stay or go together).
5. min-p (> 0): keep w_i >= min_p * 2**40, i.e. p_i >= min_p * p_max (fp64 comparison).
6. The draw: r = floor(u * Z / 2**62) for Z the kept weights' sum and u 62 random bits of the
   stream (integer arithmetic, no modulo bias); the token is the first index whose cumulative
   weight exceeds r. Its probability is w_i / Z up to 2**-62.

temperature == 0 lanes return exactly `logits.argmax(-1)` (torch's rule: the first NaN, else the
first maximum); so does a sampled lane whose logits hold no finite or +inf value.

The random stream: 64 random bits per key (seed, position, purpose, index) from splitmix64's
finaliser (the output function of Java's SplittableRandom; over a Weyl sequence it passes
TestU01's BigCrush) absorbing the key one 64-bit word at a time, h <- mix(h ^ word + gamma): a
cascade of bijections, so two keys share bits only by a 2**-64 accident. Not cryptographic.
A lane's token depends only on its logits, its parameters and its keys: the same in any row,
batch, bucket, eager or CUDA graph.

Keys. The position is the absolute position of the token being decided. A plain next token is
(seed, position, PURPOSE_DECODE); a speculative round tests a draft at (seed, position,
PURPOSE_ACCEPT, node) and draws a correction or the bonus at (seed, position,
PURPOSE_RESIDUAL); a draft that samples its proposals uses PURPOSE_DRAFT with the proposed
token's position and an index that tells its tree nodes apart. Exactness needs every decision
to read bits no other decision read: a round only decides positions up to its first rejection
and the next round starts after the tokens it emitted, so these keys never repeat across rounds;
keying a draft's noise by tree node instead of position would (and biases the output).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import padgraph as pg
from padgraph.errors import mismatch
from padgraph.backends.triton import sampling as kernels
from padgraph.backends.triton.sampling import (FIXED_ONE, PURPOSE_ACCEPT, PURPOSE_DECODE,
                                               PURPOSE_DRAFT, PURPOSE_RESIDUAL, fixed_exp,
                                               mulhi62, random_bits)

__all__ = ["SamplingParams", "PURPOSE_DECODE", "PURPOSE_ACCEPT", "PURPOSE_RESIDUAL",
           "PURPOSE_DRAFT", "random_bits", "uniform", "sample", "sampling_probs",
           "sampling_weights", "draw", "verify_chain_sampled", "verify_tree_sampled",
           "verify_tree_logits", "child_probs",
           "fixed_exp", "FIXED_ONE", "mulhi62"]

SEED_MAX = 2 ** 63 - 1


def _bad(field: str, value, allowed: str) -> pg.ContractValueError:
    return pg.ContractValueError(f"SamplingParams.{field} must be {allowed}; got {value!r}")


def _number(field: str, value, kinds) -> None:
    if isinstance(value, bool) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise pg.ContractTypeError(f"SamplingParams.{field} must be a {names}; got {value!r}")


# Temperatures below this are greedy, the T -> 0+ limit: the sampler scales logits by 1 / T in
# fp32, and at T < ~1e-37 (a subnormal fp32 T: any logit) |logit| / T overflows to inf, where the
# module doc's rule would spread the mass over every token with a positive logit. 2**-100 keeps
# logits up to ~2.7e8 finite. vLLM takes T < 1e-5 as greedy; HF's softmax gives NaN there.
GREEDY_BELOW = 2.0 ** -100


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 is greedy (bit-identical to argmax), as is any
    temperature below GREEDY_BELOW (2**-100); top_k 0, top_p 1 and min_p 0 are off. seed None:
    the engine gives one from its own seed."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16

    def __post_init__(self):
        for f in ("temperature", "top_p", "min_p"):
            _number(f, getattr(self, f), (int, float))
        for f in ("top_k", "max_new_tokens"):
            _number(f, getattr(self, f), (int,))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise _bad("top_k", self.top_k, "an int >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "in (0, 1] (1 = off)")
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "in [0, 1] (0 = off)")
        if self.seed is not None:
            _number("seed", self.seed, (int,))
            if not 0 <= self.seed <= SEED_MAX:
                raise _bad("seed", self.seed, f"None or an int in [0, 2**63 - 1]")
        if self.max_new_tokens < 1:
            raise _bad("max_new_tokens", self.max_new_tokens, "an int >= 1")
        if not isinstance(self.stop_token_ids, (tuple, list)) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0
                for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a tuple of ints >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# ------------------------------------------------------------------------------ the stream

def uniform(seed, position, purpose: int, index=0) -> torch.Tensor:
    """Uniform fp64 in [0, 1) with 53 random bits per key (broadcast over the key tensors)."""
    bits = random_bits(seed, position, purpose, index)
    return ((bits >> 11) & ((1 << 53) - 1)).double() * 2.0 ** -53


# ------------------------------------------------------------------------------- the sampler

def _check(logits, params: dict, position) -> None:
    """Shapes and dtypes only (host metadata: graph-safe); values are the caller's contract."""
    if logits.dim() != 2:
        raise pg.ContractValueError(mismatch("sample", "logits", "shape", "[n, V]",
                                                tuple(logits.shape)))
    if not logits.is_floating_point():
        raise pg.ContractTypeError(mismatch("sample", "logits", "dtype", "a float dtype",
                                               logits.dtype))
    n, V = logits.shape
    if V > kernels.V_MAX:
        raise pg.ContractValueError(mismatch("sample", "logits", "vocabulary size",
                                                f"<= {kernels.V_MAX}", V))
    wanted = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
              "min_p": torch.float32, "seed": torch.int64, "position": torch.int64}
    for name, t in {**params, "position": position}.items():
        if t is None:
            continue
        if tuple(t.shape) != (n,):
            raise pg.ContractValueError(mismatch("sample", name, "shape", f"[{n}]",
                                                    tuple(t.shape)))
        if t.dtype != wanted[name]:
            raise pg.ContractTypeError(mismatch("sample", name, "dtype", wanted[name],
                                                   t.dtype))
        if t.device != logits.device:
            raise pg.ContractValueError(mismatch("sample", name, "device", logits.device,
                                                    t.device))


def _scaled(logits, temperature):
    """d = x - max(x) [n, V] fp32 (see the module doc, step 1) and whether the row has mass."""
    x = logits.float() * _inv_t(temperature)[:, None]
    pinf = (x == float("inf")).any(-1, keepdim=True)
    x = _clean(x, pinf)
    d, live = _offset(x, x.amax(-1, keepdim=True))
    return d, live[:, 0]


def _inv_t(temperature) -> torch.Tensor:
    """1 / temperature per lane, fp32 IEEE (1 for greedy lanes), as the kernels divide."""
    return 1.0 / torch.where(temperature > 0, temperature, 1.0)


def _clean(x, pinf) -> torch.Tensor:
    """x with NaN as -inf, and in rows holding +inf (pinf) those at 0, the rest at -inf."""
    x = torch.where(torch.isnan(x), float("-inf"), x)
    return torch.where(pinf, torch.where(x == float("inf"), 0.0, float("-inf")), x)


def _offset(x, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(d = x - m, -inf where the row has no mass (m = -inf); live = m > -inf)."""
    live = m > float("-inf")
    return torch.where(live, x - torch.where(live, m, 0.0), float("-inf")), live


def _top_p_threshold(d_sorted, w_sorted, top_p) -> torch.Tensor:
    """[n, 1] the smallest d kept by top-p: the kept tokens are a prefix of the sorted row, those
    whose strictly-larger weight is < top_p * total (ties share the weight above their group)."""
    above = w_sorted.cumsum(-1) - w_sorted                            # [n, V] exclusive
    neg = (-d_sorted).contiguous()
    first = torch.searchsorted(neg, neg, right=False)                 # tie group's first slot
    above = above.gather(-1, first)
    total = w_sorted.sum(-1, keepdim=True)
    keep = above.double() < total.double() * top_p.double()[:, None]
    count = keep.sum(-1, keepdim=True).clamp_min(1)
    return d_sorted.gather(-1, count - 1)


def sampling_weights(logits, temperature, top_k, top_p, min_p):
    """(w [n, V] int64, the fixed-point weights `sample` draws in proportion to; live [n] bool,
    False where a sampled row has no mass). Greedy rows' weights are computed but unused."""
    d, live = _scaled(logits, temperature)
    n, V = d.shape
    w = fixed_exp(d)
    d_sorted, order = d.sort(-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).long()
    d_k = d_sorted.gather(-1, k[:, None] - 1)                         # [n, 1]
    w_sorted = torch.where(d_sorted >= d_k, w.gather(-1, order), 0)
    d_p = _top_p_threshold(d_sorted, w_sorted, top_p)
    cut = torch.where((top_p < 1)[:, None], torch.maximum(d_p, d_k), d_k)
    return _kept(d >= cut, w, min_p), live


def _kept(keep, w, min_p) -> torch.Tensor:
    """w where top-k / top-p keep it (keep [n, V], or [n] for one entry a row) and min-p does."""
    min_w = min_p.double().view(-1, *[1] * (w.dim() - 1)) * float(FIXED_ONE)
    keep = keep & (w.double() >= min_w)
    return torch.where(keep, w, 0)


def _weights_by_key(logits, temperature, top_k, top_p, min_p):
    """`sampling_weights` from the Triton sampler's key thresholds (`kernels.sample_stages`: each
    row's top-k / top-p key, found without sorting, and a pass only where the row filters; the
    draw it makes is discarded): keep the tokens whose key |d| is at most the row's."""
    n = logits.shape[0]
    zeros = torch.zeros(n, dtype=torch.int64, device=logits.device)
    kf = kernels.sample_stages(logits, temperature, top_k, top_p, min_p, zeros, zeros,
                               PURPOSE_DECODE).kf                       # [n] int64
    d, live = _scaled(logits, temperature)
    key = d.view(torch.int32) & 0x7FFFFFFF                             # the kernels' key of d
    return _kept(key <= kf[:, None], fixed_exp(d), min_p), live


def draw(w, u62) -> torch.Tensor:
    """The first index whose cumulative weight exceeds floor(u62 * Z / 2**62): [n] int64 from
    weights w [n, V] int64 (Z = their row sum < 2**62) and u62 [n] int64 in [0, 2**62)."""
    cum = w.cumsum(-1)
    r = mulhi62(u62, cum[:, -1])
    return torch.searchsorted(cum, r[:, None], right=True)[:, 0].clamp_max(w.shape[1] - 1)


def _sample_torch(logits, temperature, top_k, top_p, min_p, seed, position, purpose):
    w, live = sampling_weights(logits, temperature, top_k, top_p, min_p)
    u62 = (random_bits(seed, position, purpose) >> 2) & ((1 << 62) - 1)
    token = draw(w, u62)
    return torch.where((temperature > 0) & live, token, logits.argmax(-1))


def _sample_eager(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor,
                  position: torch.Tensor, purpose: int, impl: str) -> torch.Tensor:
    args = (logits, temperature, top_k, top_p, min_p, seed, position, purpose)
    if kernels.resolve_impl(impl, logits) == "triton":
        return kernels.sample_triton(*args)
    return _sample_torch(*args)


def _probs_eager(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, impl: str) -> torch.Tensor:
    args = (logits, temperature, top_k, top_p, min_p)
    by_key = kernels.resolve_impl(impl, logits) == "triton"
    w, live = _weights_by_key(*args) if by_key else sampling_weights(*args)
    probs = (w.double() / w.sum(-1, keepdim=True).clamp_min(1).double()).float()
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[1]).float()
    return torch.where(((temperature > 0) & live)[:, None], probs, onehot)


# Under torch.compile both are opaque ops, run eagerly at replay: inductor would otherwise fuse
# the reference's multiplies and adds into FMAs and change the integers the tokens come from.
_sample_op = torch.library.custom_op("padgraph::sample_tokens", _sample_eager, mutates_args=())
_sample_op.register_fake(lambda logits, *args: logits.new_empty(logits.shape[0],
                                                                dtype=torch.int64))
_probs_op = torch.library.custom_op("padgraph::sampling_probs", _probs_eager, mutates_args=())
_probs_op.register_fake(lambda logits, *args: logits.new_empty(logits.shape,
                                                               dtype=torch.float32))


def sample(logits, temperature, top_k, top_p, min_p, seed, position, purpose: int,
           impl: str = "auto") -> torch.Tensor:
    """Tokens [n] int64 from logits [n, V] (any float dtype) and per-lane parameters [n]
    (temperature/top_p/min_p fp32, top_k int32, seed int64), position [n] int64 (the absolute
    position of the token drawn), purpose a PURPOSE_* constant. The distribution and the stream
    are the module doc's; temperature 0 lanes return exactly logits.argmax(-1) (lanes built by
    `SamplingLanes.of` hold 0 for every greedy request, temperatures below GREEDY_BELOW
    included; a caller's own temperature tensor must do the same). Graph-safe.
    impl: "auto" (the Triton kernel on CUDA tensors, else torch), "triton", "torch"; both give
    the same tokens bit for bit."""
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    _check(logits, params, position)
    args = (logits, temperature, top_k, top_p, min_p, seed, position, int(purpose), impl)
    if torch.compiler.is_compiling():
        return _sample_op(*args)
    return _sample_eager(*args)


def sampling_probs(logits, temperature, top_k, top_p, min_p, impl: str = "auto") -> torch.Tensor:
    """[n, V] fp32: the distribution `sample` draws from (temperature 0 lanes and rows without
    mass: one-hot at logits.argmax(-1)). impl: "auto" (on CUDA tensors the top-k / top-p
    thresholds come from the Triton sampler's kernels, which skip the rows that do not filter;
    else the torch reference sorts every row), "triton", "torch"; both give the same values bit
    for bit."""
    _check(logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p), None)
    args = (logits, temperature, top_k, top_p, min_p, impl)
    return _probs_op(*args) if torch.compiler.is_compiling() else _probs_eager(*args)


# ---------------------------------------------------------------- speculative acceptance

def _draw_probs(p, u) -> torch.Tensor:
    """Inverse-CDF draw [n] from unnormalised probabilities p [n, V] (fp32/64, row sum > 0)
    with uniforms u [n] fp64; a zero-probability entry is never drawn."""
    cum = p.double().cumsum(-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_max(p.shape[1] - 1)


def _residual(p, q) -> torch.Tensor:
    """max(p - q, 0), or p itself where that has no mass (p == q: a rejection had probability
    0, only rounding gets here)."""
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def _at(t, idx) -> torch.Tensor:
    """t [n, V] at idx [n] -> [n]."""
    return t.gather(1, idx[:, None])[:, 0]


def verify_chain_sampled(target_probs, draft_tokens, draft_probs, seed, positions):
    """Speculative sampling over a chain of k drafts (MTP): (accept_len [bs] int32 = accepted
    drafts + 1, out_tokens [bs, k+1] int64 = the accepted drafts, then the token drawn at the
    first rejection (from norm(max(p - q, 0))) or, all accepted, the bonus drawn from the
    target at the leaf; entries past accept_len repeat the last emitted token).

    target_probs [bs, k+1, V] (`sampling_probs` of the target at each draft position and the
    bonus's), draft_tokens [bs, k], draft_probs [bs, k, V] the draft's distribution each draft
    was drawn from, or None: the drafts were proposed deterministically (q one-hot, so draft i
    is accepted with probability p_i(draft) / p_i's total, and a rejection's residual is p_i
    without the draft). Draft i is accepted iff u * q(c) < p(c), with u from the stream at
    (seed [bs], positions[:, i], PURPOSE_ACCEPT); draws use PURPOSE_RESIDUAL.
    positions [bs, k+1] int64: the absolute position of each emitted token. The emitted tokens
    follow the target's distribution exactly, whatever the draft; greedy targets (one-hot at the
    argmax) accept a draft iff it equals the argmax, as greedy verification does. With
    draft_probs None the only [bs, V] work is the one draw at the end of each row."""
    if draft_probs is None:
        return _chain_one_hot(target_probs, draft_tokens, seed, positions)
    bs, k = draft_tokens.shape
    alive = torch.ones(bs, dtype=torch.bool, device=draft_tokens.device)
    n_acc = torch.zeros(bs, dtype=torch.int32, device=draft_tokens.device)
    outs = []
    for i in range(k + 1):
        p = target_probs[:, i].double()
        u = uniform(seed, positions[:, i], PURPOSE_RESIDUAL)
        if i == k:                                                   # bonus from the leaf
            outs.append(torch.where(alive, _draw_probs(p, u), outs[-1]))
            break
        c = draft_tokens[:, i].long()
        q = draft_probs[:, i].double()
        ok = uniform(seed, positions[:, i], PURPOSE_ACCEPT) * _at(q, c) < _at(p, c)
        fix = _draw_probs(_residual(p, q), u)
        tok = torch.where(ok, c, fix)
        outs.append(torch.where(alive, tok, outs[-1]) if i else tok)
        n_acc += (alive & ok).int()
        alive = alive & ok
    return n_acc + 1, torch.stack(outs, 1)


def _chain_one_hot(target_probs, draft_tokens, seed, positions):
    """`verify_chain_sampled` for deterministic drafts: every test is a scalar per row; the row's
    one draw (at its first rejection, or the bonus) is the only [bs, V] work."""
    bs, k = draft_tokens.shape
    c = draft_tokens.long()
    rows = torch.arange(bs, device=c.device)[:, None]
    p_c = target_probs[rows, torch.arange(k, device=c.device), c].double()       # [bs, k]
    total = target_probs[:, :k].sum(-1, dtype=torch.float64)                     # [bs, k]
    u = uniform(seed[:, None], positions[:, :k], PURPOSE_ACCEPT)                 # [bs, k]
    ok = u * total < p_c
    n_acc = ok.int().cumprod(1).sum(1).int()                         # [bs] accepted drafts
    at = n_acc.long()                                                # the row's draw: k = bonus
    rejected = (torch.arange(k, device=c.device) == at[:, None])    # [bs, k] the draft it replaces
    drawn = _draw_excluding(_row(target_probs, at), c, rejected,
                            uniform(seed, positions.gather(1, at[:, None])[:, 0],
                                    PURPOSE_RESIDUAL))
    emitted = torch.cat([c, drawn[:, None]], 1)                      # [bs, k+1]
    col = torch.arange(k + 1, device=c.device)
    return n_acc + 1, torch.where(col < at[:, None], emitted, drawn[:, None])


def verify_tree_sampled(tokens, tree_mask, target_probs, draft_probs, seed, positions,
                        steps: int):
    """Speculative sampling over an EAGLE tree (recursive rejection over siblings, as SpecInfer's
    multi-candidate verification): (accept_len [bs] int32, accept_index [bs, steps+1] int64,
    out_tokens [bs, steps+1] int64), the same layout as `eagle.verify_greedy` (accept_index
    repeats the last node past accept_len; out_tokens holds the emitted tokens, then repeats the
    last one). The caller commits accept_index to the KV as for greedy verification.

    tokens [bs, k] (node 0 the root), tree_mask [bs, k, k] (node i sees its ancestors), the
    target's distribution after each node target_probs [bs, k, V] (`sampling_probs`).
    Walking down from the root, the children of the current node are tried in node order: child
    c is accepted iff u * q(c) < p(c), u from (seed, positions[:, depth], PURPOSE_ACCEPT, node);
    on rejection p <- norm(max(p - q, 0)) and q <- q without c, renormalised. draft_probs None:
    the children were proposed deterministically (the draft's top-k), q is one-hot at each
    child in turn, so child c is accepted with probability p(c) / (the mass of p its rejected
    siblings left; a repeat of a rejected sibling's token has none) and a rejection zeroes p(c):
    scalars per row, with one [bs, V] draw a row at the end. draft_probs [bs, k, V]: the
    children of node i were drawn without replacement from draft_probs[:, i] (a child past the
    tokens q gives mass is tried as a deterministic proposal). If no child is
    accepted (or there is none), the token is drawn from the residual p (PURPOSE_RESIDUAL),
    ending the path; after `steps` accepted levels the bonus is drawn from the target at the
    leaf. The emitted tokens follow the target's distribution exactly; a greedy target
    (one-hot) gives `verify_greedy`'s result."""
    if draft_probs is None:
        return _tree_one_hot(tokens, tree_mask, target_probs, seed, positions, steps)
    bs, k = tokens.shape
    parent = _tree_parents(tree_mask)                                # [bs, k]
    cur = torch.zeros(bs, dtype=torch.long, device=tokens.device)
    alive = torch.ones(bs, dtype=torch.bool, device=tokens.device)
    path, outs = [cur], []
    for depth in range(steps + 1):
        pos = positions[:, depth]
        p, q = _row(target_probs, cur), _row(draft_probs, cur)
        found, nxt = torch.zeros_like(alive), cur
        if depth < steps:
            found, nxt, p = _try_children(tokens, parent, cur, alive, p, q, seed, pos)
        tok = torch.where(found, _at(tokens, nxt), _draw_probs(p, uniform(seed, pos,
                                                                           PURPOSE_RESIDUAL)))
        outs.append(torch.where(alive, tok, outs[-1]) if depth else tok)
        alive, cur = alive & found, nxt
        if depth < steps:
            path.append(cur)
    return _tree_result(path, torch.stack(outs, 1))


def _tree_result(path, out_tokens):
    """(accept_len, accept_index, out_tokens) from the walked nodes [bs] per depth."""
    accept_index = torch.stack(path, 1)
    accept_len = 1 + torch.stack(path[1:], 1).ne(torch.stack(path[:-1], 1)).sum(1)
    return accept_len.int(), accept_index, out_tokens


def _tree_one_hot(tokens, tree_mask, target_probs, seed, positions, steps: int):
    """`verify_tree_sampled` for deterministic children, from every node's distribution: each
    child's probability under its parent's and the parent's mass, then `_tree_walk`."""
    bs, k = tokens.shape
    tok = tokens.long()
    parent = _tree_parents(tree_mask)                                # [bs, k]
    up = parent.clamp_min(0)
    rows = torch.arange(bs, device=tok.device)[:, None]
    p_c = target_probs[rows, up, tok].double()                      # [bs, k] p_parent(c)
    total = target_probs.sum(-1, dtype=torch.float64).gather(1, up)  # [bs, k] the parent's mass
    return _tree_walk(tok, parent, p_c, total, lambda cur: _row(target_probs, cur), seed,
                      positions, steps)


def _tree_walk(tok, parent, p_c, total, row_at, seed, positions, steps: int):
    """The deterministic-children rule from per-child scalars: p_c [bs, k] each child's
    probability under its parent's distribution, total [bs, k] that parent's mass, row_at(node
    [bs]) -> [bs, V] fp64 the distribution at a node (read once, where the walk stops). Tried in
    node order, child j is tried only after every earlier sibling was rejected, so whether it
    would be accepted is fixed before the walk: u * (total - removed) < p(c), removed the mass
    of the earlier siblings' distinct tokens (all [bs, k] scalars). The walk then takes, per
    level, the first accepted child; the row's one draw excludes every child of the node it
    stopped at."""
    bs, k = tok.shape
    ok = _children_accepted(tok, parent, p_c, total, seed, positions, steps)   # [bs, steps, k]
    cur = torch.zeros(bs, dtype=torch.long, device=tok.device)
    alive = torch.ones(bs, dtype=torch.bool, device=tok.device)
    node = torch.arange(k, device=tok.device)
    path = [cur]
    for depth in range(steps):
        hit = ok[:, depth] & (parent == cur[:, None]) & alive[:, None]        # [bs, k]
        found = hit.any(1)
        cur = torch.where(found, torch.where(hit, node, k).amin(1), cur)
        alive = alive & found
        path.append(cur)
    n_acc = torch.stack(path[1:], 1).ne(torch.stack(path[:-1], 1)).sum(1)  # [bs] accepted levels
    rejected = (parent == cur[:, None]) & ~alive[:, None]            # the stop node's children
    drawn = _draw_excluding(row_at(cur), tok, rejected,
                            uniform(seed, positions.gather(1, n_acc[:, None])[:, 0],
                                    PURPOSE_RESIDUAL))
    emitted = torch.cat([tok.gather(1, torch.stack(path[1:], 1)), drawn[:, None]], 1)
    col = torch.arange(steps + 1, device=tok.device)
    return _tree_result(path, torch.where(col < n_acc[:, None], emitted, drawn[:, None]))


def _children_accepted(tok, parent, p_c, total, seed, positions, steps: int):
    """[bs, steps, k]: whether child j would be accepted when tried at depth d (its keys are
    (seed, positions[:, d], PURPOSE_ACCEPT, j)), given that its earlier siblings were rejected;
    p_c and total as `_tree_walk`'s."""
    bs, k = tok.shape
    node = torch.arange(k, device=tok.device)
    has = parent >= 0
    repeat = torch.zeros(bs, k, dtype=torch.bool, device=tok.device)
    removed = torch.zeros(bs, k, dtype=torch.float64, device=tok.device)
    for i in range(1, k):     # sibling i's mass leaves its later siblings', added in node order
        later = has & (parent == parent[:, i:i + 1]) & (node > i)   # [bs, k]
        removed = removed + torch.where(later & ~repeat[:, i:i + 1], p_c[:, i:i + 1], 0.0)
        repeat = repeat | (later & (tok == tok[:, i:i + 1]))        # a repeat removes nothing
    p_c = torch.where(repeat, 0.0, p_c)
    u = uniform(seed[:, None, None], positions[:, :steps, None], PURPOSE_ACCEPT, node)
    return has[:, None] & (u * (total - removed)[:, None] < p_c[:, None])


def _child_probs_eager(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor, rows: torch.Tensor,
                       tokens: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    lanes = (logits, temperature, top_k, top_p, min_p)
    if kernels.resolve_impl(impl, logits) != "triton":
        probs = _probs_eager(*lanes, impl)
        return probs[rows, tokens].double(), probs.sum(-1, dtype=torch.float64)[rows]
    zeros = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    stages = kernels.sample_stages(*lanes, zeros, zeros, PURPOSE_DECODE)
    kf = stages.kf                                                           # [n] int64
    mass = kernels.node_mass(logits, temperature, kf, min_p)
    x = _clean(logits[rows, tokens].float() * _inv_t(temperature)[rows], mass.pinf[rows])
    d, live = _offset(x, mass.m[rows])                                       # as `_scaled`, per pair
    w = _kept((d.view(torch.int32) & 0x7FFFFFFF) <= kf[rows], fixed_exp(d), min_p[rows])
    p = (w.double() / mass.z[rows].double()).float().double()
    sampled = (temperature[rows] > 0) & live
    # a row the sampler does not sample (greedy, or no mass) gets torch's argmax from it
    onehot = (tokens == stages.tokens[rows]).double()
    return (torch.where(sampled, p, onehot),
            torch.where(sampled, mass.total[rows], torch.ones_like(mass.total[rows])))


# Opaque under torch.compile, as `_probs_op` (inductor would fuse the fixed-point steps into FMAs).
_child_probs_op = torch.library.custom_op("padgraph::child_probs", _child_probs_eager,
                                          mutates_args=())


@_child_probs_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, rows, tokens, impl):
    return rows.new_empty(rows.shape, dtype=torch.float64), rows.new_empty(rows.shape, dtype=torch.float64)


def child_probs(logits, temperature, top_k, top_p, min_p, rows, tokens, impl: str = "auto"):
    """(p [m] fp64, total [m] fp64): p[j] = `sampling_probs(logits, ...)[rows[j], tokens[j]]`
    (its fp32 value) and total[j] that row's fp64 sum, without building the [n, V]
    distribution where the Triton kernels run (`node_mass`: a row's max, kept weight and mass
    in one launch, then each pair from its own logit; the same p bit for bit, total up to the
    order of an fp64 sum). impl as `sampling_probs`'."""
    _check(logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p), None)
    args = (logits, temperature, top_k, top_p, min_p, rows.long(), tokens.long(), impl)
    return _child_probs_op(*args) if torch.compiler.is_compiling() else _child_probs_eager(*args)


def verify_tree_logits(tokens, tree_mask, logits, temperature, top_k, top_p, min_p, seed,
                       positions, steps: int, impl: str = "auto"):
    """`verify_tree_sampled` with deterministic children from the target's logits [bs * k, V]
    (request b's node j at row b * k + j; lanes [bs * k] likewise) instead of every node's
    distribution: each child's probability under its parent and the parent's mass from
    `child_probs`, and one `sampling_probs` row a request, where the walk stops. The same result as
    `verify_tree_sampled(tokens, tree_mask, sampling_probs(logits, ...).view(bs, k, V), None,
    ...)`, up to the order of the fp64 sum of a node's mass."""
    bs, k = tokens.shape
    tok = tokens.long()
    parent = _tree_parents(tree_mask)                                # [bs, k]
    base = torch.arange(bs, device=tok.device)[:, None] * k
    p_c, total = child_probs(logits, temperature, top_k, top_p, min_p,
                             (base + parent.clamp_min(0)).reshape(-1), tok.reshape(-1), impl)

    def row_at(cur):
        r = base[:, 0] + cur
        return sampling_probs(logits[r], temperature[r], top_k[r], top_p[r], min_p[r],
                              impl).double()
    return _tree_walk(tok, parent, p_c.view(bs, k), total.view(bs, k), row_at, seed, positions,
                      steps)


def _draw_excluding(p, tok, excluded, u) -> torch.Tensor:
    """`_draw_probs` from p [bs, V] with the tokens tok [bs, m] where excluded [bs, m] set to 0
    (p itself where nothing would remain), uniforms u [bs] fp64."""
    cut = torch.where(excluded, 0.0, float("inf")).to(p.dtype)
    r = p.scatter_reduce(1, tok, cut, "amin")                        # repeats: order-free
    return _draw_probs(torch.where(r.sum(-1, keepdim=True) > 0, r, p), u)


def _row(t, node) -> torch.Tensor:
    """t [bs, k, V] at node [bs] -> [bs, V] fp64."""
    return t.gather(1, node[:, None, None].expand(-1, 1, t.shape[2]))[:, 0].double()


def _try_children(tokens, parent, cur, alive, p, q, seed, pos):
    """Recursive rejection over cur's children in node order, each drawn from q: (found [bs],
    the accepted node [bs] (cur where none), the residual target p [bs, V] after the
    rejections). A child q gives no mass (the draft had fewer tokens with mass than children,
    so its earlier children used them all up) was not drawn from q: it is tried as a
    deterministic proposal, q one-hot at it (accepted with probability p(c), p(c) zeroed on
    rejection); testing u * 0 < p(c) would accept it whenever p(c) > 0."""
    found, nxt = torch.zeros_like(alive), cur
    for j in range(1, tokens.shape[1]):
        child = (parent[:, j] == cur) & alive & ~found
        c = tokens[:, j].long()
        fixed = (_at(q, c) <= 0)[:, None]
        qc = torch.where(fixed, torch.nn.functional.one_hot(c, q.shape[1]).to(q.dtype), q)
        ok = child & (uniform(seed, pos, PURPOSE_ACCEPT, j) * _at(qc, c) < _at(p, c))
        found, nxt = found | ok, torch.where(ok, j, nxt)
        rej = child & ~ok
        p = torch.where(rej[:, None], _normalised(_residual(p, qc)), p)
        q = torch.where(rej[:, None] & ~fixed, _without(q, c), q)
    return found, nxt, p


def _tree_parents(tree_mask) -> torch.Tensor:
    """Parent node of each node: the deepest strict ancestor in the mask, -1 if none [bs, k]."""
    k = tree_mask.shape[1]
    idx = torch.arange(k, device=tree_mask.device)
    strict = tree_mask.bool() & (idx[None, :] < idx[:, None])
    return torch.where(strict, idx, -1).amax(dim=2)


def _normalised(p) -> torch.Tensor:
    return p / p.sum(-1, keepdim=True)


def _without(q, c) -> torch.Tensor:
    """q with token c [n] removed and renormalised (q itself where nothing would remain)."""
    r = q.scatter(1, c[:, None], 0.0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(1e-300), q)
