"""``load_checkpoint(mapped=True)`` (:class:`m2export.models.checkpoint.MappedWeights`) and the export that uses it:
the model's tensors are views of read-only mappings of the safetensors files, equal to safetensors' own load, and
their pages leave the process's resident memory once checked and again as the export writes each weight (issue 16
item 5: export peak RSS; the 130m export held the whole mapped file, 0.67 of its 0.96 GiB).

Resident memory is read per mapping from /proc/self/smaps (the Rss of the mappings of the checkpoint file), so
the assertions are about this process's pages of that one file, not the machine's load. Linux only."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2export.errors import CheckpointError
from m2export.models.checkpoint import MappedWeights, bit_equal, load_checkpoint, random_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")

#: embedding 16384 x 128 fp32 = 8 MiB (tied head): the file (~9 MB) is far above the page granularity
#: (fault-around maps 64 KiB around each touched page) of what the tests allow to stay resident
SIZES = dict(d_model=128, n_layer=2, vocab_size=16384, d_state=16, headdim=16, ngroups=2, chunk_size=16)


def mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s pages resident in this process (sum of Rss over its mappings in /proc/self/smaps)."""
    want, total, inside = str(Path(path).resolve()), 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == want
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def _state(model):
    return dict(model.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mapped_load_equals_safetensors_and_keeps_nothing_resident(tmp_path, dtype):
    ck = random_checkpoint(tmp_path / "ck", seed=4, dtype=dtype, **SIZES)
    f = ck / "model.safetensors"
    plain = load_checkpoint(ck, dtype=torch.float32)
    assert plain.pages is None
    if dtype == torch.float32:  # safetensors' mapping: every page read stays resident (bf16: converted copies)
        assert mapped_rss(f) > f.stat().st_size // 2
    del plain
    mapped = load_checkpoint(ck, dtype=torch.float32, mapped=True)
    assert isinstance(mapped.pages, MappedWeights)
    assert mapped_rss(f) <= 64 << 10, mapped_rss(f)  # checked (bf16: converted) and released tensor by tensor
    want = _state(load_checkpoint(ck, dtype=torch.float32).model)
    got = _state(mapped.model)
    assert set(got) == set(want) and all(bit_equal(got[k], want[k]) for k in want)  # read back from the file


def test_release_drops_exactly_the_tensors_pages(tmp_path):
    ck = random_checkpoint(tmp_path / "ck", seed=4, **SIZES)
    f = ck / "model.safetensors"
    loaded = load_checkpoint(ck, dtype=torch.float32, mapped=True)
    emb = loaded.model.state_dict()["backbone.embedding.weight"]
    before = mapped_rss(f)
    ref = emb.clone()  # reads every page of it
    assert mapped_rss(f) - before >= emb.numel() * 4 - (8 << 10)
    assert loaded.pages.release(emb) >= emb.numel() * 4
    # what stays: the neighbours' pages the kernel's fault-around mapped beyond its ends (64 KiB by default)
    assert mapped_rss(f) <= before + (128 << 10), mapped_rss(f)
    assert bit_equal(emb, ref)  # faulted back in with the file's bytes
    assert loaded.pages.release(torch.ones(1000)) == 0  # memory of anything else is left alone


def test_mapped_load_refuses_non_finite_weights_as_before(tmp_path):
    ck = random_checkpoint(tmp_path / "ck", seed=5, **SIZES)
    sd = {k: v.clone() for k, v in load_file(str(ck / "model.safetensors")).items()}
    sd["backbone.layers.1.mixer.in_proj.weight"][3, 4] = float("nan")
    save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"in_proj.weight.*non-finite value at index \[3, 4\]"):
        load_checkpoint(ck, dtype=torch.float32, mapped=True)


def test_a_misaligned_tensor_falls_back_to_the_plain_read(tmp_path):
    """A safetensors file whose float32 tensor starts 3 bytes in (legal in the format, not viewable as float32
    in place): MappedWeights.of declines it (the loader then reads the file as without ``mapped``)."""
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    raw = json.dumps(header).encode()
    f = tmp_path / "odd.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(11))
    assert MappedWeights.of([f], None) is None


