"""The SSMScan function body on many chunks: state passing across hundreds of chunks vs the float64 oracle."""

import onnxruntime as ort
import pytest
import torch

from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.exporter.ssm_scan_op import ssm_scan_node_model
from m2export.kernels.ssd.naive import ssm_scan_recurrent
from tests.helpers import assert_close, make_inputs


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_many_chunks_match_oracle(inline):
    p = SSMScanProblem(2, 4 * 300 + 3, 4, 4, 2, 4)  # 301 chunks of 4, the last one partial
    inp = make_inputs(p, seed=12, A_range=(0.001, 0.05))  # slow decay: early chunks still matter at the end
    model = ssm_scan_node_model([SSMScanAttrs(chunk_size=4)], inline=inline)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, fs = sess.run(None, {k: v.numpy() for k, v in inp.items()})
    ref = ssm_scan_recurrent(**inp)
    assert_close("y", ref.y, torch.from_numpy(y), rel=2e-5)
    assert_close("final_state", ref.final_state, torch.from_numpy(fs), rel=2e-5)
