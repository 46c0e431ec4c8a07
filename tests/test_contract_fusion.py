"""The CausalConv1d and GatedRMSNorm contracts: names, shape rules, validation messages."""

import pytest
import torch

from m2export import contract_conv1d as cc
from m2export import contract_gated_norm as cg
from m2export.errors import ContractError


def test_conv1d_names_and_shape_rule():
    assert cc.INPUT_NAMES == ("x", "weight", "bias", "conv_state")
    assert cc.OUTPUT_NAMES == ("y", "final_conv_state")
    p = cc.Conv1dProblem(batch=3, seqlen=7, conv_dim=200, d_conv=4, dtype="bfloat16")
    assert cc.output_shapes(p.shape_of("x"), p.shape_of("weight")) == (p.shape_of("y"), p.shape_of("final_conv_state"))
    assert p.shape_of("final_conv_state") == (3, 200, 3)


def test_conv1d_validate_accepts_a_slice_of_the_in_proj_output():
    zxbcdt = torch.zeros(2, 5, 300)
    p = cc.validate(zxbcdt[..., 40:240], torch.zeros(200, 3), torch.zeros(200), torch.zeros(2, 200, 2))
    assert (p.batch, p.seqlen, p.conv_dim, p.d_conv, p.dtype) == (2, 5, 200, 3, "float32")


@pytest.mark.parametrize("kwargs,msg", [
    (dict(weight=torch.zeros(200, 5)), "d_conv: expected 2 <= d_conv <= 4, got 5"),
    (dict(weight=torch.zeros(199, 4)), r"weight: expected \(conv_dim=200, d_conv\), got \(199, 4\) \(conv_dim mismatch\)"),
    (dict(bias=torch.zeros(200, dtype=torch.float16)), "bias: expected dtype float32 .the dtype of x., got float16"),
    (dict(conv_state=torch.zeros(2, 200, 2)), r"conv_state: expected \(batch=2, conv_dim=200, d_conv_m1=3\), got \(2, 200, 2\)"),
    (dict(x=torch.zeros(2, 200, 5).transpose(1, 2)), "x: expected last stride 1"),
    (dict(x=torch.zeros(2, 5, 200, dtype=torch.int32)), "x: expected dtype in"),
])
def test_conv1d_validate_messages(kwargs, msg):
    args = dict(x=torch.zeros(2, 5, 200), weight=torch.zeros(200, 4), bias=torch.zeros(200), conv_state=None)
    args.update(kwargs)
    with pytest.raises(ContractError, match=msg):
        cc.validate(**args)


def test_conv1d_update_needs_2d_x_and_a_state():
    w = torch.zeros(8, 4)
    assert cc.validate_update(torch.zeros(3, 8), torch.zeros(3, 8, 3), w).seqlen == 1
    with pytest.raises(ContractError, match="x: expected a 2-D"):
        cc.validate_update(torch.zeros(3, 1, 8), torch.zeros(3, 8, 3), w)
    with pytest.raises(ContractError, match="conv_state: required"):
        cc.validate_update(torch.zeros(3, 8), None, w)
    with pytest.raises(ContractError, match="activation"):
        cc.check_activation("gelu")


def test_gated_norm_validate():
    x = torch.zeros(2, 3, 96)
    z = torch.zeros(2, 3, 200)[..., 10:106]
    p = cg.validate(x, z, torch.zeros(96), group_size=48, norm_before_gate=True)
    assert (p.rows, p.d_inner, p.group_size, p.ngroups, p.norm_before_gate) == (6, 96, 48, 2, True)
    assert cg.validate(x, z, torch.zeros(96)).group_size == 96
    assert p.onnx_attributes() == {"group_size": 48, "eps": 1e-5, "norm_before_gate": 1}


@pytest.mark.parametrize("kwargs,msg", [
    (dict(group_size=50), "group_size: expected a divisor of d_inner=96, got 50"),
    (dict(z=torch.zeros(2, 3, 95)), r"z: expected the shape of x \(2, 3, 96\), got \(2, 3, 95\)"),
    (dict(weight=torch.zeros(96, dtype=torch.bfloat16)), "weight: expected dtype float32"),
    (dict(weight=torch.zeros(48)), r"weight: expected \(d_inner=96,\), got \(48,\)"),
    (dict(z=torch.zeros(2, 96, 3).transpose(1, 2)), "z: expected last stride 1"),
    (dict(eps=0.0), "eps: expected a finite number > 0"),
])
def test_gated_norm_validate_messages(kwargs, msg):
    args = dict(x=torch.zeros(2, 3, 96), z=torch.zeros(2, 3, 96), weight=torch.zeros(96))
    args.update(kwargs)
    with pytest.raises(ContractError, match=msg):
        cg.validate(**args)
