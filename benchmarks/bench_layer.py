"""Per-part times of one Mamba-2 mixer layer (issue 18): in_proj GEMM, causal conv1d + SiLU, SSM scan,
gated RMSNorm, out_proj GEMM; our cuTile kernels vs the PyTorch ops of m2export/models/mamba2.py vs
mamba_ssm's Triton ``rmsnorm_fn``, in one run, with floors.

Layers (bf16, d_state 128, headdim 64, d_conv 4, no biases in the projections, conv bias present):
    mamba2-2.7b     d_model 2560, d_inner 5120, nheads 80,  ngroups 1, conv_dim 5376,  d_in_proj 10576
    nemotron-h-8b   d_model 4096, d_inner 8192, nheads 128, ngroups 8, conv_dim 10240, d_in_proj 18560
Modes: prefill (batch, seqlen) = (4, 8192) and (1, 8192), fresh sequences (no initial state);
decode: one token for 128 sequences, states updated in place.

The conv input and the gate are the strided xBC / z slices of the in_proj output, as in the model;
the scan takes views of the conv output (the cuTile scan reads them in place through their strides;
timed apart on contiguous copies as "scan, contiguous inputs").

Floors (H200: 4.3 TB/s copy bandwidth, 790 TFLOP/s bf16 matmul, /work/.library/device/KINDS.md):
    GEMM       max((M*K + K*N + M*N) * 2 / 4.3e12, 2*M*K*N / 790e12)
    conv       prefill 2 * b*l*conv_dim * 2 bytes (x read, y written); decode also the state read
               and written, b*conv_dim * (2 + 2*(d_conv-1)) * 2
    scan       benchmarks/bench_ssd.py floor_s (prefill); bench_ssd_step.step_bytes (decode)
    norm       3 * rows * d_inner * 2 bytes (x, z read, out written)
Times: median of CUDA-graph replays (triton.testing.do_bench via bench_ssd.time_fn). Whole layer:
the five parts captured in one graph.

mamba_ssm: ``mamba_ssm/ops/triton/layernorm_gated.py`` imported from a git-ignored copy under
``.devcarry/mamba_ssm_triton`` (never committed); its column is empty, with the reason, when absent.
Dao-AILab's causal-conv1d (CUDA extension) is not on the device image and cannot be installed there.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_layer.py --results $OUT/results.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ssd import floor_s as scan_floor_s  # noqa: E402
from benchmarks.bench_ssd import append_results, load_mamba_triton, time_fn  # noqa: E402
from benchmarks.bench_ssd_step import step_bytes  # noqa: E402
from m2export.models.config import Mamba2Config  # noqa: E402
from m2export.models.mamba2 import RMSNormGated  # noqa: E402

HBM = 4.3e12
MMA = 790e12


LAYERS = {  # one mixer layer each (expand 2, headdim 64, d_state 128, d_conv 4: the config's defaults)
    "mamba2-2.7b": Mamba2Config(d_model=2560, n_layer=1, vocab_size=16, ngroups=1),
    "nemotron-h-8b": Mamba2Config(d_model=4096, n_layer=1, vocab_size=16, ngroups=8),
}
MODES = {"prefill_4x8192": (4, 8192), "prefill_1x8192": (1, 8192), "decode_128": (128, 1)}


def gemm_floor(m, k, n):
    return max((m * k + k * n + m * n) * 2 / HBM, 2 * m * k * n / MMA)


def load_mamba_norm():
    return load_mamba_triton("layernorm_gated", "rmsnorm_fn")


def rel_err(ref, out):
    r, o = ref.float(), out.float()
    return ((o - r).norm() / r.norm()).item()


def weights(ly: Mamba2Config, gen):
    r = lambda *s, sc=1.0: torch.randn(*s, generator=gen, device="cuda") * sc  # noqa: E731
    bf = torch.bfloat16
    return dict(
        W_in=r(ly.d_in_proj, ly.d_model, sc=ly.d_model ** -0.5).to(bf),
        W_out=r(ly.d_model, ly.d_inner, sc=ly.d_inner ** -0.5).to(bf),
        conv_w=r(ly.conv_dim, ly.d_conv, sc=0.5).to(bf), conv_b=r(ly.conv_dim, sc=0.2).to(bf),
        A=-(torch.rand(ly.nheads, generator=gen, device="cuda") * 7.5 + 0.5), D=r(ly.nheads),
        dt_bias=r(ly.nheads, sc=0.5), norm_w=(1 + 0.1 * r(ly.d_inner)).to(bf))


def split(ly: Mamba2Config, zxbcdt):
    return torch.split(zxbcdt, [ly.d_inner, ly.conv_dim, ly.nheads], dim=-1)


def torch_conv(ly: Mamba2Config, xBC, w, b):
    """The model's prefill conv (m2export/models/mamba2.py Mamba2Mixer.forward), fresh sequence."""
    xt = xBC.transpose(1, 2)
    xpad = torch.cat([xt.new_zeros(xt.shape[0], ly.conv_dim, ly.d_conv - 1), xt], dim=2)
    new_state = xpad[:, :, xpad.shape[2] - (ly.d_conv - 1):]
    return F.silu(F.conv1d(xpad, w[:, None, :], b, groups=ly.conv_dim)).transpose(1, 2), new_state


