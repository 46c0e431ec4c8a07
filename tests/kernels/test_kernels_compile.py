"""Every cuTile kernel of the JIT path compiles for sm_90 (no GPU needed: tileiras runs on the CPU).

The GPU tests run these kernels on the H200 through the device tool; this file catches compile
errors on any machine with ``cuda.tile`` and its compiler (``pip install "cuda-tile[tileiras]"``,
part of the ``test`` extra), CI included. Signatures are the ones ``ct.launch`` derives for
contiguous tensors (16-byte aligned bases, strides multiples of 16 bytes: the TMA path).
Skipped when cuda.tile or tileiras is missing.
"""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

ct = pytest.importorskip("cuda.tile")

from tests.helpers import tileiras_skip_reason  # noqa: E402

pytestmark = [pytest.mark.skipif(tileiras_skip_reason() is not None, reason=tileiras_skip_reason() or ""),
              pytest.mark.usefixtures("no_cuda_home")]

_DT = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i32": "int32"}
_SIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}


def _arr(dtype: str, ndim: int):
    from cuda.tile.compilation import ArrayConstraint

    inner = 16 // _SIZE[dtype] if ndim > 1 else 1
    return ArrayConstraint(getattr(ct, _DT[dtype]), ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (ndim - 1) + (1,),
                           stride_divisible_by=(inner,) * (ndim - 1) + (1,), base_addr_divisible_by=16)


def _f32():
    from cuda.tile.compilation import ScalarConstraint

    return ScalarConstraint(ct.float32)


def _i32():
    from cuda.tile.compilation import ScalarConstraint

    return ScalarConstraint(ct.int32)


def _export(kernel, constraints) -> bytes:
    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel

    sig = KernelSignature(constraints, CallingConvention.cutile_python_v1()).with_mangled_symbol(
        kernel._pyfunc.__name__)
    buf = io.BytesIO()
    export_kernel(kernel, [sig], buf, gpu_code="sm_90", output_format="cubin")
    return buf.getvalue()


def _export_launch(launch) -> bytes:
    """Export one kernel with the constraints ct.launch derives for the contiguous tensors of ``launch``."""
    from cuda.tile.compilation import ScalarConstraint

    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32"}
    cons = []
    for a in launch.args:
        if a.kind == "array":
            cons.append(_arr(short[a.dtype], a.ndim))
        elif a.kind == "scalar":
            cons.append(ScalarConstraint(ct.int32 if a.dtype == "int32" else ct.float32))
        else:
            cons.append(a.value)
    return _export(launch.kernel, cons)


# (dtype, chunk, headdim tile, d_state): the defaults of choose_config for bf16 and fp32, and fp16 at d_state 256
CASES = [("bfloat16", 64, 64, 128), ("float32", 32, 64, 128), ("float16", 64, 32, 256)]


