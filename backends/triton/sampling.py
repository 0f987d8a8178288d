"""The sampler in Triton, and the integer pieces it shares bit for bit with the torch
reference (`padgraph.llm.sampling`, whose module doc defines the distribution).

Why the pieces are integers: a sampler whose tokens must be the same in torch and in a kernel
cannot let the order of a floating-point sum decide anything. So the weights are fixed-point
integers (`fixed_exp`: floor(exp(d) * 2**40) from IEEE adds and multiplies only, no library
exp, whose last bit differs between implementations), every threshold compares integer sums
(exact in any order) in fp64, and the draw is an integer search (`mulhi62`). The random stream
(`random_bits`, splitmix64's finaliser over the key words) is int64 arithmetic with wrap-around
multiplies and logical shifts written as masked arithmetic shifts, the same in both.

The thresholds are keys: key = the fp32 bits of |d|, d = x - max(x) <= 0, monotone (a smaller
key is a larger d, ties share a key). top-k keeps the keys up to the k-th smallest; top-p keeps
the keys up to K, the smallest key whose kept-by-top-k keys at or below it weigh at least
top_p * their total (the reference's prefix rule, in fp64). Both are found by narrowing a
bracket of keys with counts and integer weights summed over chunks, so they are exact.

1 + PASSES launches a call, whatever the logits hold; each row finds its own way through them
(one batch mixes greedy, temperature-only and filtered rows):

1. `_chunk_max_kernel`, grid (n, C chunks of CHUNK logits): each chunk's share of torch's argmax
   (greedy rows) and of max(x), x = l * (1 / temperature); it also clears the row's counters.
2. `_select_kernel`, PASSES launches, grid (G row groups, X chunk groups): program (g, x) does
   chunks x, x + X, ... of rows g, g + G, ... (X = C: a chunk a program). In each pass a row
   is in one mode; every program of the row does its chunk's share, and the last one to finish
   (a per-row counter, acq_rel) reads the chunks' shares and sets the row's next mode:
   - greedy (first launch only): torch's argmax from the chunk shares.
   - K_HIST, top-k's key by radix select: a 256-bin count histogram per chunk of one 8-bit
     digit of the keys in the bracket, the bin where the count reaches k becomes the bracket.
   - K_GATHER: at most CAP keys lie at or below the bracket: they are gathered, top-k's key and
     then top-p's are found among them in registers.
   - P_SPLIT, top-p's key: the bracket is split into 16 intervals (on the first split a fixed
     table, fine where a flat row's nucleus ends: |d| in [1, 2), quarters of [2, 8), halves of
     [8, 16); then 16 equal parts); each chunk sums, below each interval's end, the count and
     the weight of its keys; the interval where the weight reaches top_p * total becomes the
     bracket, narrowed to the keys present.
   - P_GATHER: a bracket of at most CAP keys: gathered, top-p's key found among them.
   The searches over gathered keys run in registers as wide as the gather needs: [SMALL] for
   at most SMALL keys (a sharp row's nucleus), else [CAP].
   - P_HIST: a bracket at most 256 keys wide: a count per key, its weight count * fixed_exp.
   - WEIGHTS: each chunk's kept weight (threshold and min-p applied); the last program draws:
     r = floor(u * Z / 2**62), the chunk whose cumulative kept weight passes r, the index in it.
     A row whose threshold was found in a gather (K_GATHER, P_GATHER) draws in that pass
     instead, when min-p is off and the launch asks for it (`SelectPolicy.gather_draw`): a
     chunk's kept weight is then its weight below the bracket (each P_SPLIT adds the chunk's
     weight below the new bracket to CBase) plus that of its gathered keys up to the
     threshold (one run of the buffer, whose span the chunk records).
   A chunk with no key in the new bracket skips the next pass. Top-k takes at most 4 passes
   (31 bits), top-p at most 7 (the table's intervals span at most 2**28 keys, five equal splits
   leave 256), the draw 1: PASSES = 12. A pass whose rows are all done costs its programs one
   load each. G, X, the warps of a program and whether a gather draws are
   `select_policy(n)`'s.

The kernels are in two modules: `sampling_chunks` holds the chunk-max kernel and what a
program does for one chunk of a row, and `sampling_rows` holds what a row's last program does
with its chunks' shares, plus the select kernel. The integer pieces that the torch reference
shares are in `sampling_ints`.

There is no host work and no sync: graph-safe. The result does not depend on the order in
which chunks finish (integer sums, the gathered keys searched as a set). The kernels are
launched with fp contraction off, so a*b+c is never an FMA and the fp32 steps round as torch's
do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl as _pdl
from .kv import resolve_impl
from .sampling_chunks import MODES, NSTATE_K, PASS_ONE, _chunk_max_kernel
from .sampling_ints import (FIXED_ONE, PURPOSE_ACCEPT, PURPOSE_DECODE, PURPOSE_DRAFT,
                            PURPOSE_RESIDUAL, V_MAX, _weights, fixed_exp, mulhi62, random_bits)
from .sampling_rows import _select_kernel

__all__ = ["PURPOSE_DECODE", "PURPOSE_ACCEPT", "PURPOSE_RESIDUAL", "PURPOSE_DRAFT",
           "FIXED_ONE", "V_MAX", "PASSES", "MODES", "random_bits", "fixed_exp", "mulhi62",
           "sample_triton", "sample_stages", "Stages", "node_mass", "NodeMass", "resolve_impl"]

PASSES = 12         # top-k <= 4 passes, top-p <= 7, the draw 1 (module doc)
CHUNK = 2048
CAP = 4096          # keys a row may gather
SMALL = 256         # a gather of at most SMALL keys is searched in [SMALL] registers, not [CAP]
PACK = 128          # a chunk with at most PACK keys to split packs them before its 16 sums
PROGRAMS = 512      # a select pass launches about this many programs where the rows need more
SUB = 256           # keys a P_SPLIT step holds at once ([SUB, 16] sums)
CHUNK_WARPS = 4
SELECT_REGS = 128   # ptxas fits the select pass without spilling
STATE_FIELDS = ("mode", "lo", "hi", "shift", "fresh", "base", "zk", "kf", "sel", "trace")


class Stages(NamedTuple):
    """What the kernels leave for a call: the tokens, and each row's final state (for tests):
    kf its key threshold (KEY_INF: none), mode (0, done, once every pass ran), its trace; from
    the trace, on access only (so a call that reads the tokens launches nothing more), the
    modes it went through (bit 1 << i for MODES[i]) and the number of passes it took."""
    tokens: torch.Tensor      # [n] int64
    kf: torch.Tensor          # [n] int64
    mode: torch.Tensor        # [n] int64
    trace: torch.Tensor       # [n] int64: the modes' bits, plus PASS_ONE a pass

    @property
    def modes(self) -> torch.Tensor:
        return self.trace & (PASS_ONE.value - 1)

    @property
    def passes(self) -> torch.Tensor:
        return self.trace // PASS_ONE.value


class SelectPolicy(NamedTuple):
    """How the select passes launch for a batch (`select_policy`)."""
    groups: int           # G: the grid is (G, C); program (g, c) works through rows g, g + G, ..
    warps: int            # num_warps of a select program
    gather_draw: bool     # a threshold found in a gather draws in that pass (min-p off)
    pdl: bool = True      # the launches with programmatic dependent launch (where supported)
    chunk_groups: int = 0  # X: the grid is (G, min(X, C)); program (g, x) does chunks x,
                           # x + X, .. of its rows (0: X = C, a chunk a program)


def select_policy(n: int) -> SelectPolicy:
    """The select passes' launch for n rows, from a sweep on an H200 at a 128256-token
    vocabulary (CUDA-graph replays; results/sampling.md, its launch sweep). A program
    works through its rows one after another, each a chain of dependent loads, atomics and
    reductions, so at 16 and 64 rows more programs of 4 warps beat fewer of 8:
    - 64 rows, sharp top-p: G 64 / 32 / 16 at 4 warps 216 / 223 / 243 µs; the launch before
      (four programs an SM: G 9, 8 warps) 384; greedy rows 83 / 65 / 56 against 65: G = n // 2
      above 16 rows;
    - 16 rows: G 16 at 4 warps 109 µs, G 8 128, the launch before 136;
    - 1 row: 4 warps 99 µs against 8 warps' 76.
    The draw in the gather saves a pass where rows wait on each other (16 rows: 118 against
    127 µs, 64 rows: 296 against 338, at G = n, 8 warps) and costs one row alone about 7 µs of
    serial work (76 against 69), so it is taken from 16 rows on.
    PDL on (an H100, the same sweep): 31.5 -> 23.7 µs greedy and 73.5 -> 66.0 sharp top-p at
    1 row, 43.1 -> 39.3 and 111.4 -> 107.3 at 16, within 1 µs either way at 64 (65.8 -> 66.8,
    224.8 -> 226.5): each pass's launch overlaps the tail of the one before.
    Chunk groups (an H100, `--sweep --fields chunk_groups`, 2026-12-06): at most PROGRAMS
    programs a pass (about four of 4 warps an SM on 132 SMs), each doing C / X chunks of its
    rows: a pass over rows that are all done then launches 512 programs instead of G * C (the
    12 passes cost that whatever the rows need). At 64 rows (G 32) X 16 / 32 / 63 gave
    greedy 41.1 / 48.5 / 63.9 µs, sharp top-p 156.7 / 162.5 / 176.2, flat 391.7 / 394.4 /
    404.0, and X 8 is slower (238 sharp, too few programs); at 16 rows (G 16) X 32 / 16 / 63
    gave 27.3 / 26.4 / 35.4 greedy, 75.6 / 94.0 / 82.7 sharp, 157.2 / 221.2 / 164.3 flat; one
    row keeps a program a chunk (63 programs)."""
    many = n >= 16
    groups = max(1, n if n <= 16 else n // 2)
    return SelectPolicy(groups=groups, warps=4 if many else 8, gather_draw=many,
                        chunk_groups=max(1, PROGRAMS // groups))


def sample_stages(logits, temperature, top_k, top_p, min_p, seed, position, purpose: int,
                  chunk: int = CHUNK, cap: int = CAP, groups: int | None = None,
                  warps: int | None = None, gather_draw: bool | None = None,
                  pdl: bool | None = None, regs: int | None = None,
                  small: int | None = None, pack: int | None = None,
                  chunk_groups: int | None = None) -> Stages:
    """`sample_triton`'s launches and the rows' final state. chunk and cap: powers of two;
    groups, warps, gather_draw, pdl, chunk_groups: `SelectPolicy`'s fields (`select_policy(n)`'s
    where None; the tokens are the same whatever they are); regs: the select kernel's register cap
    (maxnreg, at most 255; SELECT_REGS where None). At 4 warps SELECT_REGS makes ptxas spill
    (504 bytes of stack a thread for Triton 3.9's sm_90 code, none at 8 warps), which a launch
    sweep weighs against the occupancy a higher cap costs. pdl: the 1 + PASSES launches with
    programmatic dependent launch where `pdl.supported` (each waits for the one before before
    any read), so a pass's launch overlaps the end of the one before. small: a gather of at
    most this many keys (a power of two; SMALL where None, at most cap) ends in registers of
    that size instead of cap's: the searches over the gathered keys cost in proportion to the
    registers they span, and a sharp row gathers a few keys. pack: a split of a chunk where at
    most this many keys can weigh packs them before its 16 sums (a power of two; PACK where
    None; 0: never), so a sharp row's split costs in proportion to its few such keys."""
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n, V = x.shape
    lanes = [t.contiguous() for t in (temperature, top_k, top_p, min_p, seed, position)]
    C = triton.cdiv(V, chunk)
    CP = triton.next_power_of_2(C)

    def buf(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device=x.device)

    parts = (buf(n, C, dtype=torch.float32), buf(n, C, dtype=torch.int32),
             buf(n, C, dtype=torch.int32), buf(n, C, dtype=torch.float32))
    state = buf(n, NSTATE_K.value, dtype=torch.int64)
    work = (buf(n, C, 256, dtype=torch.int32), buf(n, C, 16, dtype=torch.int32),
            buf(n, C, 16, dtype=torch.int64), buf(n, C, 2, dtype=torch.int32),
            buf(n, C, dtype=torch.int64), buf(n, cap, dtype=torch.int32))
    span, cbase, pref = (buf(n, C, 2, dtype=torch.int32), buf(n, C, dtype=torch.int64),
                         buf(n, cap, dtype=torch.int64))
    pack_size = PACK if pack is None else pack
    packs = buf(n, C, max(pack_size, 1), dtype=torch.int32)
    count, arrive = buf(n, PASSES, dtype=torch.int32), buf(n, PASSES, dtype=torch.int32)
    out = buf(n, dtype=torch.int64)
    policy = select_policy(n)
    on = (policy.pdl if pdl is None else pdl) and _pdl.supported(x.device)
    launch = dict(PDL=on, **_pdl.launch_options(x.device, on))
    if n:
        _chunk_max_kernel[(n, C)](x, x.stride(0), lanes[0], *parts, count, arrive, cbase, V, C,
                                  PASSES,
                                  CHUNK=chunk, SP=triton.next_power_of_2(PASSES),
                                  num_warps=CHUNK_WARPS, enable_fp_fusion=False, **launch)
    G = groups or policy.groups
    X = min(C, (policy.chunk_groups if chunk_groups is None else chunk_groups) or C)
    for s in range(PASSES if n else 0):
        _select_kernel[(G, X)](x, x.stride(0), *lanes, *parts, state, *work, count, span, cbase,
                               pref, packs, arrive, out,
                               n, V, C, PASSES, purpose, s, FIRST=s == 0, CHUNK=chunk,
                               SUB=max(min(chunk, SUB), chunk // 8), CP=CP, CAP=cap,
                               SMALL=min(cap, small or SMALL), PACK=min(pack_size, chunk),
                               DRAW=policy.gather_draw if gather_draw is None else gather_draw,
                               num_warps=warps or policy.warps, maxnreg=regs or SELECT_REGS,
                               enable_fp_fusion=False, **launch)
    return Stages(out, *(state[:, STATE_FIELDS.index(f)] for f in ("kf", "mode", "trace")))


@triton.jit
def _node_mass_kernel(L, stride_l, Temp, Kf, MinP, M, Pinf, Z, Total, V,
                      BLOCK: tl.constexpr):
    """Grid (n,). One row's kept weight under its thresholds, in three passes over its logits:
    max(x) (x = l * (1 / temperature), NaN as -inf, as `_chunk_max_kernel`), Z = the sum of the
    kept integer weights (`_weights`: key <= kf, min-p), and the fp64 sum of the fp32
    probabilities w / Z (what `padgraph.llm.sampling.sampling_probs` writes, summed)."""
    row = tl.program_id(0)
    l_ptr = L + row.to(tl.int64) * stride_l
    temp = tl.load(Temp + row)
    inv_t = tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=1):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(l_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        mx = tl.maximum(mx, tl.where(x != x, float("-inf"), x))
    m = tl.max(mx, axis=0)
    pinf = m == float("inf")
    m = tl.where(pinf, 0.0, m)
    kf = tl.load(Kf + row).to(tl.int32)
    min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0        # min_p * 2**40
    z = tl.zeros([BLOCK], dtype=tl.int64)
    for start in tl.range(0, V, BLOCK, num_stages=1):
        z += _weights(l_ptr, start + tl.arange(0, BLOCK), V, inv_t, m, pinf, kf, min_w)
    zsum = tl.maximum(tl.sum(z, axis=0), 1)
    zf = zsum.to(tl.float64)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for start in tl.range(0, V, BLOCK, num_stages=1):
        w = _weights(l_ptr, start + tl.arange(0, BLOCK), V, inv_t, m, pinf, kf, min_w)
        acc += (w.to(tl.float64) / zf).to(tl.float32).to(tl.float64)
    tl.store(M + row, m)
    tl.store(Pinf + row, pinf.to(tl.int8))
    tl.store(Z + row, zsum)
    tl.store(Total + row, tl.sum(acc, axis=0))


class NodeMass(NamedTuple):
    """`node_mass`'s per-row results."""
    m: torch.Tensor           # [n] fp32: max(x), 0 where it is +inf (as the kernels use it)
    pinf: torch.Tensor        # [n] bool: some x is +inf
    z: torch.Tensor           # [n] int64: the kept weights' sum, at least 1
    total: torch.Tensor       # [n] fp64: the sum of the fp32 probabilities w / z


def node_mass(logits, temperature, kf, min_p, block: int = 2048) -> NodeMass:
    """Per row, what a token's probability under the row's sampling distribution needs besides
    its own logit: the row's max, its kept weight and the fp64 sum of its fp32 probabilities.
    kf: the rows' key thresholds (`sample_stages(...).kf`). One launch, three reads of each
    row; no [n, V] tensor is written. The speculative rule's per-node mass (the alternative
    builds every node's whole distribution)."""
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n, V = x.shape
    dev = x.device
    out = NodeMass(torch.empty(n, dtype=torch.float32, device=dev),
                   torch.empty(n, dtype=torch.int8, device=dev),
                   torch.empty(n, dtype=torch.int64, device=dev),
                   torch.empty(n, dtype=torch.float64, device=dev))
    if n:
        _node_mass_kernel[(n,)](x, x.stride(0), temperature.contiguous(), kf.contiguous(),
                                min_p.contiguous(), *out, V, BLOCK=min(block, triton.next_power_of_2(V)),
                                num_warps=CHUNK_WARPS, enable_fp_fusion=False)
    return out._replace(pinf=out.pinf.bool())


def sample_triton(logits, temperature, top_k, top_p, min_p, seed, position, purpose: int,
                  chunk: int = CHUNK, cap: int = CAP) -> torch.Tensor:
    """`padgraph.llm.sampling.sample` in Triton, the same tokens bit for bit (arguments as
    there, checked there). 1 + PASSES launches whatever the logits hold, no host work (module
    doc). chunk: logits a program reads; cap: keys a row may gather; powers of two."""
    return sample_stages(logits, temperature, top_k, top_p, min_p, seed, position, purpose,
                         chunk, cap).tokens
