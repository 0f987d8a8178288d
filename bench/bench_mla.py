"""Benchmark absorbed MLA over a paged latent cache: ours vs an SDPA-based absorbed MLA vs a copy.

    python -m bench.bench_mla               # DeepSeek-V2-Lite: 16 heads, r 512, rope 64
    python -m bench.bench_mla --heads 128   # DeepSeek-V3-like head count
    python -m bench.bench_mla --smoke       # CPU, tiny sizes, interpreter: checks the script

bf16, every request at full length, slots shuffled.
- decode: bs {1, 8, 32} x context {1024, 8192, 32768};
- tree verify (k = 8 drafts, a random tree) and draft-extend (6 new tokens, causal) at
  bs {1, 8, 32} x context {1024, 8192};
- a small tile / split sweep of the decode kernel (each configuration captured in a CUDA graph,
  as padgraph runs it: eager times count launches and misled the policy before).
The peer ("sdpa") is torch's SDPA over the *same latent cache* as a contiguous
[bs, 1, ctx, r + rope] tensor, absorbed form: the bs requests' n_q x H (query, head) rows are
SDPA's query axis of one head, keys = the latent rows, values = their first r columns (a view), the equivalent boolean mask for
verify / extend; the fastest backend that runs and agrees (flash / cuDNN / efficient, else math).
Timed as CUDA-graph replays with `triton.testing.do_bench` (median; L2 flushed before each call).
Bytes = latent rows + req_to_token + q_latent + o_latent; "fraction" = (bytes / time) over the
device-to-device copy bandwidth measured in the same run (read + write). Checked against the
torch path first. Writes mla.md / mla.json (mla_h<heads>.* for other head counts) to $OUT.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback
from typing import NamedTuple

if "--smoke" in sys.argv:  # before triton is imported: kernels run interpreted on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import einops  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


from bench.common import env_info, out_dir  # noqa: E402
from bench.bench_attention import (bench_us, best_sdpa_backend, copy_bandwidth, graph_of,  # noqa: E402
                             random_tree_masks, rel_err)
from padgraph.backends.triton.attention_mla import (  # noqa: E402
    mla_decode_attention, mla_extend_attention, mla_sm_scale, mla_tree_verify_attention)
from padgraph.backends.triton.attention_meta import PagedMeta  # noqa: E402
from padgraph.backends.triton.attention_mla_decode import (  # noqa: E402
    MlaPolicy, MlaShape, mla_paged_attention, plan_mla)

KV_LORA_RANK, ROPE, NOPE = 512, 64, 128
SM_SCALE = mla_sm_scale(NOPE, ROPE)
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192, 32768)
SPEC_CONTEXTS = (1024, 8192)
K_DRAFT, DRAFT_EXTEND = 8, 6
# (16, 256): `examples/eagle.py --model deepseek`'s decode (bs 16, contexts of ~100-250 in a
# 256-wide cache), where a profile showed the kernel far from bandwidth (~20 us a call for
# ~4 MB) at the policy's 2 splits
SWEEP_CASES = ((1, 8192), (8, 8192), (32, 8192), (16, 256), (8, 32768))
SWEEP_TILES = ((32, 2, 4), (16, 2, 4), (64, 2, 8), (32, 3, 4), (32, 2, 8))  # BLOCK_N/stages/warps
KEYS_TILES = ((64, 2, 4, "keys"), (64, 2, 8, "keys"))  # the keys-major kernel (--keys-major)
# the row-major kernel with c_kv as two column halves (independent QK chains; --keys-major too)
SPLIT_TILES = ((32, 2, 4, "split"), (32, 3, 4, "split"), (64, 2, 8, "split"))
SMOKE = dict(kv_lora_rank=96, rope=32, batches=(2,), contexts=(40,), spec_contexts=(40,),
             sweep=((2, 40),), tiles=((32, 2, 4),))


class LatentSpec(NamedTuple):
    """One MLA case: kind (decode / verify / extend) at bs requests of context ctx, n_heads query
    heads, latent rows of r (c_kv) + rope columns."""
    bs: int
    ctx: int
    n_heads: int
    kind: str = "decode"
    r: int = KV_LORA_RANK
    rope: int = ROPE


class LatentCase:
    """A paged latent cache, its dense copy for SDPA, and kind = decode / verify / extend."""

    def __init__(self, spec: LatentSpec, gen, device, impl="auto"):
        bs, ctx, n_heads, kind, r, rope = spec
        self.bs, self.ctx, self.n_heads, self.kind, self.device = bs, ctx, n_heads, kind, device
        self.impl = impl  # "triton" for --smoke: on CPU "auto" would run the torch path
        self.r, self.width = r, r + rope
        self.n_q = dict(decode=1, verify=K_DRAFT, extend=DRAFT_EXTEND)[kind]
        dev = dict(device=device, dtype=DTYPE)
        self.latent = torch.randn(bs * ctx + 1, 1, self.width, generator=gen, **dev)
        slots = torch.randperm(bs * ctx, device=device, generator=gen) + 1
        self.req_to_token = torch.zeros(bs + 1, ctx, dtype=torch.int32, device=device)
        self.req_to_token[1:] = slots.view(bs, ctx).int()
        self.rows = torch.arange(1, bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(bs * self.n_q, n_heads, self.width, generator=gen, **dev)
        self.tree = random_tree_masks(bs, K_DRAFT, torch.Generator().manual_seed(bs)).to(device)
        self.qo_indptr = (torch.arange(bs + 1, device=device) * self.n_q).int()
        # [bs, 1, ctx, r + rope]: the same latent rows, contiguous
        self.dense = self.latent[slots.long(), 0].view(bs, 1, ctx, self.width)
        self.mask = self.dense_mask()

    def dense_mask(self):
        """[bs, 1, n_q * H, ctx] bool (rows = (query, head)), or None at decode."""
        if self.kind == "decode":
            return None
        pos = torch.arange(self.ctx, device=self.device)
        first = self.ctx - self.n_q
        if self.kind == "extend":
            qpos = first + torch.arange(self.n_q, device=self.device)
            mask = (pos[None, :] <= qpos[:, None]).expand(self.bs, -1, -1)
        else:
            j = (pos - first).clamp(0, self.n_q - 1)
            mask = (pos < first)[None, None, :] | (self.tree[:, :, j] & (pos >= first))
        mask = mask[:, :, None, :].expand(-1, -1, self.n_heads, -1)  # [bs, n_q, H, ctx]
        return einops.rearrange(mask, "b n h l -> b 1 (n h) l").contiguous()

    def paged(self):
        return (self.q, self.latent, self.req_to_token, self.rows, self.seq_lens)

    def meta(self) -> PagedMeta:
        """The case's paged metadata (decode, tree verify or causal extend)."""
        paged = (self.req_to_token, self.rows, self.seq_lens)
        if self.kind == "verify":
            return PagedMeta.tree(*paged, self.tree)
        if self.kind == "extend":
            return PagedMeta.causal(*paged, self.qo_indptr)
        return PagedMeta.decode(*paged)

    def shape(self) -> MlaShape:
        """What `plan_mla` decides the case's launch from."""
        return MlaShape.of(self.q, self.meta(), self.r)

    def ours(self, impl=None, **knobs):
        """The public function of the case's kind, or with `knobs` (`MlaPolicy` fields) the
        kernel launcher under that policy."""
        args, impl = self.paged(), impl or self.impl
        if knobs:
            meta, policy = self.meta(), MlaPolicy(**knobs)
            return lambda: mla_paged_attention(self.q, self.latent, meta, self.r, SM_SCALE,
                                               policy)
        if self.kind == "extend":
            return lambda: mla_extend_attention(*args, self.qo_indptr, self.r, SM_SCALE,
                                                impl=impl)
        if self.kind == "verify":
            return lambda: mla_tree_verify_attention(*args, self.tree, self.r, SM_SCALE,
                                                     impl=impl)
        return lambda: mla_decode_attention(*args, self.r, SM_SCALE, impl=impl)

    def sdpa(self, backend):
        q4 = einops.rearrange(self.q, "(b n) h c -> b 1 (n h) c", b=self.bs)
        v = self.dense[..., :self.r]  # a view: values are the first r columns of each row

        def run():
            with torch.nn.attention.sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q4, self.dense, v, attn_mask=self.mask,
                                                   scale=SM_SCALE)
            return einops.rearrange(o, "b 1 (n h) c -> (b n) h c", h=self.n_heads)
        return run

    def bytes_moved(self) -> int:
        rows = self.bs * self.ctx * (self.width * 2 + 4)
        return rows + self.bs * self.n_q * self.n_heads * (self.r + self.width) * 2