@pytest.mark.parametrize("dt,chunk,block_p,d_state", CASES, ids=[f"{c[0]}_Q{c[1]}_N{c[3]}" for c in CASES])
def test_prefill_kernels_compile(dt, chunk, block_p, d_state):
    """The pre-pass, pass-1 and scan kernels of a split plan, from the same launch descriptions ct.launch uses."""
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 700, 8, 64, 2, d_state, dtype=dt)
    cfg = choose_config(p, chunk=chunk, block_p=block_p, nseg=3, dt_pre=True)
    plan = make_scan_plan(p, cfg, dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True,
                          has_init=True)
    assert [launch.name for launch in plan.launches] == ["ssd_dt_kernel", "ssd_segment_state_kernel",
                                                          "ssd_scan_kernel"]
    for launch in plan.launches:
        assert _export_launch(launch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("dt,chunk,block_p,d_state", CASES, ids=[f"{c[0]}_Q{c[1]}_N{c[3]}" for c in CASES])
@pytest.mark.parametrize("has_init", [True, False], ids=["init", "no_init"])
def test_packed_prefill_kernels_compile(dt, chunk, block_p, d_state, has_init):
    """The packed form (cu_seqlens, one launch group for every sequence): pre-pass, pass 1 and scan with PACKED set,
    the arrays cu_seqlens and seq_idx int32; a plan without the pre-pass or with a merged tail is refused."""
    from m2export.contract import SSMScanProblem
    from m2export.errors import ContractError
    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(1, 700, 8, 64, 2, d_state, dtype=dt)
    kw = dict(dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True, has_init=has_init,
              packed=True)
    plan = make_scan_plan(p, choose_config(p, chunk=chunk, block_p=block_p, nseg=3, dt_pre=True, merge_tail=False),
                          **kw)
    assert [launch.name for launch in plan.launches] == ["ssd_dt_kernel", "ssd_segment_state_kernel",
                                                          "ssd_scan_kernel"]
    assert ("seq_idx", (-(-700 // chunk) * chunk,), "int32") in plan.scratch
    for launch in plan.launches:
        consts = {a.name: a.value for a in launch.args if a.kind == "constant"}
        arrays = {a.name: a for a in launch.args if a.kind == "array"}
        assert consts["PACKED"] is True and arrays["cu_seqlens"].dtype == "int32" and arrays["cu_seqlens"].src == \
            "cu_seqlens"
        assert _export_launch(launch)[:4] == b"\x7fELF"
    for bad in (dict(dt_pre=False), dict(merge_tail=True)):
        with pytest.raises(ContractError, match="packed form needs"):
            make_scan_plan(p, choose_config(p, nseg=1, **{"dt_pre": True, "merge_tail": False, **bad}), **kw)


def test_packed_config():
    """packed_config: choose_config's plan for the packed length (or a tile family's) with the pre-pass and one launch
    per headdim piece (head dim 80: pieces 64 + 16, no merged tail); past the pre-pass grid it refuses in one line."""
    from m2export.contract import SSMScanProblem
    from m2export.errors import ContractError
    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.kernels.ssd.plan import packed_config
    from m2export.kernels.ssd.plan import MAX_GRID_Y, choose_config, tile_families

    p = SSMScanProblem(1, 8192, 80, 80, 1, 128, dtype="bfloat16")
    cfg = packed_config(p, sm_count=132)
    assert cfg.dt_pre and not cfg.merge_tail and cfg.nseg == choose_config(p, dt_pre=True, merge_tail=False).nseg
    fam = tile_families(p)[-1]
    tcfg = packed_config(p, sm_count=132, tiles=fam)
    assert (tcfg.chunk, tcfg.block_p, tcfg.dt_pre, tcfg.merge_tail) == (fam.chunk, fam.block_p, True, False)
    plan = make_scan_plan(p, cfg, dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True,
                          has_init=True, packed=True)
    assert [(l.name, {a.name: a.value for a in l.args}.get("BLOCK_P")) for l in plan.launches][1:] == [
        (n, w) for w in (64, 16) for n in (["ssd_segment_state_kernel"] if cfg.nseg > 1 else []) + ["ssd_scan_kernel"]]
    big = SSMScanProblem(1, (MAX_GRID_Y + 1) * 64, 8, 64, 1, 128, dtype="bfloat16")
    with pytest.raises(ContractError, match="pre-pass grid"):
        packed_config(big, sm_count=132)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "pieces"])
def test_prefill_kernels_compile_split_headdim(merge):
    """Head dim 80 (Nemotron-Nano): a split plan's pass-1 and pass-2 kernels, either one pair whose blocks own the
    64-row tile and the 16-row tail (merge_tail: TAIL_TILE 4, in units of 16 rows) or one pair per headdim piece
    (64 rows from tile 0, 16 rows from tile 4: P_TILE0); and the AOT kernel's masked 2 x 64-row grid."""
    from m2export.contract import SSMScanAttrs, SSMScanProblem
    from m2export.kernels.launch import Launch
    from m2export.kernels.ssd.cutile import aot_spec, make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 700, 8, 80, 2, 128, dtype="bfloat16")
    plan = make_scan_plan(p, choose_config(p, nseg=3, merge_tail=merge), dt_softplus=True,
                          dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True, has_init=True)
    consts = [{a.name: a.value for a in l.args if a.kind == "constant"} for l in plan.launches[1:]]
    got = [(c["BLOCK_P"], c["P_TILE0"], c["HAS_TAIL"], c["TAIL_P"], c["TAIL_TILE"]) for c in consts]
    assert got == ([(64, 0, True, 16, 4)] * 2 if merge else [(64, 0, False, 64, 0)] * 2 + [(16, 4, False, 16, 0)] * 2)
    spec = aot_spec(p, SSMScanAttrs())
    assert spec.grid(2, 8, 80) == (16, 1, 2)
    for launch in (*plan.launches, Launch(spec.kernel, spec.args, spec.grid(2, 8, 80), spec.config)):
        assert _export_launch(launch)[:4] == b"\x7fELF"


def test_d_state_256_default_plan_compiles():
    """bf16 d_state 256 (Falcon-H1-7B): choose_config's own plan (chunk 64, 32-row tiles, the state as (headdim,
    d_state)): pass 1 and pass 2."""
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 8192, 24, 128, 1, 256, dtype="bfloat16")
    cfg = choose_config(p)
    assert (cfg.chunk, cfg.block_p, cfg.nseg, cfg.state_t) == (64, 32, 1, False)
    plan = make_scan_plan(p, cfg, dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True,
                          has_init=True)
    for launch in plan.launches[1:]:
        assert _export_launch(launch)[:4] == b"\x7fELF"


