"""The bundled sample checkpoint: loads, is small, and has learned the stdlib (far below 8 bits/byte)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m2export.models.checkpoint import load_checkpoint

CKPT = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"
#: measured once by samples/train_stdlib_byte_model.py on the saved (bf16) weights; also in train_log.json
HELDOUT_BITS_PER_BYTE = 2.2686


def test_bundled_checkpoint_is_small_and_mamba_ssm_format():
    size = sum(f.stat().st_size for f in CKPT.iterdir())
    assert size <= 2_000_000, f"bundled checkpoint is {size} bytes, budget 2 MB"
    ck = load_checkpoint(CKPT)
    assert ck.format == "mamba_ssm"
    assert ck.config.vocab_size == 256 and ck.config.ngroups == 2


def test_heldout_loss_is_the_recorded_one():
    bits_per_byte = pytest.importorskip("samples.train_stdlib_byte_model").bits_per_byte
    log = json.loads((CKPT / "train_log.json").read_text())
    assert log["heldout_bits_per_byte"] == HELDOUT_BITS_PER_BYTE
    model = load_checkpoint(CKPT).model
    bpb = bits_per_byte(model, (CKPT / "heldout.txt").read_bytes())
    assert abs(bpb - HELDOUT_BITS_PER_BYTE) < 0.01, f"held-out loss {bpb:.4f} bits/byte, recorded {HELDOUT_BITS_PER_BYTE}"
    assert bpb < 4.0  # uniform over bytes is 8 bits/byte
