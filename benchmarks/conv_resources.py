"""sm_90 resource report of the streaming conv1d prefill kernel (m2export/kernels/conv1d/cutile.py), built on the CPU.

Each variant is exported for sm_90 with the constraints ``ct.launch`` derives for x / y with 16-divisible extents and
strides (the strided xBC slice of an in_proj output, 8192 tokens; tests/kernels/test_kernels_compile.py) and read back
with cuobjdump: registers, stack frame, shared memory, local-memory instructions (LDL/STL), SASS instructions in all
and in the main loop (the longest backward branch's body: one step of ROWS rows per warp), and in that loop the
16-byte global loads / stores (LDG.E.128 / STG.E.128), MUFU, barriers and shared-memory loads / stores. Usage (the
variant syntax is bench_layer.py's --conv-variants for stream2d; BLOCK_T is a kernel constant: the loop runs
BLOCK_T / ROWS steps at most)::

    CUOBJDUMP=/tmp/cuobj/nvidia/cu13/bin/cuobjdump python benchmarks/conv_resources.py \
        --variants stream2d:336:16:128:8:10:1,stream2d:168:8:256:8:10:1

Results on stdout, one line per variant. ``--dump DIR`` also writes each variant's SASS there.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REGS_PER_SM = 65536
_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _arr(ct, dtype: str, ndim: int, shaped: bool = False, strides16: bool = True):
    from cuda.tile.compilation import ArrayConstraint

    inner = 16 // _SIZE[dtype] if ndim > 1 and strides16 else 1
    a = ArrayConstraint(getattr(ct, dtype), ndim, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                        may_alias_internally=False, stride_constant=(None,) * (ndim - 1) + (1,),
                        stride_divisible_by=(inner,) * (ndim - 1) + (1,), base_addr_divisible_by=16)
    return replace(a, shape_divisible_by=(1,) + (16,) * (ndim - 1)) if shaped else a


def build(dtype: str, block_t: int, rows: int, block_c: int, occupancy: int, latency: int, prefetch: bool, check: bool,
          d_conv: int = 4) -> bytes:
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel

    from m2export.kernels.conv1d import cutile as K

    kern = K.stream_kernel("stream2d", occupancy)
    state = _arr(ct, dtype, 3, strides16=False)
    cons = [_arr(ct, dtype, 3, shaped=True), _arr(ct, dtype, 2, strides16=False), _arr(ct, dtype, 1), state,
            _arr(ct, dtype, 3, shaped=True), state, block_t, rows, block_c, d_conv, True, True, True, latency, prefetch,
            check]
    sig = KernelSignature(cons, CallingConvention.cutile_python_v1()).with_mangled_symbol(kern._pyfunc.__name__)
    buf = io.BytesIO()
    export_kernel(kern, [sig], buf, gpu_code="sm_90", output_format="cubin")
    return buf.getvalue()


def report(cubin: bytes, cuobjdump: str) -> tuple[dict, str]:
    from benchmarks.ssd_resources import cuobjdump_dump

    info, sass = cuobjdump_dump(cubin, cuobjdump)
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    ins = [(int(a, 16), op, rest) for a, _, op, rest in lines]
    info["sass"] = len(ins)
    info["ldl_stl"] = sum(op.startswith(("LDL", "STL")) for _, op, _ in ins)
    # the main loop: the backward branch spanning the most instructions
    best = (0, 0)
    for addr, op, rest in ins:
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr)
    body = [(op, rest) for addr, op, rest in ins if best[0] <= addr <= best[1]]
    info["loop"] = len(body)
    info["loop_ldg128"] = sum(op.startswith("LDG") and ".128" in op for op, _ in body)
    info["loop_stg128"] = sum(op.startswith("STG") and ".128" in op for op, _ in body)
    info["loop_ldg"] = sum(op.startswith("LDG") for op, _ in body)
    info["loop_stg"] = sum(op.startswith("STG") for op, _ in body)
    info["loop_mufu"] = sum(op.startswith("MUFU") for op, _ in body)
    info["loop_bar"] = sum(op.startswith("BAR") for op, _ in body)
    info["loop_smem"] = sum(op.startswith(("LDS", "STS")) for op, _ in body)
    return info, sass


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="stream2d:336:16:128:8:10:1,stream2d:168:8:256:8:10:1")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_SIZE))
    ap.add_argument("--unchecked", action="store_true", help="the CHECK False build (default: the checked one)")
    ap.add_argument("--dump", default="", help="folder for each variant's SASS")
    args = ap.parse_args(argv)
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    for spec in filter(None, args.variants.split(",")):
        impl, bt, rows, bc, occ, lat, pf, *_ = spec.split(":") + ["0"] * 3
        if impl != "stream2d":
            raise SystemExit(f"{spec}: only stream2d variants")
        bt, rows, bc, occ, lat = int(bt), int(rows), int(bc), int(occ), int(lat)
        info, sass = report(build(args.dtype, bt, rows, bc, occ, lat, bool(int(pf)), not args.unchecked), cuobjdump)
        threads = 128  # cuTile's default 4 worker warps
        fit = min(occ or 99, REGS_PER_SM // (max(info.get("REG", 1), 1) * threads))
        per_kb = info["loop"] / (rows * bc * _SIZE[args.dtype] / 1024)
        print(f"{spec} {args.dtype}{' unchecked' if args.unchecked else ''}: REG {info.get('REG')} STACK "
              f"{info.get('STACK')} SHARED {info.get('SHARED')} LOCAL {info.get('LOCAL')} LDL/STL {info['ldl_stl']}, "
              f"SASS {info['sass']}, loop {info['loop']} ({per_kb:.0f} per KB of x), "
              f"loop LDG {info['loop_ldg']} (.128 {info['loop_ldg128']}) STG {info['loop_stg']} "
              f"(.128 {info['loop_stg128']}) MUFU {info['loop_mufu']} BAR {info['loop_bar']} LDS/STS(M) "
              f"{info['loop_smem']}, blocks/SM by registers {fit}", flush=True)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / (spec.replace(":", "_") + ".sass")).write_text(sass)


if __name__ == "__main__":
    main()