def _threads(cubin: bytes) -> int:
    from m2export.plugins.aot import ptx_from_cubin, required_threads

    nt = required_threads(ptx_from_cubin(cubin))
    return nt[0] * nt[1] * nt[2] if nt else 0


# (kind, shape (batch, seqlen, nheads, headdim, ngroups, d_state), dtype): Falcon-H1-7B's JIT default (64:32, the
# state as (headdim, d_state)), Nemotron-Nano-9B's merged-tail JIT default (64 + 16 rows, (headdim, d_state)) and
# the AOT kernel's default tiles at d_state 128 (64:64, (d_state, headdim)) launched by ct.launch (the TensorRT
# build of the AOT kernel never uses TMA, so it has no producer warp group: tests/kernels/test_ssd_aot.py)
WS_INIT_CASES = [("jit", (2, 8192, 24, 128, 1, 256), "bfloat16"), ("jit", (1, 8192, 128, 80, 8, 128), "bfloat16"),
                 ("jit", (1, 8192, 128, 80, 8, 128), "float16"), ("aot_tiles", (2, 8192, 128, 64, 8, 128), "bfloat16"),
                 ("aot_tiles", (2, 8192, 128, 64, 8, 128), "float16")]


@pytest.mark.parametrize("kind,shape,dtype", WS_INIT_CASES,
                         ids=[f"{c[0]}_P{c[1][3]}_N{c[1][5]}_{c[2]}" for c in WS_INIT_CASES])
def test_scan_with_initial_state_keeps_the_warp_specialised_build(kind, shape, dtype):
    """With an initial state the scan kernel keeps tileiras's warp-specialised build (256 threads: a producer warp
    group issuing the TMA loads, a consumer group) on these plans, as without one. At d_state 256 and in the AOT
    kernel plan.init_tma_default makes the initial-state load a plain load: through TMA these builds had 128 threads
    (255 or 254 registers), and the 128-thread build measured 0.827 against 0.401 ms on Falcon-H1-7B. The merged
    tail keeps the TMA load and the state as (headdim, d_state) (plan._MERGED_TAIL_STATE_T): as (d_state, headdim)
    it built 128 threads with either load, and ran 0.581 ms with a state against 0.346 without on Nemotron-Nano-9B
    (benchmarks/NOTES_ssd.md). Depends on the pinned tileiras (13.4)."""
    from m2export.contract import SSMScanAttrs, SSMScanProblem
    from m2export.kernels.ssd.cutile import aot_spec, fused_launch, make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(*shape, dtype=dtype)
    if kind == "aot_tiles":
        launch = fused_launch(p, aot_spec(p, SSMScanAttrs(), has_initial_state=True).config, dt_softplus=True,
                              dt_limit=(0.0, float("inf")))
        assert not launch.config.init_tma
    else:
        cfg = choose_config(p)
        assert not cfg.state_t and cfg.init_tma == (p.d_state < 256)
        plan = make_scan_plan(p, cfg, dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True,
                              has_init=True)
        (launch,) = [la for la in plan.launches if la.name == "ssd_scan_kernel"]
    assert _threads(_export_launch(launch)) == 256


