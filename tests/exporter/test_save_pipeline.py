"""The export's tracing and saving machinery (issue 16 item 5): one torchlib registry per export, weights
written from their own buffers, equal initializers found without hashing every tensor.

These check behaviour, not speed (timings are in benchmarks/RESULTS.md): how often torch.onnx builds its
registry, that no large weight is copied whole with ``tobytes``, and that the sample-then-compare dedupe
merges exactly the byte-equal initializers (a tensor differing from another in one element that the
sample misses stays its own initializer).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from m2export.exporter import export as E
from m2export.exporter import export_model

pytest.importorskip("onnxruntime")


def test_one_torchlib_registry_per_export(tiny_g2, tmp_path, monkeypatch):
    """torch.onnx builds ``ONNXRegistry.from_torchlib`` in every export call; the exporter traces the
    embedding, the head and each layer kind (3 calls here, with the builders of m2export/exporter/build.py
    switched off: a pure Mamba-2 model is otherwise built, not traced) from one registry."""
    from torch.onnx._internal.exporter import _registration

    from m2export.exporter import build

    for name in ("can_build_embed", "can_build_head", "can_build_layer"):
        monkeypatch.setattr(build, name, lambda *a: False)

    real = _registration.ONNXRegistry.__dict__["from_torchlib"].__func__
    calls = []

    def counting(cls, *a, **k):
        calls.append(a)
        return real(cls, *a, **k)

    traced = []
    trace = E._trace_module
    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(counting))
    monkeypatch.setattr(E, "_trace_module", lambda m, *a: traced.append(type(m).__name__) or trace(m, *a))
    export_model(tiny_g2, tmp_path / "out", check=False)
    assert len(traced) == 3, traced  # embed, one Mamba layer kind, head
    assert len(calls) == 1
    # the patch is gone after the export: a plain torch.onnx.export builds its own registry again
    assert _registration.ONNXRegistry.__dict__["from_torchlib"].__func__ is counting


def test_large_weights_are_not_copied_whole_when_saved(tiny_g2, tmp_path, monkeypatch):
    """Saving writes each weight from its buffer (a checkpoint tensor from its memory map, a folded
    transpose in blocks): ``tobytes`` is never called on a tensor of 4 KiB or more (the old save made a
    ``tobytes`` copy and a blake2b hash of every weight)."""
    from torch.onnx._internal.exporter._core import TorchTensor

    big = []
    for cls in (ir.Tensor, TorchTensor):
        real = cls.tobytes

        def spy(self, real=real):
            if self.nbytes >= 4096:
                big.append((self.name, self.nbytes))
            return real(self)

        monkeypatch.setattr(cls, "tobytes", spy)
    out = tmp_path / "out"
    export_model(tiny_g2, out, ssm_impl="both", check=False)
    assert not big, big[:5]
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer) >= 5


def _model(arrays: dict[str, np.ndarray]):
    """An onnx_ir model whose graph sums ``arrays`` (each an initializer) into one output."""
    vals = [ir.Value(name=n, shape=ir.Shape(a.shape), type=ir.TensorType(ir.DataType.from_numpy(a.dtype)),
                     const_value=ir.tensor(a, name=n)) for n, a in arrays.items()]
    graph = ir.Graph([], [], nodes=[], initializers=vals, opset_imports={"": 18})
    node = ir.node("Sum", vals)
    graph.append(node)
    graph.outputs.append(node.outputs[0])
    node.outputs[0].name = "y"
    return ir.Model(graph, ir_version=10)


def test_merge_keeps_exactly_the_byte_equal_initializers():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 70)).astype(np.float32)
    near = w.copy()
    near[1, 0] = np.nextafter(near[1, 0], np.float32(1))  # one ulp off at an element the 64-sample skips
    zeros, negz = np.zeros((40, 40), np.float32), np.full((40, 40), -0.0, np.float32)
    nan = np.full((16, 16), np.nan, np.float32)
    wt = np.ascontiguousarray(w.T)
    model = _model({"w": w, "w_copy": w.copy(), "near": near, "wT_view": w.T, "wT": wt, "zeros": zeros,
                    "negz": negz, "nan": nan, "nan2": nan.copy()})
    assert E._Bits(ir.tensor(w)).key() == E._Bits(ir.tensor(near)).key()  # the premise: the sample cannot tell them apart
    assert E._merge_equal_initializers(model) == 3
    kept = set(model.graph.initializers)
    assert kept == {"w", "near", "wT_view", "zeros", "negz", "nan"}, kept  # 0.0 and -0.0 differ in bytes
    assert [v.name for v in model.graph.node(0).inputs] == ["w", "w", "near", "wT_view", "wT_view", "zeros",
                                                             "negz", "nan", "nan"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shared_weights_file_round_trips_views_and_dedupes(tmp_path, dtype):
    """Contiguous torch tensors, a transposed (strided) view written in blocks smaller than the tensor, and
    a second graph with an equal tensor: the file holds each distinct tensor once, bytes as ``tobytes``."""
    from torch.onnx._internal.exporter._core import TorchTensor

    g = torch.Generator().manual_seed(1)
    a = torch.randn(257, 33, generator=g).to(dtype)
    b = torch.randn(64, 40, generator=g).to(dtype)
    first = _model({"a": np.zeros(1, np.float32)})
    first.graph.initializers.clear()
    for name, t in (("a", a), ("aT", a.t()), ("b", b)):
        v = ir.Value(name=name, shape=ir.Shape(t.shape), type=ir.TensorType(TorchTensor(t).dtype),
                     const_value=TorchTensor(t, name=name))
        first.graph.register_initializer(v)
    w = E.SharedWeights(tmp_path)
    old_block = E._Bits.BLOCK
    E._Bits.BLOCK = 1000  # several blocks per tensor
    try:
        assert w.externalize(first)
        second = _model({"b_again": TorchTensor(b.clone()).numpy()})
        assert w.externalize(second)
    finally:
        E._Bits.BLOCK = old_block
        w.close()
    size = (tmp_path / "model.onnx.data").stat().st_size
    assert size <= 2 * a.numel() * a.element_size() + b.numel() * b.element_size() + 3 * 64
    for name, t in (("a", a), ("aT", a.t()), ("b", b)):
        ext = first.graph.initializers[name].const_value
        assert isinstance(ext, ir.ExternalTensor)
        assert ext.tobytes() == TorchTensor(t.contiguous()).tobytes(), name
    eb = second.graph.initializers["b_again"].const_value
    assert eb.offset == first.graph.initializers["b"].const_value.offset  # stored once
    assert eb.tobytes() == TorchTensor(b).tobytes()


def test_merge_of_stored_initializers_reads_no_bytes(tmp_path, monkeypatch):
    """Initializers already in the shared weights file (a second flavour's graph) merge by their slot without
    reading a byte back (the read mapped and touched each tensor: a three-flavour Zamba2 export peaked at 2x
    its weights there); different slots stay apart; an in-memory tensor equal to a stored one is merged after
    it is written (it then shares the slot)."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2))
    w = E.SharedWeights(tmp_path)
    try:
        first = _model({"a": a, "b": b})
        assert w.externalize(first)
        slot = {n: v.const_value for n, v in first.graph.initializers.items()}
        second = _model({"x": np.zeros(1, np.float32)})
        second.graph.initializers.clear()
        for name, t in (("a1", slot["a"]), ("a2", slot["a"]), ("b1", slot["b"])):
            v = ir.Value(name=name, shape=t.shape, type=ir.TensorType(t.dtype),
                         const_value=ir.ExternalTensor(t.location, t.offset, t.length, t.dtype, shape=t.shape,
                                                       name=name, base_dir=t.base_dir))
            second.graph.register_initializer(v)
        second.graph.register_initializer(ir.Value(name="a_mem", shape=ir.Shape(a.shape),
                                                   type=ir.TensorType(ir.DataType.FLOAT),
                                                   const_value=ir.tensor(a.copy(), name="a_mem")))

        def no_read(self, *args, **kwargs):
            raise AssertionError(f"read back {self.name}")

        with monkeypatch.context() as m:
            for attr in ("numpy", "tobytes", "_load"):
                m.setattr(ir.ExternalTensor, attr, no_read)
            assert E._merge_equal_initializers(second) == 1  # a2 -> a1; b1 and the in-memory a_mem stay
        assert set(second.graph.initializers) == {"a1", "b1", "a_mem"}
        assert w.externalize(second)
        assert E._merge_equal_initializers(second) == 1  # a_mem now shares a's slot
        assert set(second.graph.initializers) == {"a1", "b1"}
    finally:
        w.close()


def test_transposed_weight_blocks_reuse_one_buffer(monkeypatch):
    """A folded transpose (a strided view) is written through one block-sized buffer: the blocks hold the
    transpose's bytes in C order, and at most one block's memory is allocated at a time (the old code's
    ``np.ascontiguousarray`` per block kept the previous block alive while the next was made: 2 blocks)."""
    import hashlib
    import tracemalloc

    monkeypatch.setattr(E._Bits, "BLOCK", 1 << 20)
    w = np.random.default_rng(0).standard_normal((512, 4096)).astype(np.float32)  # 8 MB: 8 blocks of its transpose
    bits = E._Bits(ir.Tensor(w.T))
    want = hashlib.sha256(np.ascontiguousarray(w.T).tobytes()).hexdigest()
    h = hashlib.sha256()
    tracemalloc.start()
    try:
        n = 0
        for block in bits.blocks():
            h.update(block)
            n += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 8 and h.hexdigest() == want
    assert peak < 1.5 * (1 << 20), f"peak {peak / 2**20:.2f} MB while writing 1 MB blocks"
