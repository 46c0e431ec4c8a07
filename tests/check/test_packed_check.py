"""``m2export check`` runs ``model.packed.onnx`` (section "packed", m2export/check/packed.py; issue 14).

An untouched export passes with packed rows for every output; a packed graph with one weight changed (a conv tap
only it uses: model.onnx is unaffected), or one that hands each sequence another sequence's ssm state, FAILS
(exit 3) in the packed section only. The pack's feed is built and checked by the host helpers, which refuse
offsets that break the contract with one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from m2export.errors import ContractError
from m2export.exporter import export_model
from m2export.exporter.manifest import read_manifest
from m2export.exporter.packed import PACKED_FILE, check_packed_feed, packed_feed

pytest.importorskip("onnxruntime")

BUNDLED = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"
ARGS = ["--shapes", "1x5", "--decode-steps", "1", "-q"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed_check") / "out"
    export_model(BUNDLED, out, packed_prefill=True)
    return out


def _copy(exported: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    return out


def _check(out: Path, capsys) -> tuple[int, dict]:
    from m2export.cli.main import main

    capsys.readouterr()
    rc = main(["check", str(out), *ARGS])
    return rc, json.loads((out / "check_report.json").read_text())


def _by_section(report: dict, section: str) -> list[dict]:
    return [r for r in report["rows"] if r["section"] == section]


def test_untampered_packed_graph_passes_with_rows(exported, tmp_path, capsys):
    out = _copy(exported, tmp_path)
    rc, rep = _check(out, capsys)
    assert rc == 0, capsys.readouterr().err
    rows = _by_section(rep, "packed")
    names = {r["output"] for r in rows}
    assert "logits" in names and {"present_conv_state.0", "present_ssm_state.3"} <= names
    assert all(r["passed"] and r["iterations"] == 1 for r in rows)
    assert rep["packed"].startswith("6 seqs (63, 1, 64, 0, 65, 5)")
    assert any(r["label"] == "onnxrt/packed" for r in rep["runners"])
    assert "packed: 6 seqs" in (out / "check_report.md").read_text()


def test_one_packed_weight_changed_fails_check(exported, tmp_path, capsys):
    """layers.0/conv_taps (the packed graph's own float32 conv taps, in the shared model.onnx.data): one tap of
    one channel + 0.5. model.onnx does not read it, so only the packed rows fail."""
    out = _copy(exported, tmp_path)
    m = onnx.load(str(out / PACKED_FILE), load_external_data=False)
    (taps,) = [t for t in m.graph.initializer if t.name == "layers.0/conv_taps"]
    info = {e.key: e.value for e in taps.external_data}
    data = out / info["location"]
    raw = bytearray(data.read_bytes())
    off = int(info["offset"]) + 4 * (int(taps.dims[1]) * (int(taps.dims[0]) - 1) + 3)  # current-token tap, channel 3
    v = np.frombuffer(raw[off:off + 4], np.float32)[0]
    raw[off:off + 4] = np.float32(v + 0.5).tobytes()
    data.write_bytes(bytes(raw))
    rc, rep = _check(out, capsys)
    assert rc == 3
    assert all(r["passed"] for r in _by_section(rep, "prefill"))
    failed = {r["output"] for r in _by_section(rep, "packed") if not r["passed"]}
    # layer 0's conv output feeds its scan (and all later layers); its conv state is the raw input, unaffected
    assert {"logits", "present_ssm_state.0", "present_conv_state.1"} <= failed
    assert "present_conv_state.0" not in failed


def test_states_of_the_wrong_sequence_fail_check(exported, tmp_path, capsys):
    """Layer 0's SSMScanPacked reads the per-sequence ssm states in reverse order (sequence s gets another's
    initial state): the continued sequences' outputs differ from the reference's, so the packed section fails."""
    out = _copy(exported, tmp_path)
    m = onnx.load(str(out / PACKED_FILE), load_external_data=False)
    node = next(n for n in m.graph.node if n.op_type == "SSMScanPacked" and n.input[7] == "past_ssm_state.0")
    consts = {k: onnx.numpy_helper.from_array(np.array(v, np.int64), f"tamper_{k}")
              for k, v in (("starts", [-1]), ("ends", [np.iinfo(np.int64).min]), ("axes", [0]), ("steps", [-1]))}
    m.graph.initializer.extend(consts.values())
    m.graph.node.insert(0, onnx.helper.make_node("Slice", ["past_ssm_state.0", *(f"tamper_{k}" for k in consts)],
                                                 ["tamper_reversed_ssm_state.0"]))
    node.input[7] = "tamper_reversed_ssm_state.0"
    onnx.save(m, str(out / PACKED_FILE))
    rc, rep = _check(out, capsys)
    assert rc == 3
    assert all(r["passed"] for r in _by_section(rep, "prefill"))
    failed = {r["output"] for r in _by_section(rep, "packed") if not r["passed"]}
    assert {"logits", "present_ssm_state.0"} <= failed


@pytest.mark.parametrize("cu", [[0, 3, 2, 5], [0, 2, 6], [1, 3, 5], [0, 2, 4]], ids=["decreasing", "past_end",
                                                                                     "not_from_0", "short"])
def test_host_refuses_bad_cu_seqlens_in_one_line(exported, cu):
    m = read_manifest(exported)
    pio, zero = m.graph("packed-prefill").io(), m.graph("prefill").io().zero_feeds(1, lambda d: np.float32)
    feed = packed_feed([np.arange(3), np.arange(2)], [zero, zero], pio)
    feed["input_ids"] = np.zeros((1, 5), np.int64)
    feed["cu_seqlens"] = np.array(cu, np.int32)
    for s in pio.states:
        feed[s.past.name] = np.zeros((len(cu) - 1, *feed[s.past.name].shape[1:]), np.float32)
    with pytest.raises(ContractError, match=r"^cu_seqlens: expected non-decreasing offsets from 0 to seqlen=5") as e:
        check_packed_feed(feed, pio)
    assert "\n" not in str(e.value)


def test_host_refuses_states_not_one_per_sequence(exported):
    m = read_manifest(exported)
    pio, zero = m.graph("packed-prefill").io(), m.graph("prefill").io().zero_feeds(1, lambda d: np.float32)
    feed = packed_feed([np.arange(3), np.arange(2)], [zero, zero], pio)
    name = pio.states[0].past.name
    feed[name] = feed[name][:1]
    with pytest.raises(ContractError, match=rf"^{name}: expected one row per sequence \(2, from cu_seqlens\), got 1"):
        check_packed_feed(feed, pio)