#: cb_pre plans (ssd_cb_kernel before the scan): shape, dtype, choose_config overrides, and the scan's threads per
#: block (with, without an initial state; None: not asserted). With cb_pre 1 fp16 builds 128 threads with an initial
#: state (254 registers; tileiras drops warp specialisation), as the merged tail (80 = 64 + 16) does in bf16.
CB_PRE_COMPILE = [((4, 8192, 80, 64, 1, 128), "bfloat16", dict(cb_pre=1), (256, 256)),
                  ((2, 700, 8, 64, 2, 128), "float16", dict(cb_pre=1, nseg=2), (None, 256)),
                  ((2, 8192, 24, 128, 1, 256), "bfloat16", dict(cb_pre=1, chunk=64, block_p=16, occupancy=3),
                   (256, 256)),
                  ((2, 700, 8, 64, 2, 64), "float32", dict(cb_pre=1, nseg=2), (None, None)),
                  ((2, 8192, 24, 128, 1, 256), "bfloat16", dict(cb_pre=2), (256, 256)),
                  ((2, 700, 12, 128, 2, 256), "bfloat16", dict(cb_pre=2, nseg=2), (256, 256))]


@pytest.mark.parametrize("shape,dtype,kw,ws", CB_PRE_COMPILE,
                         ids=[f"P{c[0][3]}_N{c[0][5]}_{c[1]}_cb{c[2]['cb_pre']}" for c in CB_PRE_COMPILE])
