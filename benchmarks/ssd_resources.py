"""sm_90 resource report of the cuTile SSD prefill kernels for one shape and plan, built on the CPU (no GPU).

Each launch of ``make_scan_plan`` is exported for sm_90 with the constraints ``ct.launch`` derives for
contiguous tensors (the TMA path, tests/kernels/test_kernels_compile.py) and read back with cuobjdump:
registers, stack frame, shared memory, threads per block, SASS instructions (all, HGMMA, local-memory
LDL/STL) and the blocks per SM those allow. Usage (the variant syntax is bench_ssd.py's --variants):

    CUOBJDUMP=/path/to/cuobjdump python benchmarks/ssd_resources.py --shape falcon_h1_7b \
        --variants auto,64:16:2:2::::8

Without cuobjdump, PTXAS=/path/to/ptxas reports registers, stack, spill stores and shared memory from ``ptxas -v``
on the cubin's PTX instead (no SASS instruction counts).

Results on stdout, one line per (variant, kernel). Compiles are slow on a loaded CPU (~1-3 min each).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SMEM_PER_SM = 227 * 1024  # sm_90: shared memory a block may use, per SM
REGS_PER_SM = 65536


def cuobjdump_dump(cubin: bytes, cuobjdump: str) -> tuple[dict, str]:
    """({REG, STACK, SHARED, LOCAL: int} of the resource usage, the SASS text) of ``cubin``, read by ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}, sass


def cubin_report(cubin: bytes, cuobjdump: str) -> dict:
    info, sass = cuobjdump_dump(cubin, cuobjdump)
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", sass)
    info["sass"] = len(ins)
    info["hgmma"] = sum(i.startswith("HGMMA") for i in ins)
    info["ldl_stl"] = sum(i.startswith(("LDL", "STL")) for i in ins)
    return info


def ptxas_report(cubin: bytes, ptxas: str) -> dict:
    """What ``ptxas -v`` says of the PTX the cubin was assembled from (registers, stack, spill bytes, shared memory):
    the report where no cuobjdump is installed (no SASS counts then)."""
    from m2export.plugins.aot import ptx_from_cubin, ptx_target

    ptx = ptx_from_cubin(cubin)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([ptxas, "-v", f"-arch={ptx_target(ptx)}", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    info = {"REG": int(re.search(r"Used (\d+) registers", out).group(1)),
            "STACK": int(re.search(r"(\d+) bytes stack frame", out).group(1)),
            "SPILL": int(re.search(r"(\d+) bytes spill stores", out).group(1)),
            "SHARED": int(re.search(r"(\d+) bytes smem", out).group(1))}
    return info


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="falcon_h1_7b", help="a bench_ssd.py shape name")
    ap.add_argument("--variants", default="auto", help="bench_ssd.py --variants syntax")
    ap.add_argument("--initial-state", action="store_true")
    ap.add_argument("--kernels", default="ssd_scan_kernel,ssd_segment_state_kernel",
                    help="kernel names to build (comma list; 'all': every launch)")
    args = ap.parse_args()
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    ptxas = os.environ.get("PTXAS", "")  # set: ptxas -v instead of cuobjdump (no SASS counts)
    os.environ.pop("CUDA_HOME", None)
    os.environ.pop("CUDA_PATH", None)
    import bench_ssd
    from tests.kernels.test_kernels_compile import _export_launch

    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.plugins.aot import ptx_from_cubin, required_threads

    problem = bench_ssd.problem_of(args.shape)
    for label, v in bench_ssd.cutile_variants(args.variants)[0]:
        cfg = bench_ssd.config_of(problem, v)
        plan = make_scan_plan(problem, cfg, dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True,
                              has_dt_bias=True, has_init=args.initial_state)
        for launch in plan.launches:
            if args.kernels != "all" and launch.name not in args.kernels.split(","):
                continue
            cubin = _export_launch(launch)
            if ptxas:
                r = ptxas_report(cubin, ptxas)
                print(f"{args.shape} {label} {cfg.chunk}:{cfg.block_p}:{cfg.nseg} {launch.name} grid {launch.grid}: "
                      f"{r['REG']} regs, stack {r['STACK']} B ({r['SPILL']} B spill stores), smem {r['SHARED']} B, "
                      f"{required_threads(ptx_from_cubin(cubin))} threads (ptxas -v)", flush=True)
                continue
            r = cubin_report(cubin, cuobjdump)
            nt = required_threads(ptx_from_cubin(cubin))
            threads = f", {nt[0] * nt[1] * nt[2]} threads" if nt else ""
            print(f"{args.shape} {label} {cfg.chunk}:{cfg.block_p}:{cfg.nseg} {launch.name} grid {launch.grid}: "
                  f"{r.get('REG')} regs, stack {r.get('STACK')} B, smem {r.get('SHARED')} B, "
                  f"{r['sass']} SASS ({r['hgmma']} HGMMA, {r['ldl_stl']} LDL/STL), "
                  f"<= {SMEM_PER_SM // max(1, r.get('SHARED', 1))} blocks/SM by smem{threads}", flush=True)


if __name__ == "__main__":
    main()
