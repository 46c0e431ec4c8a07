"""The SSMScan contract module: specs, shape/dtype rules, attribute round trip, validation messages."""

import math

import pytest

from m2export import contract
from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.errors import ContractError


def test_input_and_output_order_follow_mamba_chunk_scan_combined():
    assert contract.INPUT_NAMES == ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")
    assert contract.OUTPUT_NAMES == ("y", "final_state")
    assert [a.name for a in contract.ATTRIBUTES] == ["chunk_size", "dt_softplus", "dt_min", "dt_max"]


@pytest.mark.parametrize("dims", [(1, 1, 4, 8, 1, 16), (3, 77, 24, 64, 1, 128), (2, 9, 16, 32, 4, 64)])
def test_shape_rule_matches_problem(dims):
    p = SSMScanProblem(*dims, dtype="bfloat16")
    y, fs = contract.output_shapes(p.shape_of("x"), p.shape_of("B"))
    assert y == p.shape_of("y") and fs == p.shape_of("final_state")
    assert contract.output_dtypes("bfloat16") == ("bfloat16", "float32")


def test_dtype_combinations_cover_each_float_dtype_once():
    combos = contract.input_dtype_combinations()
    assert [c["x"] for c in combos] == list(contract.FLOAT_DTYPES)
    for c in combos:
        assert c["dt"] == c["B"] == c["C"] == c["y"] == c["x"]
        assert c["A"] == c["D"] == c["dt_bias"] == c["initial_state"] == c["final_state"] == "float32"


def test_attrs_roundtrip_and_errors():
    a = SSMScanAttrs(chunk_size=64, dt_softplus=True, dt_min=0.001, dt_max=math.inf)
    assert SSMScanAttrs.from_onnx_attributes({**a.onnx_attributes(), "plugin_namespace": "m2export"}) == a
    with pytest.raises(ContractError, match="unknown attribute"):
        SSMScanAttrs.from_onnx_attributes({"chunk": 3})
    with pytest.raises(ContractError, match="chunk_size"):
        SSMScanAttrs(chunk_size=0)


def test_problem_rejects_ungroupable_heads():
    with pytest.raises(ContractError, match="nheads=6, ngroups=4"):
        SSMScanProblem(1, 1, 6, 8, 4, 16)


# ------------------------------------------------------------------------------------------ issue 13, item 4
@pytest.mark.parametrize("kw,match", [
    (dict(dt_limit=(math.inf, math.inf)), "finite dt_min"),
    (dict(dt_limit=("0", "1")), "two numbers"),
    (dict(dt_softplus="no"), "dt_softplus: expected True or False"),
    (dict(chunk_size=0), "chunk_size: expected an integer >= 1"),
])
def test_bad_keywords_break_the_contract(kw, match):
    from m2export.contract import SSMScanAttrs

    with pytest.raises(ContractError, match=match):
        SSMScanAttrs.make(**kw)


@pytest.mark.parametrize("attrs,match", [
    ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": -7}, "chunk_size"), ({"mystery": 1}, "unknown attribute"),
    ({"plugin_version": "2"}, "plugin_version='2'"), ({"plugin_namespace": b"other"}, "plugin_namespace='other'"),
    ({"dt_softplus": 2}, "dt_softplus=2"),
])
def test_bad_node_attributes_break_the_contract(attrs, match):
    from m2export.contract import SSMScanAttrs

    with pytest.raises(ContractError, match=match):
        SSMScanAttrs.from_onnx_attributes(attrs)


def test_nan_A_is_refused_by_the_reference():
    import torch

    from m2export.kernels.ssd.naive import check_decay

    with pytest.raises(ContractError, match="expected A <= 0 and finite"):
        check_decay(torch.tensor([-1.0, float("nan")]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.5])
@pytest.mark.parametrize("entry", ["ssm_scan", "ssm_scan_packed", "ssm_step"])
def test_bad_A_is_refused_on_the_cutile_path_before_the_backend_check(entry, bad):
    """backend="cutile" validated A nowhere (the kernel would run a NaN decay): refused by name, before the
    BackendUnavailable a CPU-only machine gives for a good A (issue 13, item 4)."""
    import torch

    from m2export.errors import BackendUnavailable
    from m2export.kernels.ssd import ssm_scan
    from m2export.kernels.ssd_step import ssm_step
    from tests.helpers import make_inputs

    p = SSMScanProblem(2, 5, 4, 32, 2, 32, dtype="float32")
    inp = make_inputs(p, seed=7)

    def call(A):
        args = dict(inp, A=A)
        if entry == "ssm_step":
            step = {k: (v[:, 0] if k in ("x", "dt", "B", "C") else v) for k, v in args.items()}
            return ssm_step(*(step[k] for k in contract.INPUT_NAMES), backend="cutile")
        if entry == "ssm_scan_packed":
            args = {k: (v.reshape(1, 10, *v.shape[2:]) if k in ("x", "dt", "B", "C") else v) for k, v in args.items()}
            return ssm_scan(*(args[k] for k in contract.INPUT_NAMES), backend="cutile",
                            cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
        return ssm_scan(*(args[k] for k in contract.INPUT_NAMES), backend="cutile")
    A = inp["A"].clone()
    A[1] = bad
    with pytest.raises(ContractError, match=r"A: expected A <= 0 and finite \(A = -exp\(A_log\)\), got "):
        call(A)
    if not torch.cuda.is_available():  # a good A gets as far as the backend check
        with pytest.raises(BackendUnavailable):
            call(inp["A"])


def test_cutile_A_check_is_once_per_tensor_version():
    """On CUDA the check (a device sync) runs once per A object and version: an in-place change is seen."""
    import torch

    from m2export.kernels._host import check_decay_once

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the once-per-version memo applies to CUDA tensors only")
    A = -torch.rand(8, device="cuda") - 0.1
    check_decay_once(A)
    check_decay_once(A)
    A[3] = float("nan")  # bumps A._version
    with pytest.raises(ContractError, match="expected A <= 0 and finite"):
        check_decay_once(A)
