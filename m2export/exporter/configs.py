"""Declarative description of the exported graphs (optimum's OnnxConfig idea, one class).

Names are the interface users see in ONNX Runtime / TensorRT. Per layer i:
``past_conv_state.{i}`` / ``present_conv_state.{i}`` (batch_size, conv_dim, d_conv - 1), model dtype;
``past_ssm_state.{i}`` / ``present_ssm_state.{i}`` (batch_size, nheads, headdim, d_state), float32.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2export.models.config import Mamba2Config
from m2export.names import FLAVOURS

PREFILL_FILE = "model.onnx"
DECODE_FILE = "decode.onnx"
MANIFEST_FILE = "m2export.json"
SSM_IMPLS = tuple(FLAVOURS)  # graph flavours ("ssmscan", "std"): m2export/names.py
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Mamba2OnnxConfig:
    """Input/output names with symbolic shapes of the prefill and decode graphs of one model.

    ``DEFAULT_OPSET`` 18: first opset where the dynamo exporter's default decompositions and
    ``onnxscript`` agree and that TensorRT 10.x parses fully; the SSMScan domain is version 1.
    """

    cfg: Mamba2Config
    DEFAULT_OPSET: int = 18
    #: validation tolerances (atol, rtol) of logits vs PyTorch fp32, per export dtype
    ATOL: tuple[tuple[str, float], ...] = (("fp32", 1e-4), ("fp16", 5e-2), ("bf16", 1e-1))

    def state_shapes(self) -> dict[str, tuple[str | int, ...]]:
        c = self.cfg
        return {"conv_state": ("batch_size", c.conv_dim, c.d_conv - 1),
                "ssm_state": ("batch_size", c.nheads, c.headdim, c.d_state)}

    def inputs(self, decode: bool) -> dict[str, tuple[str | int, ...]]:
        """Ordered name -> symbolic shape of the graph inputs."""
        seq = 1 if decode else "sequence_length"
        out: dict[str, tuple[str | int, ...]] = {"input_ids": ("batch_size", seq)}
        out.update(self._states("past"))
        return out

    def outputs(self, decode: bool) -> dict[str, tuple[str | int, ...]]:
        seq = 1 if decode else "sequence_length"
        out: dict[str, tuple[str | int, ...]] = {"logits": ("batch_size", seq, self.cfg.vocab_size_padded)}
        out.update(self._states("present"))
        return out

    def _states(self, direction: str) -> dict[str, tuple[str | int, ...]]:
        s = self.state_shapes()
        out = {}
        for i in range(self.cfg.n_layer):
            out[f"{direction}_conv_state.{i}"] = s["conv_state"]
            out[f"{direction}_ssm_state.{i}"] = s["ssm_state"]
        return out
