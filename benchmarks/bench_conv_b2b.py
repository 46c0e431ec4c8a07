"""Conv prefill timed four ways (issue 18 diagnostic: what the timing method adds to one launch).

bench_layer.py times one launch per CUDA-graph replay with triton's do_bench, which clears L2 before each replay by
zeroing a 256 MB buffer: that leaves L2 (60 MB on the H200) full of dirty lines, written back to DRAM while the timed
kernel runs. Methods, per launch, median:

    do_bench      do_bench(g.replay), one launch per graph (bench_layer.py's number)
    b2b           N launches back to back in one graph, do_bench(g.replay) / N (one zero-flush per N launches)
    zero-flush    own events around one replay after buf.zero_() (should equal do_bench)
    read-flush    own events around one replay after a read of the same buffer (L2 left clean: no write-back)

Rows: the default launch of m2export.kernels.conv1d.causal_conv1d, the tiles given by --tiles (choose_stream_tiles
with the keyword block_c, ROWS from STREAM_STEP_BYTES), and torch's copy of the same bytes from a contiguous x. x is the
strided xBC slice of an in_proj output (bench_layer.py's layers), bf16, seqlen 8192. Results on stdout.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_conv_b2b.py --shapes mamba2-2.7b:1,mamba2-2.7b:4,nemotron-h-8b:1
"""
from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

from m2export.contract_conv1d import validate
from m2export.kernels.conv1d import causal_conv1d
from m2export.kernels.conv1d.cutile import causal_conv1d_cutile, choose_stream_tiles
from m2export.kernels._host import sm_count

LAYERS = {"mamba2-2.7b": (10576, 5120, 5376), "nemotron-h-8b": (18560, 8192, 10240)}  # d_in_proj, d_inner, conv_dim
HBM = 4.3e12


def own_timing(g, buf, flush: str, reps: int) -> float:
    """Median us of one g.replay() between events, after zeroing (``zero``) or reading (``read``) buf."""
    sink = torch.empty((), dtype=torch.int64, device=buf.device)
    times = []
    for _ in range(reps):
        if flush == "zero":
            buf.zero_()
        else:
            torch.sum(buf, dim=0, out=sink)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mamba2-2.7b:1,mamba2-2.7b:4,nemotron-h-8b:1", help="LAYER:BATCH list")
    ap.add_argument("--block-c", default="256", help="comma list of BLOCK_C for the candidate rows ('' for none)")
    ap.add_argument("--n", type=int, default=10, help="launches per graph in b2b")
    ap.add_argument("--reps", type=int, default=60, help="replays of the own-event methods")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    print(f"{'shape':22s} {'row':34s} {'do_bench':>9s} {'b2b':>9s} {'zero-fl':>9s} {'read-fl':>9s}   floor (us)")
    for spec in args.shapes.split(","):
        name, b = spec.split(":")
        b, L = int(b), 8192
        dip, di, cd = LAYERS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        zx = torch.randn(b, L, dip, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = zx[..., di:di + cd]
        w = (torch.randn(cd, 4, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        bias = (torch.randn(cd, device="cuda", generator=gen) * 0.2).to(torch.bfloat16)
        y = torch.empty(b, L, cd, device="cuda", dtype=torch.bfloat16)
        st = torch.empty(b, cd, 3, device="cuda", dtype=torch.bfloat16)
        xc, yc = x.contiguous(), torch.empty_like(y)
        p = validate(x, w, bias, None)
        floor = 2 * b * L * cd * 2 / HBM * 1e6
        rows = [("conv default", lambda: causal_conv1d(x, w, bias, out=y, state_out=st))]
        for bc in filter(None, args.block_c.split(",")):
            tl = choose_stream_tiles(p, 2, sm_count(x.device), block_c=int(bc))
            rows.append((f"conv tiles {'x'.join(map(str, tl))}",
                         lambda tl=tl: causal_conv1d_cutile(x, w, bias, None, problem=p, silu=True, out=y,
                                                            state_out=st, tiles=tl)))
        rows.append(("torch copy_ (contiguous x)", lambda: yc.copy_(xc)))
        for label, fn in rows:
            fn()
            torch.cuda.synchronize()
            graphs = {}
            for n in (1, args.n):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(n):
                        fn()
                graphs[n] = g
            torch.cuda.synchronize()
            t1 = do_bench(graphs[1].replay, warmup=10, rep=60, return_mode="median") * 1e3
            tn = do_bench(graphs[args.n].replay, warmup=10, rep=60, return_mode="median") * 1e3 / args.n
            tz = own_timing(graphs[1], buf, "zero", args.reps)
            tr = own_timing(graphs[1], buf, "read", args.reps)
            print(f"{name + ' ' + str(b) + 'x' + str(L):22s} {label:34s} {t1:9.1f} {tn:9.1f} {tz:9.1f} {tr:9.1f}   "
                  f"{floor:.1f}", flush=True)


if __name__ == "__main__":
    main()
