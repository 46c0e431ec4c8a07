"""Benchmark of packed variable-length prefill (``cu_seqlens``, issue 14): one packed batch vs the same tokens as
one sequence, cuTile, on the device.

Goal (issue 14): a packed batch of nseq sequences costs at most 1.1x the same number of tokens scanned as one
sequence. Per model shape (bf16; D, dt_bias and per-sequence initial states present, softplus) and pack (1, 4
and 16 sequences of mixed lengths, drawn once from a fixed seed, boundaries inside chunks), median ms
(triton.testing.do_bench, return_mode="median", after warm-up) of:

* ``one seq``: ``ssm_scan`` of the T tokens as one sequence (batch 1, seqlen T, initial_state[0:1]);
* ``packed``: the packed launch group over all sequences (``cutile_packed.ssm_scan_packed_cutile``: one block per
  sequence segment over the sequence's sliced views, what ``ssm_scan(..., cu_seqlens=...)`` runs for two or more
  non-empty sequences);
* ``per-seq loop``: ``ssm_scan`` on each sequence's slice (what ``ssm_scan(..., cu_seqlens=...)`` ran before);

all as CUDA-graph replays, plus ``packed eager``: ``ssm_scan(..., cu_seqlens=...)`` called eagerly with the offsets
on the host (checked there, work table from the cache, plan lookup, launches). ``ratio`` = packed / one seq (graph).
``rel-L2``: the packed y and final_state against the per-sequence loop (each sequence scanned alone by the
unpacked kernels). Rows are appended as they are measured (a run cut short keeps its rows).

Then the breakdown: each launch of the packed group and of the one-sequence plan timed alone (a CUDA graph of
that one launch, on the buffers the whole group left; us, medians), where the packed overhead goes.

Run on the device:
    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_ssd_packed.py --results $OUT/results.md
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._report import utc_now  # noqa: E402
from benchmarks.bench_ssd import append_results, make_inputs, rel_err, time_fn  # noqa: E402

SHAPES = {  # name: (total tokens T, nheads, headdim, ngroups, d_state)
    "mamba2_2.7b": (8192, 80, 64, 1, 128),
    "nemotron_h_8b": (8192, 128, 64, 8, 128),
    "mamba2_2.7b_T2048": (2048, 80, 64, 1, 128),
}
PACKS = (1, 4, 16)


def mixed_lengths(total: int, nseq: int, seed: int) -> list[int]:
    """``nseq`` lengths summing to ``total``, mixed (uniform cut points), at least 1 each."""
    if nseq == 1:
        return [total]
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(total - 1, generator=g)[:nseq - 1].add(1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def header(gpu: str, torch_v: str, triton_v: str, tile_v: str) -> str:
    return "\n".join([
        f"## bench_ssd_packed.py: packed prefill vs one sequence ({utc_now()}, {gpu}; torch {torch_v}, triton "
        f"{triton_v}, cuda.tile {tile_v})", "",
        "bf16, D/dt_bias/per-sequence initial states, softplus; ms medians (graph replay unless named eager); ratio = "
        "packed / one seq; goal (issue 14): ratio <= 1.1.", "",
        "| shape | T | H, P, G, N | nseq | lengths | one seq ms | packed ms | ratio | per-seq loop ms | "
        "packed eager ms | rel-L2 y, state vs loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|"])


def row_line(row) -> str:
    name, T, H, P, G, N, nseq, lengths, t_one, t_pk, t_loop, t_eager, ey, es = row
    ls = ",".join(map(str, lengths)) if len(lengths) <= 4 else f"{min(lengths)}..{max(lengths)}"
    return (f"| {name} | {T} | {H}, {P}, {G}, {N} | {nseq} | {ls} | {t_one:.4f} | {t_pk:.4f} | {t_pk / t_one:.3f} | "
            f"{t_loop:.4f} | {t_eager:.4f} | {ey:.1e}, {es:.1e} |")


BREAKDOWN_HEADER = "\n".join([
    "", "Breakdown: each launch alone (a CUDA graph of that one launch; us, medians; pass 1 absent: '-').", "",
    "| shape | nseq | items / pass-1 items / sequence chunks | packed pre-pass | packed pass 1 | packed pass 2 | "
    "packed sum | one-seq pre-pass | one-seq pass 1 | one-seq pass 2 | one-seq sum |",
    "|---|---|---|---|---|---|---|---|---|---|---|"])


def launch_times(launches, tensors, rep: int) -> dict[str, float]:
    """Median us of each (name, launch, grid) alone, as a CUDA graph of that one launch."""
    import cuda.tile as ct

    out = {}
    for name, launch, grid in launches:
        def one(kernel=launch.kernel, grid=grid, args=launch.bind(tensors)):
            ct.launch(torch.cuda.current_stream().cuda_stream, grid, kernel, args)

        out[name] = 1e3 * time_fn(one, graph=True, rep=rep)
    return out


def breakdown_line(name, nseq, work, pk: dict, one: dict) -> str:
    def cells(d):
        return [f"{d[k]:.1f}" if k in d else "-" for k in ("pre-pass", "pass 1", "pass 2")] + [f"{sum(d.values()):.1f}"]

    return " | ".join([f"| {name}", str(nseq), f"{work.nitems} / {work.npass1} / {work.nchunks}", *cells(pk),
                       *cells(one)]) + " |"


def breakdown(p, inp, cu_list, h0, rep: int):
    """(work, packed us per launch, one-sequence us per launch) of one pack (see the module docstring)."""
    import m2export.kernels.ssd.cutile as cu
    import m2export.kernels.ssd.cutile_packed as cp

    dev = inp["x"].device
    flags = dict(dt_softplus=True, dt_limit=(0.0, math.inf), has_D=True, has_dt_bias=True, has_init=True)
    plan = cp.packed_plan(p, device=dev, **flags)
    work = cp.device_work(cu_list, plan.config.chunk, cp.segment_chunks(plan.config, p.seqlen), dev)
    tensors = dict(inp, y=torch.empty_like(inp["x"]), final_state=torch.empty_like(h0), chunks=work.chunks,
                   work_pass2=work.table[:work.nitems], work_pass1=work.table[work.nitems:],
                   **cp.packed_scratch(p, plan.config, work, dev))
    kinds = {"ssd_packed_dt_kernel": "pre-pass", "ssd_packed_segment_kernel": "pass 1",
             "ssd_packed_scan_kernel": "pass 2", "ssd_dt_kernel": "pre-pass", "ssd_segment_state_kernel": "pass 1",
             "ssd_scan_kernel": "pass 2"}
    pk = launch_times([(kinds[l.name], l, g) for l, g in cp.packed_launches(plan, work, p.nheads)], tensors, rep)
    one = cu.scan_plan(p, device=dev, **flags)
    tensors = dict(inp, initial_state=h0[:1], y=torch.empty_like(inp["x"]), final_state=torch.empty_like(h0[:1]))
    for name, shape, dtype in one.scratch:
        tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    ones = launch_times([(kinds[l.name], l, l.grid) for l in one.launches], tensors, rep)
    return work, pk, ones


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--packs", default=",".join(map(str, PACKS)))
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"), help="markdown file to append to")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the per-launch times")
    args = ap.parse_args(argv)

    import cuda.tile as ct
    import triton

    import m2export.kernels.ssd.cutile_packed as cp
    from m2export.contract import validate_packed
    from m2export.kernels.ssd import ssm_scan

    dev = torch.device("cuda")
    append_results(header(torch.cuda.get_device_name(), torch.__version__, triton.__version__, ct.__version__),
                   args.results)
    rows, lines = [], []
    for name in args.shapes.split(","):
        T, H, P, G, N = SHAPES[name]
        base = make_inputs((1, T, H, P, G, N), seed=1)
        for nseq in map(int, args.packs.split(",")):
            lengths = mixed_lengths(T, nseq, seed=nseq)
            cu_list = [0] + list(torch.tensor(lengths).cumsum(0).tolist())
            cu_cpu = torch.tensor(cu_list, dtype=torch.int32)
            h0 = torch.randn(nseq, H, P, N, device=dev, generator=torch.Generator(device=dev).manual_seed(2))
            inp = dict(base, initial_state=h0)
            names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")
            p, _ = validate_packed(*(inp[k] for k in names), cu_seqlens=cu_cpu)
            y_pk = torch.empty_like(inp["x"])
            fs_pk = torch.empty(nseq, H, P, N, device=dev)
            y_one = torch.empty_like(inp["x"])
            fs_one = torch.empty(1, H, P, N, device=dev)
            y_loop = torch.empty_like(inp["x"])
            fs_loop = torch.empty(nseq, H, P, N, device=dev)

            def packed():
                cp.ssm_scan_packed_cutile(*(inp[k] for k in names), cu_list, problem=p, dt_softplus=True,
                                          dt_limit=(0.0, math.inf), out=y_pk, final_state_out=fs_pk)

            def packed_eager():  # the routed entry point, offsets on the host
                ssm_scan(**inp, cu_seqlens=cu_cpu, out=y_pk, final_state_out=fs_pk)

            def one_seq():
                ssm_scan(**dict(inp, initial_state=h0[:1]), out=y_one, final_state_out=fs_one)

            def loop():
                for s in range(nseq):
                    a, b = cu_list[s], cu_list[s + 1]
                    ssm_scan(inp["x"][:, a:b], inp["dt"][:, a:b], inp["A"], inp["B"][:, a:b], inp["C"][:, a:b],
                             inp["D"], inp["dt_bias"], h0[s:s + 1], out=y_loop[:, a:b],
                             final_state_out=fs_loop[s:s + 1])

            loop()
            packed()
            torch.cuda.synchronize()
            err_y, err_s = rel_err(y_loop, y_pk), rel_err(fs_loop, fs_pk)
            t_one = time_fn(one_seq, graph=True, rep=args.rep)
            t_pk = time_fn(packed, graph=True, rep=args.rep)
            t_loop = time_fn(loop, graph=True, rep=args.rep)
            t_eager = time_fn(packed_eager, graph=False, rep=args.rep)
            rows.append((name, T, H, P, G, N, nseq, lengths, t_one, t_pk, t_loop, t_eager, err_y, err_s))
            append_results(row_line(rows[-1]), args.results)  # row by row: a run cut short keeps its rows
            if args.breakdown:
                lines.append(breakdown_line(name, nseq, *breakdown(p, inp, cu_list, h0, args.rep)))
    if lines:
        append_results("\n".join([BREAKDOWN_HEADER] + lines), args.results)
    worst = max(r[9] / r[8] for r in rows)  # packed / one seq
    append_results(f"\nWorst ratio {worst:.3f}: the 1.1x goal is {'met' if worst <= 1.1 else 'NOT met'} on these "
                   "shapes.\n", args.results)

    return 0


if __name__ == "__main__":
    sys.exit(main())