def test_export_holds_no_checkpoint_page_after_writing_the_weights(tmp_path, monkeypatch):
    """The export loads mapped and releases each weight's pages once written: after every externalize, none of
    the checkpoint file is resident (with safetensors' mapping all of it was, until the export returned)."""
    from m2export.exporter import export as E

    ck = random_checkpoint(tmp_path / "ck", seed=6, **SIZES)
    f = ck / "model.safetensors"
    seen = []
    real = E.SharedWeights.externalize

    def spy(self, model):
        used = real(self, model)
        seen.append(mapped_rss(f))
        return used

    merged = []
    merge = E._merge_equal_initializers

    def merge_spy(model, pages=None):
        done = merge(model, pages)
        merged.append(mapped_rss(f))
        return done

    monkeypatch.setattr(E.SharedWeights, "externalize", spy)
    monkeypatch.setattr(E, "_merge_equal_initializers", merge_spy)
    E.export_model(ck, tmp_path / "out", ssm_impl="all", check=False)
    # one per flavour; what stays is fault-around's neighbour pages and the small inline tensors' (safetensors'
    # mapping held all of the file here: every weight had been read by the checks)
    assert f.stat().st_size > 8 << 20
    assert len(seen) == 3 and max(seen) <= f.stat().st_size // 16, seen
    assert len(merged) == 6 and max(merged) <= f.stat().st_size // 16, merged  # sampled and compared: released


def test_leases_are_given_up_after_the_export_and_after_a_failed_load(tmp_path):
    """The export holds a read lease on each mapped file (a writer's open waits on it, up to 45 s) only while it
    reads: once export_model returns, or a mapped load fails, a write opens the file at once and SIGIO's handler
    is the one before."""
    import gc
    import signal
    import time

    from m2export.exporter.export import export_model
    from m2export.models import checkpoint as C

    ck = random_checkpoint(tmp_path / "ck", seed=7, **SIZES)
    f = ck / "model.safetensors"
    gc.collect()  # an earlier test's mapped load, unreachable but not yet collected, would still hold its leases
    assert not list(C._watched), "another MappedWeights still holds leases (and the SIGIO handler): bad test"
    before = signal.getsignal(signal.SIGIO)
    loaded = load_checkpoint(ck, dtype=torch.float32, mapped=True)
    assert loaded.pages is not None and loaded.pages._leases, "no lease taken: bad test"
    assert signal.getsignal(signal.SIGIO) is not before
    loaded.pages.close()
    assert signal.getsignal(signal.SIGIO) is before
    export_model(ck, tmp_path / "out", check=False)
    assert signal.getsignal(signal.SIGIO) is before
    t = time.monotonic()
    with open(f, "r+b"):
        pass
    assert time.monotonic() - t < 5
    with open(ck / "config.json") as fh:
        cfg = json.load(fh)
    cfg["vocab_size"] += 1  # the tensors no longer match: the load fails after the leases were taken
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        load_checkpoint(ck, dtype=torch.float32, mapped=True)
    assert signal.getsignal(signal.SIGIO) is before


def test_a_file_open_for_writing_is_read_not_mapped(tmp_path):
    """No lease can be had on a file some process holds open for writing (EAGAIN): the mapped load reads the
    tensors into the process's memory instead (no mapping a truncation could turn into a SIGBUS), equal."""
    ck = random_checkpoint(tmp_path / "ck", seed=8, **SIZES)
    with open(ck / "model.safetensors", "r+b"):
        got = load_checkpoint(ck, dtype=torch.float32, mapped=True)
    assert got.pages is None and mapped_rss(ck / "model.safetensors") == 0  # no page of the file mapped
    state = _state(got.model)
    want = _state(load_checkpoint(ck, dtype=torch.float32).model)
    assert set(state) == set(want) and all(bit_equal(state[k], want[k]) for k in want)
