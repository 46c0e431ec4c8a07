"""Train the bundled sample checkpoint: a small byte-level Mamba-2 on the Python standard library's own sources.

Every machine with Python has the corpus, so the run is reproducible anywhere (the exact bytes depend on
the Python version; the held-out text used by the tests is saved next to the checkpoint). Runs a few
minutes on 2 CPU cores and writes, in the mamba_ssm format (config.json + model.safetensors, bf16):

    samples/checkpoints/stdlib-byte-mamba2/{config.json, model.safetensors, heldout.txt, train_log.json}

Usage:
    python samples/train_stdlib_byte_model.py [--minutes 6] [--out samples/checkpoints/stdlib-byte-mamba2]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from m2export.models.checkpoint import load_checkpoint, save_checkpoint
from m2export.models.config import Mamba2Config
from m2export.models.mamba2 import Mamba2LMHeadModel, init_weights_

CONFIG = dict(d_model=128, n_layer=4, vocab_size=256, d_state=32, headdim=32, ngroups=2, expand=2, d_conv=4,
              chunk_size=64, pad_vocab_size_multiple=16, tie_embeddings=True)
HELDOUT_BYTES = 48_000


def stdlib_corpus() -> tuple[bytes, bytes]:
    """(train, heldout) bytes: sorted stdlib .py files, every 10th file held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idle_test" not in p.parts)
    train, held = [], []
    for i, f in enumerate(files):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        (held if i % 10 == 0 else train).append(data)
    return b"\n".join(train), b"\n".join(held)[:HELDOUT_BYTES]


@torch.no_grad()
def bits_per_byte(model: Mamba2LMHeadModel, data: bytes, seqlen: int = 512) -> float:
    """Mean next-byte cross-entropy in bits over ``data``, in windows of ``seqlen`` (no state carried)."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = (len(ids) - 1) // seqlen
    x = ids[: n * seqlen].view(n, seqlen)
    y = ids[1: n * seqlen + 1].view(n, seqlen)
    total = 0.0
    for i in range(0, n, 16):
        logits = model(x[i:i + 16]).logits[..., :256].float()
        total += F.cross_entropy(logits.reshape(-1, 256), y[i:i + 16].reshape(-1), reduction="sum").item()
    return total / (n * seqlen) / math.log(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget")
    ap.add_argument("--out", default=str(Path(__file__).parent / "checkpoints" / "stdlib-byte-mamba2"))
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)

    train, held = stdlib_corpus()
    data = torch.frombuffer(bytearray(train), dtype=torch.uint8)
    print(f"corpus: {len(train):,} train bytes, {len(held):,} held-out bytes (Python {platform.python_version()})")
    model = init_weights_(Mamba2LMHeadModel(Mamba2Config(**CONFIG)), seed=args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    log = {"config": CONFIG, "params": nparams, "python": platform.python_version(), "torch": torch.__version__,
           "seqlen": args.seqlen, "batch": args.batch, "lr": args.lr, "steps": [], "uniform_bits_per_byte": 8.0}
    budget = args.minutes * 60
    t0 = time.perf_counter()
    step = 0
    with Progress(TextColumn("train"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn()) as bar:
        task = bar.add_task("train", total=budget, info="")
        while (elapsed := time.perf_counter() - t0) < budget:
            lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
            for g in opt.param_groups:
                g["lr"] = lr
            idx = torch.randint(0, len(data) - args.seqlen - 1, (args.batch,))
            batch = torch.stack([data[i: i + args.seqlen + 1] for i in idx]).long()
            logits = model(batch[:, :-1]).logits[..., :256]
            loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 10 == 0:
                bpb = loss.item() / math.log(2)
                log["steps"].append({"step": step, "seconds": round(elapsed, 1), "train_bits_per_byte": round(bpb, 4)})
                bar.update(task, completed=elapsed, info=f"step {step} loss {bpb:.3f} bits/byte")
            step += 1
    model.eval()
    out = Path(args.out)
    # this script owns the folder (it also writes heldout.txt and train_log.json there): replace it whole
    save_checkpoint(model, out, format="mamba_ssm", dtype=torch.bfloat16, force=True, force_foreign=True)
    (out / "heldout.txt").write_bytes(held)
    reloaded = load_checkpoint(out).model  # evaluate what was saved (bf16 weights), not the fp32 copy
    log["final_step"] = step
    log["heldout_bits_per_byte"] = round(bits_per_byte(reloaded, held), 4)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"{step} steps in {time.perf_counter() - t0:.0f}s; held-out {log['heldout_bits_per_byte']} bits/byte "
          f"(uniform: 8); wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