def torch_conv_step(ly: Mamba2Config, x, state, w, b):
    """The model's decode conv (the same forward with seqlen 1): concat, conv1d, keep the last d_conv-1."""
    xpad = torch.cat([state, x[:, :, None]], dim=2)
    y = F.silu(F.conv1d(xpad, w[:, None, :], b, groups=ly.conv_dim))[:, :, 0]
    state.copy_(xpad[:, :, 1:])
    return y


PART_KEYS = {"in_proj GEMM": "gemm", "out_proj GEMM": "gemm", "conv1d+SiLU": "conv", "SSM scan": "scan",
             "gated RMSNorm": "norm", "whole layer": "layer"}
"""--parts names of the table's parts."""


def run_mode(name: str, ly: Mamba2Config, mode: str, mamba_norm, rows_out: list, *, rep: int, conv_tiles, norm_tiles,
             update_tiles=(), only=None):
    """Time one layer and mode; ``only``: the set of PART_KEYS values to time (None: all). Without "scan" the scan's
    output buffer, the norm's input, is filled with random values instead of being computed."""
    from m2export.kernels.conv1d import causal_conv1d, conv_update
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile, conv_update_cutile
    from m2export.kernels.gated_norm import gated_rmsnorm
    from m2export.kernels.gated_norm.cutile import gated_rmsnorm_cutile
    from m2export.kernels.ssd import ssm_scan
    from m2export.kernels.ssd_step import ssm_step
    from m2export.contract_conv1d import validate as conv_validate
    from m2export.contract_conv1d import validate_update as conv_validate_update
    from m2export.contract_gated_norm import validate as norm_validate

    batch, seqlen = MODES[mode]
    decode = mode.startswith("decode")
    gen = torch.Generator(device="cuda").manual_seed(7)
    W = weights(ly, gen)
    h, p, g, n, di = ly.nheads, ly.headdim, ly.ngroups, ly.d_state, ly.d_inner
    M = batch * seqlen
    u = torch.randn(M, ly.d_model, generator=gen, device="cuda").to(torch.bfloat16)
    zx = torch.empty(M, ly.d_in_proj, dtype=torch.bfloat16, device="cuda")
    torch.matmul(u, W["W_in"].t(), out=zx)
    zxbcdt = zx.view(batch, seqlen, ly.d_in_proj) if not decode else zx
    z, xBC, dt = split(ly, zxbcdt)
    gsz = di // g
    torch_norm = RMSNormGated(di, group_size=gsz, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        torch_norm.weight.copy_(W["norm_w"])
    out = torch.empty(M, ly.d_model, dtype=torch.bfloat16, device="cuda")
    parts = []  # (part, impl, fn, floor_s, check: (ref_fn, out_fn) or None)

    parts.append(("in_proj GEMM", "torch matmul", lambda: torch.matmul(u, W["W_in"].t(), out=zx),
                  gemm_floor(M, ly.d_model, ly.d_in_proj)))
    if not decode:
        yconv = torch.empty(batch, seqlen, ly.conv_dim, dtype=torch.bfloat16, device="cuda")
        cst = torch.empty(batch, ly.conv_dim, ly.d_conv - 1, dtype=torch.bfloat16, device="cuda")
        conv_fl = 2 * M * ly.conv_dim * 2 / HBM
        ref_y = torch_conv(ly, xBC, W["conv_w"], W["conv_b"])[0]
        res = causal_conv1d(xBC, W["conv_w"], W["conv_b"], out=yconv, state_out=cst)
        torch.cuda.synchronize()
        conv_err = rel_err(ref_y, res.y)
        parts.append(("conv1d+SiLU", f"cutile (rel-err vs torch {conv_err:.1e})",
                      lambda: causal_conv1d(xBC, W["conv_w"], W["conv_b"], out=yconv, state_out=cst), conv_fl))
        cprob = conv_validate(xBC, W["conv_w"], W["conv_b"])
        from m2export.kernels.conv1d.cutile import choose_stream_tiles

        for impl, tl, occ, lat, pf, unc in conv_tiles:
            if tl[0] == 0:  # "fit": the chooser's wave-fitted token range for these rows, channels and occupancy
                tl = (choose_stream_tiles(cprob, 2, torch.cuda.get_device_properties(0).multi_processor_count,
                                          occ or 8, rows=tl[1], fit=True, block_c=tl[2])[0],) + tl[1:]
            fn = (lambda impl=impl, tl=tl, occ=occ, lat=lat, pf=pf, unc=unc: causal_conv1d_cutile(
                xBC, W["conv_w"], W["conv_b"], None, problem=cprob, silu=True, out=yconv, state_out=cst, tiles=tl,
                occupancy=occ, impl=impl, latency=lat, prefetch=pf, unchecked=unc))
            yconv.fill_(float("nan"))
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {mode} conv {impl} {tl}: FAILED {e!r}", file=sys.stderr, flush=True)
                continue
            torch.cuda.synchronize()
            parts.append(("conv1d+SiLU", f"cutile {impl} tiles {'x'.join(map(str, tl))}" + (f" occ {occ}" if occ else "")
                          + (f" lat {lat}" if lat else "") + ("" if pf is None else f" pf {int(pf)}")
                          + ("" if unc is None else f" unchecked {int(unc)}")
                          + f" (rel-err {rel_err(ref_y, yconv):.1e})", fn, conv_fl))
        parts.append(("conv1d+SiLU", "torch (model: cat + F.conv1d + silu)",
                      lambda: torch_conv(ly, xBC, W["conv_w"], W["conv_b"]), conv_fl))
        # the same bytes moved by torch copies: from the strided xBC slice (the conv's input) and from a contiguous copy
        ycopy, xcopy = torch.empty_like(yconv), xBC.contiguous()
        parts.append(("conv1d+SiLU", "torch copy, same bytes: ycopy.copy_(xBC) (strided read)", lambda: ycopy.copy_(xBC),
                      conv_fl))
        parts.append(("conv1d+SiLU", "torch copy, same bytes: ycopy.copy_(contiguous x)", lambda: ycopy.copy_(xcopy),
                      conv_fl))
        xs, Bs, Cs = torch.split(yconv, [di, g * n, g * n], dim=-1)
        xv, Bv, Cv = xs.reshape(batch, seqlen, h, p), Bs.reshape(batch, seqlen, g, n), Cs.reshape(batch, seqlen, g, n)
        xc, dtc, Bc, Cc = xv.contiguous(), dt.contiguous(), Bv.contiguous(), Cv.contiguous()
        yscan = torch.empty(batch, seqlen, h, p, dtype=torch.bfloat16, device="cuda")
        if only is not None and "scan" not in only:
            yscan.copy_(torch.randn(yscan.shape, generator=gen, device="cuda"))
        fstate = torch.empty(batch, h, p, n, dtype=torch.float32, device="cuda")
        sfl = scan_floor_s((batch, seqlen, h, p, g, n))
        scan = lambda a, d_, b_, c_: ssm_scan(a, d_, W["A"], b_, c_, W["D"], W["dt_bias"], out=yscan,  # noqa: E731
                                              final_state_out=fstate)
        parts.append(("SSM scan", "cutile (views of the conv output, read in place)",
                      lambda: scan(xv, dt, Bv, Cv), sfl))
        parts.append(("SSM scan", "cutile, contiguous inputs", lambda: scan(xc, dtc, Bc, Cc), sfl))
        y2 = yscan.view(batch, seqlen, di)
    else:
        yconv = torch.empty(batch, ly.conv_dim, dtype=torch.bfloat16, device="cuda")
        cstate = torch.randn(batch, ly.conv_dim, ly.d_conv - 1, generator=gen, device="cuda").to(torch.bfloat16)
        cstate2 = cstate.clone()
        conv_fl = batch * ly.conv_dim * (2 + 2 * (ly.d_conv - 1)) * 2 / HBM
        ref_y = torch_conv_step(ly, xBC, cstate2.clone(), W["conv_w"], W["conv_b"])
        res = conv_update(xBC, cstate.clone(), W["conv_w"], W["conv_b"], out=yconv)
        torch.cuda.synchronize()
        conv_err = rel_err(ref_y, res.y)
        parts.append(("conv1d+SiLU", f"cutile update, in place (rel-err vs torch {conv_err:.1e})",
                      lambda: conv_update(xBC, cstate, W["conv_w"], W["conv_b"], out=yconv), conv_fl))
        uprob = conv_validate_update(xBC, cstate, W["conv_w"], W["conv_b"])
        for impl, tl in update_tiles:
            fn = (lambda impl=impl, tl=tl, st_=None: conv_update_cutile(
                xBC, cstate if st_ is None else st_, W["conv_w"], W["conv_b"], problem=uprob, silu=True, out=yconv,
                tiles=tl, impl=impl))
            yconv.fill_(float("nan"))
            try:
                fn(st_=cstate2.clone())
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {mode} conv update {impl} {tl}: FAILED {e!r}", file=sys.stderr, flush=True)
                continue
            torch.cuda.synchronize()
            parts.append(("conv1d+SiLU", f"cutile update {impl} tiles {'x'.join(map(str, tl))} "
                          f"(rel-err {rel_err(ref_y, yconv):.1e})", fn, conv_fl))
        parts.append(("conv1d+SiLU", "torch (model: cat + F.conv1d + silu, state copy)",
                      lambda: torch_conv_step(ly, xBC, cstate2, W["conv_w"], W["conv_b"]), conv_fl))
        xs, Bs, Cs = torch.split(yconv, [di, g * n, g * n], dim=-1)
        xv, Bv, Cv = xs.reshape(batch, h, p), Bs.reshape(batch, g, n), Cs.reshape(batch, g, n)
        sstate = torch.randn(batch, h, p, n, generator=gen, device="cuda")
        yscan = torch.empty(batch, h, p, dtype=torch.bfloat16, device="cuda")
        if only is not None and "scan" not in only:
            yscan.copy_(torch.randn(yscan.shape, generator=gen, device="cuda"))
        parts.append(("SSM scan", "cutile step, in place (views read in place)",
                      lambda: ssm_step(xv, dt, W["A"], Bv, Cv, W["D"], W["dt_bias"], sstate, out=yscan,
                                       state_out=sstate), step_bytes(batch, h, p, g, n) / HBM))
        y2 = yscan.view(batch, di)
    nout = torch.empty_like(y2)
    norm_fl = 3 * M * di * 2 / HBM
    if only is None or "norm" in only or "layer" in only:  # the norm's kernels are compiled and checked only when
        # timed (or needed by the layer row's floor)
        ref_n = torch_norm(y2, z)
        gated_rmsnorm(y2, z, W["norm_w"], group_size=gsz, out=nout)
        torch.cuda.synchronize()
        norm_err = rel_err(ref_n, nout)
        parts.append(("gated RMSNorm", f"cutile (rel-err vs torch {norm_err:.1e})",
                      lambda: gated_rmsnorm(y2, z, W["norm_w"], group_size=gsz, out=nout), norm_fl))
        nprob = norm_validate(y2, z, W["norm_w"], group_size=gsz)
        for kind, kw in norm_tiles(nprob):
            fn = lambda kw=kw: gated_rmsnorm_cutile(y2, z, W["norm_w"], problem=nprob, out=nout, **kw)  # noqa: E731
            nout.fill_(float("nan"))
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {mode} norm {kind}: FAILED {e!r}", file=sys.stderr, flush=True)
                continue
            torch.cuda.synchronize()
            parts.append(("gated RMSNorm", f"cutile {kind} (rel-err {rel_err(ref_n, nout):.1e})", fn, norm_fl))
        parts.append(("gated RMSNorm", "torch (model RMSNormGated)", lambda: torch_norm(y2, z), norm_fl))
        if mamba_norm is not None:
            with torch.no_grad():
                t_out = mamba_norm(y2, W["norm_w"], None, z=z, eps=1e-5, group_size=gsz, norm_before_gate=False)
            torch.cuda.synchronize()
            parts.append(("gated RMSNorm", f"mamba_ssm triton rmsnorm_fn (rel-err vs torch {rel_err(ref_n, t_out):.1e})",
                          lambda: mamba_norm(y2, W["norm_w"], None, z=z, eps=1e-5, group_size=gsz,
                                             norm_before_gate=False), norm_fl))
    else:
        parts.append(("gated RMSNorm", "not timed", None, norm_fl))
    parts.append(("out_proj GEMM", "torch matmul", lambda: torch.matmul(nout.view(M, di), W["W_out"].t(), out=out),
                  gemm_floor(M, di, ly.d_model)))

    # whole layer, one graph: ours vs the model's torch ops (scan on cuTile in both)
    def layer(ours: bool):
        torch.matmul(u, W["W_in"].t(), out=zx)
        if decode:
            yc = (conv_update(xBC, cstate, W["conv_w"], W["conv_b"], out=yconv).y if ours
                  else torch_conv_step(ly, xBC, cstate2, W["conv_w"], W["conv_b"]))
            xs_, Bs_, Cs_ = torch.split(yc, [di, g * n, g * n], dim=-1)
            ys = ssm_step(xs_.reshape(batch, h, p), dt, W["A"], Bs_.reshape(batch, g, n), Cs_.reshape(batch, g, n),
                          W["D"], W["dt_bias"], sstate, state_out=sstate).y.view(batch, di)
        else:
            yc = (causal_conv1d(xBC, W["conv_w"], W["conv_b"], out=yconv, state_out=cst).y if ours
                  else torch_conv(ly, xBC, W["conv_w"], W["conv_b"])[0])
            xs_, Bs_, Cs_ = torch.split(yc, [di, g * n, g * n], dim=-1)
            ys = ssm_scan(xs_.reshape(batch, seqlen, h, p), dt, W["A"], Bs_.reshape(batch, seqlen, g, n),
                          Cs_.reshape(batch, seqlen, g, n), W["D"], W["dt_bias"]).y.view(batch, seqlen, di)
        yn = gated_rmsnorm(ys, z, W["norm_w"], group_size=gsz) if ours else torch_norm(ys, z)
        return torch.matmul(yn.reshape(M, di), W["W_out"].t(), out=out)

    for part, impl, fn, fl in parts:
        if only is not None and PART_KEYS[part] not in only:
            continue
        try:
            t = time_fn(fn, graph=True, rep=rep, warmup=min(25, rep))
        except Exception as e:  # noqa: BLE001
            print(f"  {name} {mode} {part} {impl}: FAILED {e!r}", file=sys.stderr, flush=True)
            continue
        rows_out.append(dict(layer=name, mode=mode, part=part, impl=impl, us=t * 1e3, floor_us=fl * 1e6))
        print(f"  {name:14s} {mode:15s} {part:14s} {impl:58s} {t * 1e3:9.1f} us  floor {fl * 1e6:8.1f} us  "
              f"x{t * 1e-3 / fl:5.2f}", flush=True)
    non_gemm_floor = sum({pt: fl for pt, _i, _f, fl in parts if pt not in ("in_proj GEMM", "out_proj GEMM")}.values())
    gemm_fl = sum(fl for pt, _i, _f, fl in parts if pt.endswith("GEMM"))
    for ours in (True, False) if only is None or "layer" in only else ():
        label = "cuTile conv + scan + norm" if ours else "torch conv + norm, cuTile scan"
        try:
            t = time_fn(lambda ours=ours: layer(ours), graph=True, rep=rep, warmup=min(25, rep))
        except Exception as e:  # noqa: BLE001
            print(f"  {name} {mode} whole layer {label}: FAILED {e!r}", file=sys.stderr, flush=True)
            continue
        rows_out.append(dict(layer=name, mode=mode, part="whole layer", impl=label, us=t * 1e3,
                             floor_us=(non_gemm_floor + gemm_fl) * 1e6))
        print(f"  {name:14s} {mode:15s} whole layer    {label:58s} {t * 1e3:9.1f} us  floor "
              f"{(non_gemm_floor + gemm_fl) * 1e6:8.1f} us (non-GEMM floor {non_gemm_floor * 1e6:.1f})", flush=True)
    torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--conv-variants", default="stream2d:256:8:128:8:10:0,stream2d:256:8:128:8:10:1,"
                    "stream2d:256:16:128:8:10:0,stream2d:256:16:128:8:10:1,stream2d:fit:8:128:8:10:1,"
                    "stream2d:fit:16:128:8:10:0",
                    help="extra prefill conv configs, comma list of stream:BLOCK_T:ROWS:BLOCK_C:occupancy[:latency"
                         "[:prefetch[:unchecked]]] (stream2d: the same for conv1d_stream2d_kernel; BLOCK_T 'fit': choose_stream_tiles' "
                         "wave-fitted token range for those rows and channels) or v1:BLOCK_T:BLOCK_C:occupancy (occupancy 0: no hint; "
                         "latency: the row-load hint 1..10, 0 or absent: none; prefetch 0|1 (the next step's rows loaded "
                         "ahead), absent: the default; unchecked 0|1: the "
                         "row tiles' bounds checks skipped where every tile lies inside x, absent: the default), '' "
                         "for none")
    ap.add_argument("--update-variants", default="gather:4:256,cols:4:256,cols:8:256,cols:16:128,cols:1:1024",
                    help="extra decode conv-update configs, comma list of cols|gather:BLOCK_B:BLOCK_C "
                         "(conv_update_cutile's kernels), '' for none")
    ap.add_argument("--norm-variants", default="v2:1:4,v2:2:8,pieces:1:0:4,pieces:1:1:2,pieces:1:1:4,pieces:1:1:8,"
                    "pieces:2:1:2,pieces:2:1:4,pieces:2:1:8,pieces:2:1:16,pieces:4:1:4,pieces:4:1:8,pieces:1:0:16,"
                    "pieces:8:1:2",
                    help="extra gated-norm configs, comma list of v2:BLOCK_R:occupancy (the v2 chooser's tiling of the "
                         "group: one padded tile, or chunks) or pieces:BLOCK_R:TMA(0|1):occupancy (the group's binary "
                         "decomposition, choose_pieces; skipped where it does not apply) or grouped:BLOCK_R:G:TMA:occupancy"
                         "[:CHECK[:WARPS]] (G groups per block, choose_grouped; skipped where it does not apply; CHECK 0: no "
                         "bounds checks; WARPS: the num_worker_warps hint, 4 or 8, 0 or absent: none); occupancy 0: no hint")
    ap.add_argument("--parts", default="", help="comma list of the parts to time (gemm, conv, scan, norm, layer; the "
                    "norm's input is random without scan); '' for all")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)  # inference: no autograd records (the model's norm weight is a Parameter)
    import triton
    import cuda.tile as ct

    conv_tiles = []
    for spec in filter(None, args.conv_variants.split(",")):
        impl, *v = spec.split(":")
        nt = 2 if impl == "v1" else 3
        conv_tiles.append((impl, tuple(0 if t == "fit" else int(t) for t in v[:nt]), int(v[nt]),
                           int(v[nt + 1]) if len(v) > nt + 1 else 0, bool(int(v[nt + 2])) if len(v) > nt + 2 else None,
                           bool(int(v[nt + 3])) if len(v) > nt + 3 else None))
    update_tiles = [(impl, (int(bb), int(bc))) for impl, bb, bc in
                    (sp.split(":") for sp in args.update_variants.split(",") if sp)]
    norm_specs = [(k, tuple(int(t) for t in v)) for k, *v in (sp.split(":") for sp in args.norm_variants.split(",") if sp)]

    def norm_tiles(p):
        """(label, gated_rmsnorm_cutile keywords) of each --norm-variants entry that applies to problem p."""
        from m2export.kernels.gated_norm.cutile import choose_grouped, choose_pieces, choose_tiles

        out = []
        for kind, v in norm_specs:
            if kind == "v2":
                tl = (v[0],) + choose_tiles(p)[1:]
                out.append((f"v2 tiles {tl[0]}x{tl[1]}x{tl[2]} occ {v[1]}", dict(tiles=tl, occupancy=v[1])))
            elif kind == "grouped":
                if choose_grouped(p) is not None:
                    chk = bool(v[4]) if len(v) > 4 else True
                    warps = v[5] if len(v) > 5 and v[5] else None
                    out.append((f"grouped R{v[0]} G{v[1]} tma {v[2]} occ {v[3]}" + ("" if chk else " unchecked")
                                + (f" warps {warps}" if warps else ""),
                                dict(grouped=(v[0], v[1]), tma=bool(v[2]), occupancy=v[3] or 0, check=chk, warps=warps)))
            elif choose_pieces(p) is not None:
                w = choose_pieces(p)
                out.append((f"pieces R{v[0]} {'+'.join(str(x) for x in w if x)} tma {v[1]} occ {v[2]}",
                             dict(pieces=(v[0], *w), tma=bool(v[1]), occupancy=v[2] or 0)))
        return out

    mamba_norm, why = load_mamba_norm()
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()} "
            f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}, cuda.tile {ct.__version__}; bf16; us = median of graph replays")
    print(head, flush=True)
    rows: list = []
    for ln in args.layers.split(","):
        for mode in args.modes.split(","):
            print(f"{ln} {mode} ...", file=sys.stderr, flush=True)
            run_mode(ln, LAYERS[ln], mode, mamba_norm, rows, rep=args.rep, conv_tiles=conv_tiles, norm_tiles=norm_tiles,
                     update_tiles=update_tiles, only=set(args.parts.split(",")) if args.parts else None)
    lines = [f"### Mamba-2 layer parts (issue 18), {head}", "",
             "| layer | mode | part | implementation | us | floor us | x floor |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['mode']} | {r['part']} | {r['impl']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['us'] / r['floor_us']:.2f} |")
    lines += ["", "Floors: GEMM max(bytes/4.3 TB/s, FLOPs/790 TFLOP/s); conv, norm and decode step bytes/4.3 TB/s; "
              "prefill scan bench_ssd.floor_s. Whole layer: the five parts in one graph; its floor sums the parts'."
              + ("" if mamba_norm is not None else f" mamba_ssm not run: {why}.")
              + " causal-conv1d (CUDA extension) not on the device image.", ""]
    append_results("\n".join(lines), args.results)


if __name__ == "__main__":
    main()
