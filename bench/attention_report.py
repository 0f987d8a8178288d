"""bench_attention's markdown report."""
from __future__ import annotations



from bench.attention_config import DRAFT_EXTEND, HEAD_DIM, K_DRAFT, N_KV_HEADS, N_Q_HEADS
from bench.cold_capture import COLD_LAYERS, COLD_MAX_CTX

def fmt_rows(rows, with_splits=True) -> list[str]:
    head = ("| kind | layout | bs | ctx | splits | ours µs | sdpa µs | floor µs | frac of copy BW "
            "| speedup | sdpa backend | rel err |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        sdpa = (f"{r['sdpa_us']:.1f} ({r['sdpa_eager_us']:.1f})" if r.get("sdpa_us")
                else "n/a")
        speed = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] else "n/a"
        splits = f"{r['num_splits']}{'' if r['fold'] or r['num_splits'] == 1 else '+m'}" \
            if r["kind"] != "extend" else "-"
        lines.append(f"| {r['kind']} | {r['layout']} | {r['bs']} | {r['ctx']} | {splits} "
                     f"| {r['ours_us']:.1f} ({r['ours_eager_us']:.1f}) | {sdpa} "
                     f"| {r['floor_us']:.1f} | {r['frac_copy_bw']:.0%} | {speed} "
                     f"| {r['sdpa_backend']} | {r['vs_reference']:.1e}"
                     f"{'' if r['ok'] else ' FAIL'} |")
    return lines


def markdown(meta, rows, spec_rows, sweeps, cold) -> str:
    lines = [f"# Paged attention benchmark ({meta['gpu']})", "",
             f"- date: {meta['date']}", f"- torch {meta['torch']}, triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             f"- copy bandwidth (read + write): {meta['copy_bw_GBps']:.0f} GB/s",
             f"- {N_Q_HEADS} q heads, {N_KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16; ours/sdpa "
             "= CUDA-graph replay, eager in brackets; splits `S` = one launch (merge folded or "
             "S = 1), `S+m` = split pass + merge kernel", "", "## Decode", ""]
    lines += fmt_rows(rows)
    ig = [r for r in rows if "ig_ours_us" in r]
    if ig:
        lines += ["", f"Inside a graph of {ig[0]['in_graph_calls']} calls (an L2 flush before "
                  "each, the flushes' own time subtracted), µs a call:", "",
                  "| layout | bs | ctx | ours | sdpa | speedup | floor |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in ig:
            sd = r.get("ig_sdpa_us")
            sp = f"{sd / r['ig_ours_us']:.2f}x" if sd and r["ig_ours_us"] > 0 else "n/a"
            lines.append(f"| {r['layout']} | {r['bs']} | {r['ctx']} | {r['ig_ours_us']:.1f} | "
                         f"{f'{sd:.1f}' if sd else 'n/a'} | {sp} | {r['floor_us']:.1f} |")
    if spec_rows:
        lines += ["", f"## Tree verify (k = {K_DRAFT}) and draft-extend ({DRAFT_EXTEND} "
                  "tokens, causal) vs SDPA with the equivalent mask", ""]
        lines += fmt_rows(spec_rows)
    if sweeps:
        lines += ["", "## Decode split / tile / fold sweep (graph replays, µs; tile = BLOCK_N/stages/"
                  "warps)", "",
                  "| bs | ctx | policy splits | policy µs | best µs | best tile | best splits "
                  "| best fold | best frac |", "|---:|---:|---:|---:|---:|---|---:|---|---:|"]
        for s in sweeps:
            b, p = s["best"], s["policy"]
            pol = f"{p['us']:.1f}" if p else "n/a"
            lines.append(f"| {s['bs']} | {s['ctx']} | {s['policy_splits']} | {pol} "
                         f"| {b['us']:.1f} | {b['block_n']}/{b['stages']}/{b['warps']} "
                         f"| {b['splits']} | {b['fold']} | {b['frac_copy_bw']:.0%} |")
    if cold:
        lines += ["", "## Cold capture of the default ladder (decode-only body: "
                  f"{COLD_LAYERS} x (store_kv + decode_attention), 32/8/64 heads, max context "
                  f"{COLD_MAX_CTX})", "",
                  "| run | buckets | capture s (first) | capture s (again, same process) "
                  "| Triton compiles | cubins in cache | split counts | process s |",
                  "|---|---:|---:|---:|---|---:|---|---:|"]
        for c in cold:
            lines.append(f"| {c['label']} | {c['n_buckets']} | {c['first_s']:.2f} "
                         f"| {c['again_s']:.2f} | {c['compiles']} | {c['cubins_in_cache']} "
                         f"| {c['split_counts']} | {c['process_s']:.1f} |")
    return "\n".join(lines) + "\n"