@pytest.mark.parametrize("has_init", [True, False], ids=["init", "no_init"])
def test_cb_pre_plan_compiles(shape, dtype, kw, ws, has_init):
    """Every launch of a cb_pre plan (pre-pass, ssd_cb_kernel, pass 1, scan reading C @ B^T or M) compiles for sm_90;
    the d_state-128 default tiles and Falcon-H1-7B's tiles keep the warp-specialised scan build (256 threads) with
    and without an initial state (pinned tileiras 13.4). A cb_pre plan without the pre-pass is refused."""
    from dataclasses import replace

    from m2export.contract import SSMScanProblem
    from m2export.errors import ContractError
    from m2export.kernels.ssd.cutile import m_heads, make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(*shape, dtype=dtype)
    cfg = choose_config(p, **kw)
    kwargs = dict(dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True, has_init=has_init)
    plan = make_scan_plan(p, cfg, **kwargs)
    names = [la.name for la in plan.launches]
    assert names[:2] == ["ssd_dt_kernel", "ssd_cb_kernel"] and names[-1] == "ssd_scan_kernel"
    rows, width = -(-p.seqlen // cfg.chunk) * cfg.chunk, cfg.chunk
    want = ((p.batch, p.ngroups, rows, width), "float32") if cfg.cb_pre == 1 else ((p.batch, p.nheads, rows, width),
                                                                                   p.dtype)
    assert ("cb_pre", *want) in plan.scratch
    (cb,) = [la for la in plan.launches if la.name == "ssd_cb_kernel"]
    assert cb.grid == (p.batch, rows // width, p.ngroups if cfg.cb_pre == 1 else p.nheads // m_heads(p.heads_per_group))
    for launch in plan.launches:
        cubin = _export_launch(launch)
        assert cubin[:4] == b"\x7fELF"
        if launch.name == "ssd_scan_kernel" and ws[not has_init]:
            assert _threads(cubin) == ws[not has_init]
    with pytest.raises(ContractError, match="cb_pre needs the pre-pass"):
        make_scan_plan(p, replace(cfg, dt_pre=False), **kwargs)


#: cb_state plans (C @ B^T and C @ state^T as one product): shape, dtype, choose_config overrides, scan threads per block
#: without an initial state (None: not asserted; the merged tail 80 = 64 + 16 builds 128 threads with tileiras 13.4)
CB_STATE_COMPILE = [((4, 8192, 80, 64, 1, 128), "bfloat16", dict(cb_state=True), 256),
                    ((1, 8192, 128, 64, 8, 128), "float16", dict(cb_state=True), 256),
                    ((2, 700, 8, 64, 2, 64), "bfloat16", dict(cb_state=True, nseg=2), 256),
                    ((1, 700, 4, 32, 2, 64), "float32", dict(cb_state=True, chunk=32, block_p=32, nseg=2), None),
                    ((1, 8192, 128, 80, 8, 128), "bfloat16", dict(cb_state=True), None)]


@pytest.mark.parametrize("shape,dtype,kw,ws", CB_STATE_COMPILE,
                         ids=[f"P{c[0][3]}_N{c[0][5]}_{c[1]}" for c in CB_STATE_COMPILE])
def test_cb_state_plan_compiles(shape, dtype, kw, ws):
    """Every launch of a cb_state plan compiles for sm_90 without an initial state; the d_state 64/128 tiles keep the
    warp-specialised scan build (256 threads) and fit two blocks per SM in shared memory (C loaded with a latency-1
    hint: 108 KB at d_state 128 where the one-product loop otherwise needs 116 KB, over the 227 KB / 2 - 1 KB an SM
    gives two blocks). Pinned tileiras 13.4."""
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(*shape, dtype=dtype)
    plan = make_scan_plan(p, choose_config(p, **kw), dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True,
                          has_dt_bias=True, has_init=False)
    for launch in plan.launches:
        cubin = _export_launch(launch)
        assert cubin[:4] == b"\x7fELF"
        if launch.name == "ssd_scan_kernel" and ws:
            assert _threads(cubin) == ws
            assert _shared_bytes(cubin) <= 233472 // 2 - 1024


def _shared_bytes(cubin: bytes) -> int:
    """Static shared memory of the cubin's kernel (cuobjdump -res-usage), bytes."""
    import re
    import shutil
    import subprocess
    import tempfile

    tool = shutil.which("cuobjdump") or _pip_tool("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"SHARED:(\d+)", out).group(1))


def _pip_tool(name: str):
    import os

    try:
        import nvidia.cu13 as cu13
    except ImportError:
        return None
    path = os.path.join(list(cu13.__path__)[0], "bin", name)
    return path if os.path.exists(path) else None


def test_m_heads_divides_the_group():
    from m2export.kernels.ssd.cutile import m_heads

    assert [m_heads(n) for n in (1, 2, 3, 6, 12, 16, 24, 80)] == [1, 2, 1, 2, 4, 8, 8, 8]


@pytest.mark.parametrize("block_p,d_state,occupancy", [(64, 128, 2), (8, 64, 8)])
def test_step_kernel_compiles(block_p, d_state, occupancy):
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd_step.cutile import step_launch

    launch = step_launch(SSMScanProblem(4, 1, 8, 64, 2, d_state, dtype="bfloat16"), block_p=block_p,
                         occupancy=occupancy, dt_softplus=True, dt_limit=(0.0, float("inf")))
    assert _export_launch(launch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("block_r,d_state,has_state", [(64, 128, True), (32, 256, False)])
def test_step_rows_kernel_compiles(block_r, d_state, has_state):
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd_step.cutile import rows_launch

    launch = rows_launch(SSMScanProblem(64, 1, 8, 80, 2, d_state, dtype="bfloat16"), block_r=block_r, occupancy=2,
                         dt_softplus=True, dt_limit=(0.0, float("inf")), has_state=has_state)
    assert _export_launch(launch)[:4] == b"\x7fELF"


def _shaped(dt: str, ndim: int):
    """_arr with every extent but the first divisible by 16, as ct.launch derives it for 8192 tokens x
    5376 channels (with it tileiras emits 16-byte loads; without it, one 2-byte load per element)."""
    from dataclasses import replace

    return replace(_arr(dt, ndim), shape_divisible_by=(1,) + (16,) * (ndim - 1))


@pytest.mark.parametrize("dt,d_conv", [("bf16", 4), ("f32", 2), ("f16", 3)])
def test_conv1d_kernels_compile(dt, d_conv):
    """Prefill (the one-pass streaming kernel, and v1: per-tap kernel + edge) and the update; the state
    arrays' rows (d_conv-1 elements) are not 16-byte multiples, hence plain stride constraints for them.
    The default streaming kernel's token rows (stream2d with its hints and tiles, checked and unchecked builds) are
    16-byte loads (ld.global.v4) in its PTX; the 1-D stream kernel at 256 channels builds too. The update: both kernels."""
    from dataclasses import replace

    from m2export.contract_conv1d import Conv1dProblem
    from m2export.kernels.conv1d import cutile as K
    from m2export.plugins.aot import ptx_from_cubin

    p = Conv1dProblem(batch=4, seqlen=8192, conv_dim=5376, d_conv=d_conv)
    bt, bc = K.choose_fwd_tiles(p)
    state = replace(_arr(dt, 3), stride_divisible_by=(1, 1, 1))
    w2 = replace(_arr(dt, 2), stride_divisible_by=(1, 1))
    tiles = K.choose_stream_tiles(p, _SIZE[dt])
    assert K.stream_unchecked(p, tiles, unchecked=True) and not K.stream_unchecked(p, tiles, unchecked=False)
    streams = [_export(K.stream_kernel(), [_shaped(dt, 3), w2, _arr(dt, 1), state, _shaped(dt, 3), state, *tiles,
                                           d_conv, True, True, True, K.STREAM_LATENCY, K.STREAM_PREFETCH, check])
               for check in (True, False)]  # the AOT plugin's checked build, the JIT launch's unchecked one here
    for stream in streams:
        assert "ld.global.v4" in ptx_from_cubin(stream)
    s1d = _export(K.conv1d_stream_kernel, [_shaped(dt, 3), w2, _arr(dt, 1), state, _shaped(dt, 3), state,
                                           256, 8, 256, d_conv, True, True, True, 0, False, True])
    assert "ld.global" in ptx_from_cubin(s1d)
    fwd = _export(K.conv1d_fwd_kernel, [_arr(dt, 3), w2, _arr(dt, 1), _arr(dt, 3), bt, bc, d_conv, True, True])
    edge = _export(K.conv1d_edge_kernel, [_arr(dt, 3), _arr(dt, 2), _arr(dt, 1), state, _arr(dt, 3), state,
                                          K.EDGE_BLOCK_C, d_conv, True, True, True])
    upd = _export(K.conv1d_update_kernel, [_arr(dt, 2), w2, _arr(dt, 1), state, _arr(dt, 2), 4, 256, d_conv, True, True])
    updc = _export(K.conv1d_update_cols_kernel, [_arr(dt, 2), w2, _arr(dt, 1), state, _arr(dt, 2),
                                                 *K.choose_update_tiles(p), d_conv, True, True])
    for cubin in (*streams, s1d, fwd, edge, upd, updc):
        assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("dt,group_size,ngroups,norm_before_gate",
                         [("bf16", 5120, 1, False), ("bf16", 5120, 2, False), ("f16", 1024, 8, True), ("f32", 48, 2, False),
                          ("f32", 7168, 1, True)])
def test_gated_norm_kernel_compiles(dt, group_size, ngroups, norm_before_gate):
    """The launcher's choice: grouped (8 groups of 1024 per block), pieces (5120 = 4096 + 1024, 7168 in
    three) or chunks (5120 or 48 in several groups); and the padded tile."""
    from m2export.contract_gated_norm import GatedNormProblem
    from m2export.kernels.gated_norm import cutile as K
    from m2export.plugins.aot import ptx_from_cubin

    p = GatedNormProblem(rows=32768, d_inner=group_size * ngroups, group_size=group_size)
    a2 = _shaped(dt, 2)
    w = K.choose_pieces(p)
    gr = K.choose_grouped(p)
    if gr is not None:
        kernel = K.hinted(K.gated_rmsnorm_grouped_kernel, K.choose_occupancy((gr[0], gr[1] * group_size), _SIZE[dt]))
        assert _export(kernel, [a2, a2, _arr(dt, 1), a2, _i32(), _f32(), *gr, group_size, norm_before_gate,
                                K.PIECES_TMA, True])[:4] == b"\x7fELF"
    elif w is not None:
        br = K.choose_pieces_rows(p)
        kernel = K.hinted(K.gated_rmsnorm_pieces_kernel, K.choose_occupancy((br, group_size), _SIZE[dt]))
        cubin = _export(kernel, [a2, a2, _arr(dt, 1), a2, _i32(), _f32(), br, *w, norm_before_gate, K.PIECES_TMA])
        ptx = ptx_from_cubin(cubin)
        # x, z in and out through the bulk tensor copy (TMA) when PIECES_TMA, else 16-byte plain accesses
        assert ("cp.async.bulk.tensor" in ptx) if K.PIECES_TMA else ("ld.global.v4" in ptx and "st.global.v4" in ptx)
    tiles = K.choose_tiles(p)
    kernel = K.hinted(K.gated_rmsnorm_kernel, K.choose_occupancy(tiles, _SIZE[dt]))
    cubin = _export(kernel, [_arr(dt, 2), _arr(dt, 2), _arr(dt, 1), _arr(dt, 2), _i32(), _f32(), *tiles, norm_before_gate])
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_gated_norm_decode_kernel_compiles(dt):
    """The decode regime (choose_grouped_small: Nemotron-H's 8 groups of 1024 at 128 rows): one (row, group) per block,
    unchecked plain loads and stores, 16-byte wide, and no bulk copy (no tensor map, no producer warps)."""
    from m2export.contract_gated_norm import GatedNormProblem
    from m2export.kernels.gated_norm import cutile as K
    from m2export.plugins.aot import ptx_from_cubin

    kw = K.choose_grouped_small(GatedNormProblem(rows=128, d_inner=8192, group_size=1024))
    a2 = _shaped(dt, 2)
    w1 = replace(_arr(dt, 1), shape_divisible_by=(16,))
    kernel = K.hinted(K.gated_rmsnorm_grouped_kernel, kw["occupancy"] or None, kw["warps"])
    ptx = ptx_from_cubin(_export(kernel, [a2, a2, w1, a2, _i32(), _f32(), *kw["grouped"], 1024, False, kw["tma"],
                                          kw["check"]]))
    wide = "v4" if dt == "f32" or kw["warps"] != 8 else "v2"  # 8 warps: 4 elements per thread (8 bytes of bf16)
    assert f"ld.global.{wide}" in ptx and f"st.global.{wide}" in ptx and "cp.async.bulk" not in ptx


# every candidate of the tuning space (kernels/ssd/plan.py tile_families) on a Mamba-2 / Nemotron-H shape
# (bf16, d_state 128), Falcon-H1-7B's (bf16, d_state 256, headdim 128) and an fp32 one: what TensorRT's
# build-time autotune and M2EXPORT_AUTOTUNE=1 may launch must compile
_FAMILY_SHAPES = [(64, 128, "bfloat16"), (128, 256, "bfloat16"), (64, 64, "float32")]


@pytest.mark.parametrize("headdim,d_state,dt", _FAMILY_SHAPES, ids=[f"P{p}_N{n}_{d}" for p, n, d in _FAMILY_SHAPES])
def test_every_tile_family_compiles(headdim, d_state, dt):
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd.cutile import make_scan_plan
    from m2export.kernels.ssd.plan import config_for, tile_families

    p = SSMScanProblem(2, 700, 8, headdim, 2, d_state, dtype=dt)
    for fam in tile_families(p):
        plan = make_scan_plan(p, config_for(p, fam), dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True,
                              has_dt_bias=True, has_init=True)
        scan = [launch for launch in plan.launches if launch.name == "ssd_scan_kernel"]
        assert scan, plan.launches
        for launch in scan[:1]:
            assert _export_launch(launch)[:4] == b"\x7fELF", fam


@pytest.mark.parametrize("dt,chunk,block_p,d_state", CASES, ids=[f"{c[0]}_Q{c[1]}_N{c[3]}" for c in CASES])
@pytest.mark.parametrize("has_init", [True, False], ids=["init", "no_init"])
def test_packed_work_item_kernels_compile(dt, chunk, block_p, d_state, has_init):
    """The packed form as routed (m2export.kernels.ssd.cutile_packed: one block per sequence segment over the
    sequence's sliced views, driven by the work table): pre-pass, pass 1 and pass 2 for sm_90."""
    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd.cutile_packed import make_packed_plan
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(1, 700, 8, 64, 2, d_state, dtype=dt)
    cfg = choose_config(p, chunk=chunk, block_p=block_p, nseg=3, dt_pre=True, merge_tail=False)
    plan = make_packed_plan(p, cfg, dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True,
                            has_dt_bias=True, has_init=has_init)
    launches = [plan.dt] + [l for seg, scan, _ in plan.pieces for l in (seg, scan)]
    assert [l.name for l in launches] == ["ssd_packed_dt_kernel", "ssd_packed_segment_kernel",
                                          "ssd_packed_scan_kernel"]
    for launch in launches:
        assert _export_launch(launch)[:4] == b"\x7fELF"


def test_packed_work_table():
    """packed_work: a sequence of L tokens is ceil(L / chunk) chunks of its own (chunk table rows a, e, k, sequence
    by sequence), cut into items of at most seg_chunks chunks (near-equal, none empty) covering them, numbered in
    sequence order, folds pointing at the sequence's first item, each item's coef_chunk0 the chunk-table row of
    its sequence's chunk 0; rows of each pass longest first; pass-1 rows for every item but a sequence's last;
    empty sequences listed and owning no item and no chunk."""
    from m2export.kernels.ssd.cutile_packed import CHUNK_COLUMNS, WORK_COLUMNS, packed_work

    cu = [0, 63, 63, 128, 1000, 1001]  # boundary inside chunk 0, an empty sequence, one on a chunk edge, L=1
    w = packed_work(cu, 64, 5)
    items = [dict(zip(WORK_COLUMNS, r)) for r in w.rows]
    main, p1 = items[:len(w.rows) - w.npass1], items[len(w.rows) - w.npass1:]
    chunks = [dict(zip(CHUNK_COLUMNS, r)) for r in w.chunks]
    assert w.empties == [1]
    assert [(c["a"], c["e"], c["k"]) for c in chunks] == (
        [(0, 63, 0), (63, 128, 0), (63, 128, 1)] + [(128, 1000, k) for k in range(14)] + [(1000, 1001, 0)])
    by_item = sorted(main, key=lambda it: it["item"])
    assert [it["item"] for it in by_item] == list(range(len(main)))
    sizes = [it["k_end"] - it["k_begin"] for it in main]
    assert sizes == sorted(sizes, reverse=True)  # longest first
    for s in (0, 2, 3, 4):
        mine = [it for it in by_item if it["seq"] == s]
        n = -(-(cu[s + 1] - cu[s]) // 64)
        assert mine and all(it["a"] == cu[s] and it["e"] == cu[s + 1] for it in mine)
        assert mine[0]["k_begin"] == 0 and mine[-1]["k_end"] == n
        assert all(x["k_end"] == y["k_begin"] for x, y in zip(mine, mine[1:]))
        assert all(0 < it["k_end"] - it["k_begin"] <= 5 for it in mine)
        assert [it["last"] for it in mine] == [0] * (len(mine) - 1) + [1]
        assert all(it["first_item"] == mine[0]["item"] for it in mine)
        c0 = mine[0]["coef_chunk0"]
        assert all(it["coef_chunk0"] == c0 for it in mine)
        assert [(chunks[c0 + k]["a"], chunks[c0 + k]["k"]) for k in range(n)] == [(cu[s], k) for k in range(n)]
    assert sorted(map(tuple, (r.values() for r in p1))) == sorted(tuple(it.values()) for it in main
                                                                      if not it["last"])
    assert w.npass1 == 2  # sequence 3: 14 chunks -> 5 + 5 + 4
    assert [(it["k_begin"], it["k_end"]) for it in by_item if it["seq"] == 3] == [(0, 5), (5, 10), (10, 14)]