def best_sdpa(case, ref):
    """(the fastest agreeing SDPA backend's callable, its name), or (None, None): the backend
    `bench_attention.best_sdpa_backend` picks (timed as graph replays, as the table compares)."""
    backend = best_sdpa_backend(case, ref)
    return (case.sdpa(backend), backend.name) if backend is not None else (None, None)


def time_case(spec: LatentSpec, copy_bw, gen, device, impl, keys_major=False) -> dict:
    bs, ctx, kind = spec.bs, spec.ctx, spec.kind
    case = LatentCase(spec, gen, device, impl=impl)
    out = case.ours()()
    pick = sorted({0, bs - 1})
    rows = [r * case.n_q + i for r in pick for i in range(case.n_q)]
    ref = case.ours(impl="torch")()  # the absorbed torch path (the tests check it vs non-absorbed)
    err = rel_err(out[rows], ref[rows])
    sdpa_fn, backend = best_sdpa(case, out)
    plan = plan_mla(case.shape())  # what the policy launches (splits from shapes only)
    row = dict(kind=kind, bs=bs, ctx=ctx, splits=plan.num_splits, row_blocks=plan.n_blocks,
               fold=plan.num_splits == 1 or plan.fold,
               kernel="keys" if plan.keys_major else "rows",
               tile="{BLOCK_N}/{num_stages}/{num_warps}".format(**plan.blocks)
               + (" split" if plan.blocks.get("SPLIT_C") else ""),
               err=err, ok=err < 1e-2, sdpa_backend=backend)
    row["us"] = bench_us(graph_of(case.ours()))
    row["sdpa_us"] = bench_us(graph_of(sdpa_fn)) if sdpa_fn is not None else None
    n_bytes = case.bytes_moved()
    row["gbs"] = n_bytes / (row["us"] * 1e-6) / 1e9
    row["fraction"] = n_bytes / (row["us"] * 1e-6) / copy_bw
    if keys_major:  # the row-major and the keys-major kernel, each at its own split policy
        row["rows_us"] = bench_us(graph_of(case.ours(keys_major=False)))
        fn = case.ours(keys_major=True)
        row["keys_err"] = rel_err(fn()[rows], ref[rows])
        row["keys_us"] = bench_us(graph_of(fn))
        row["keys_fraction"] = n_bytes / (row["keys_us"] * 1e-6) / copy_bw
        row["ok"] = row["ok"] and row["keys_err"] < 1e-2
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["us"] if row["sdpa_us"] else None
    del case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def sweep_case(bs, ctx, n_heads, gen, device, tiles, widths, aheads=(1,)) -> dict:
    """Decode over tiles x split counts (policy / 2, policy, policy x 2, and x 4, x 8 for
    contexts <= 1024) x fold (x how many tiles ahead the slot indices load: `aheads`), graph µs."""
    case = LatentCase(LatentSpec(bs, ctx, n_heads, "decode", *widths), gen, device)
    ref = case.ours()()
    policy = plan_mla(case.shape()).num_splits
    results = []
    counts = {max(1, policy // 2), policy, policy * 2}
    if ctx <= 1024:             # short contexts: the policy's splits leave most SMs idle
        counts |= {policy * 4, policy * 8}
    for (block_n, stages, warps, *kernel), splits, ahead in itertools.product(
            tiles, sorted(counts), aheads):
        keys, split_c = kernel == ["keys"], kernel == ["split"]
        for fold in ((True, False) if splits > 1 else (True,)):
            fn = case.ours(num_splits=splits, block_n=block_n, num_stages=stages,
                           num_warps=warps, fold=fold, slots_ahead=ahead, keys_major=keys,
                           split_c=split_c)
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - e.g. a tile past the shared memory
                print(f"MLA sweep: skipping {block_n=} {stages=} {warps=}: {type(e).__name__}")
                break
            if rel_err(out, ref) > 1e-2:
                raise AssertionError(f"MLA sweep {block_n=} {stages=} {warps=} {splits=} "
                                     f"{fold=} disagrees at {bs=} {ctx=}")
            results.append(dict(block_n=block_n, stages=stages, warps=warps, splits=splits,
                                fold=fold, slots_ahead=ahead, keys_major=keys, split_c=split_c,
                                us=bench_us(graph_of(fn), rep=30)))
    del case
    return dict(bs=bs, ctx=ctx, policy_splits=policy, best=min(results, key=lambda r: r["us"]),
                all=results)


def markdown(meta, heads, copy_bw, rows, sweeps, widths=(KV_LORA_RANK, ROPE)) -> str:
    lines = [f"# MLA ({heads} heads, kv_lora_rank {widths[0]}, rope {widths[1]}, bf16)", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [f"- copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)",
              "- splits `S` = one launch (merge folded, or S = 1), `S+m` = + merge kernel", "",
              "| kind | bs | ctx | kernel (tile) | splits | row blocks | ours µs (graph) "
              "| sdpa µs (graph) | speedup | GB/s | fraction of copy | sdpa backend | rel err |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        sdpa = f"{r['sdpa_us']:.1f}" if r["sdpa_us"] else "n/a"
        speed = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] else "n/a"
        lines.append(f"| {r['kind']} | {r['bs']} | {r['ctx']} | {r.get('kernel', 'rows')} "
                     f"{r.get('tile', '')} "
                     f"| {r['splits']}"
                     f"{'' if r['fold'] else '+m'} | {r['row_blocks']} | {r['us']:.1f} | {sdpa} "
                     f"| {speed} | {r['gbs']:.0f} | {r['fraction']:.2f} | {r['sdpa_backend']} "
                     f"| {r['err']:.1e}{'' if r['ok'] else ' FAIL'} |")
    keyed = [r for r in rows if "keys_us" in r]
    if keyed:
        lines += ["", "## Row-major and keys-major kernel (graph µs, each with its own tiles and "
                  "split policy; the main table runs the policy's pick)", "",
                  "| kind | bs | ctx | row-major µs | keys-major µs | keys / row time "
                  "| fraction of copy (keys) | rel err (keys) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in keyed:
            lines.append(f"| {r['kind']} | {r['bs']} | {r['ctx']} | {r['rows_us']:.1f} "
                         f"| {r['keys_us']:.1f} "
                         f"| {r['keys_us'] / r['rows_us']:.2f} | {r['keys_fraction']:.2f} "
                         f"| {r['keys_err']:.1e} |")
    if sweeps:
        aheads = sorted({r.get("slots_ahead", 1) for sw in sweeps for r in sw["all"]})
        lines += ["", "## Decode tile / split / fold sweep (graph µs; tile = BLOCK_N/stages/"
                  "warps, `keys` = the keys-major kernel, `split` = c_kv in two column "
                  "halves; slots k: a tile's slot indices loaded k tiles ahead, 0 = in the "
                  "loop)", "",
                  "| bs | ctx | policy splits | best µs | best tile | best splits | best fold "
                  "| best slots | " + " | ".join(f"best µs, slots {a}" for a in aheads) + " |",
                  "|---:|---:|---:|---:|---|---:|---|---:|" + "---:|" * len(aheads)]
        for sw in sweeps:
            b = sw["best"]
            per = [min((r["us"] for r in sw["all"] if r.get("slots_ahead", 1) == a),
                       default=None) for a in aheads]
            cells = " | ".join(f"{u:.1f}" if u is not None else "-" for u in per)
            lines.append(f"| {sw['bs']} | {sw['ctx']} | {sw['policy_splits']} | {b['us']:.1f} "
                         f"| {b['block_n']}/{b['stages']}/{b['warps']}"
                         f"{' keys' if b.get('keys_major') else ''}"
                         f"{' split' if b.get('split_c') else ''} | {b['splits']} "
                         f"| {b['fold']} | {b.get('slots_ahead', 1)} | {cells} |")
    return "\n".join(lines) + "\n"


def section(name, fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a benchmark reports what it could measure
        print(f"section {name} failed:\n{traceback.format_exc()}", flush=True)
        return []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--kv-lora-rank", type=int, default=KV_LORA_RANK,
                        help="latent width (c_kv columns; 512 is DeepSeek's): a narrower latent "
                             "shows what the [16, rank] fp32 accumulator's registers cost")
    parser.add_argument("--decode-only", action="store_true", help="skip verify and extend")
    parser.add_argument("--slots", default="1",
                        help="sweep: how many tiles ahead the kernel loads a tile's slot indices, "
                             "comma-separated (0 = in the loop; default 1)")
    parser.add_argument("--keys-major", action="store_true",
                        help="also time the keys-major kernel (keys_us) and sweep its tiles")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (script check)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    heads = args.heads
    if args.smoke:
        widths = (SMOKE["kv_lora_rank"], SMOKE["rope"])
        batches, contexts, spec_ctx = SMOKE["batches"], SMOKE["contexts"], SMOKE["spec_contexts"]
        sweep_cases, tiles = SMOKE["sweep"], SMOKE["tiles"]
        tiles += ((32, 2, 4, "keys"), (32, 2, 4, "split")) if args.keys_major else ()
    else:
        widths = (args.kv_lora_rank, ROPE)
        batches, contexts, spec_ctx = BATCHES, CONTEXTS, SPEC_CONTEXTS
        sweep_cases, tiles = SWEEP_CASES, SWEEP_TILES + (
            KEYS_TILES + SPLIT_TILES if args.keys_major else ())
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bw = copy_bandwidth(device)
    impl = "triton" if args.smoke else "auto"  # on CPU, "auto" would time the torch path

    def cases(kinds_ctx):
        rows = []
        for kind, ctxs in kinds_ctx:
            for bs, ctx in itertools.product(batches, ctxs):
                rows.append(time_case(LatentSpec(bs, ctx, heads, kind, *widths), copy_bw, gen,
                                      device, impl, args.keys_major))
                print({k: v for k, v in rows[-1].items()}, flush=True)
        return rows

    aheads = tuple(int(a) for a in args.slots.split(","))
    rows = section("decode", lambda: cases([("decode", contexts)]))
    if not args.decode_only:
        rows += section("verify/extend",
                        lambda: cases([("verify", spec_ctx), ("extend", spec_ctx)]))
    sweeps = [] if args.no_sweep else section("sweep", lambda: [
        sweep_case(bs, ctx, heads, gen, device, tiles, widths, aheads)
        for bs, ctx in sweep_cases])
    meta = env_info() if device.type == "cuda" else {"gpu": "cpu smoke"}
    text = markdown(meta, heads, copy_bw, rows, sweeps, widths)
    stem = "mla" if heads == 16 else f"mla_h{heads}"
    stem += "" if args.smoke or widths[0] == KV_LORA_RANK else f"_r{widths[0]}"
    stem += "_smoke" if args.smoke else ""
    path = out_dir() / f"{stem}.md"
    path.write_text(text)
    (out_dir() / f"{stem}.json").write_text(json.dumps(dict(rows=rows, sweeps=sweeps), indent=1))
    print(text)
    print(f"wrote {path}")
    if not all(r["ok"] for r in rows):
        sys.exit("some results disagree with the torch path (rel err >= 1e-2): see the table")


if __name__ == "__main__":
    main()
