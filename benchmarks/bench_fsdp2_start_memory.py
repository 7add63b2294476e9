"""Host memory of a rank when an FSDP2 run starts: networks built whole, then sharded (``whole``, the old start)
against built on the meta device and materialised shard by shard (``meta``, ``ssl_xcit.parallel.meta_start``).

Per start, 2 gloo processes (``torch.distributed.run``) each build DINO on ViT-L/16 (``--out-dim`` prototypes)
and fit under ``--trainer.strategy fsdp2`` up to the training start (``on_train_start``: networks sharded and
filled, optimiser made), where each rank reads its peak resident memory (``VmHWM`` of ``/proc/self/status``)
less the peak after its imports. The ratio divides that by the whole student and teacher's float32 bytes
(parameters and buffers); the table gives each rank's and the largest.

    python benchmarks/bench_fsdp2_start_memory.py
    python benchmarks/bench_fsdp2_start_memory.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STARTS = ("whole", "meta")
MODELS = {  # (backbone, backbone_kwargs)
    "full": ("vit_large_patch16_224", {}),
    "tiny": ("vit_small_patch16_224", {"depth": 2}),
}


def vm_hwm_kib() -> int:
    """This process's peak resident memory (KiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def worker(start: str, model_size: str, out_dim: int, result: Path) -> None:
    """One rank: build, fit to the training start, write ``result/rank<r>.json``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.dino.module import DINO
    from ssl_xcit.parallel.meta_start import meta_start

    baseline = vm_hwm_kib()
    backbone, kwargs = MODELS[model_size]
    L.seed_everything(0, verbose=False)
    with meta_start(start == "meta"):
        model = DINO(backbone, backbone_kwargs=kwargs, out_dim=out_dim, warmup_epochs=0)
    tensors = [*model.student.parameters(), *model.student.buffers(), *model.teacher.parameters(),
               *model.teacher.buffers()]  # fmt: skip
    whole = sum(t.numel() for t in tensors) * 4

    class Measured(Exception):
        pass

    class AtTrainStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            peak = vm_hwm_kib()
            types = sorted({type(p).__name__ for p in pl_module.parameters()})
            record = dict(rank=trainer.global_rank, baseline_kib=baseline, peak_kib=peak, whole_bytes=whole,
                          param_types=types)  # fmt: skip
            (result / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
            raise Measured

    crops = [[torch.zeros(3, 224, 224), torch.zeros(3, 224, 224)], 0, 0]
    loader = DataLoader([crops] * 4, batch_size=1, collate_fn=collate_train)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[AtTrainStart()])  # fmt: skip
    try:
        trainer.fit(model, loader)
    except Measured:
        pass


def launch(start: str, model_size: str, out_dim: int, timeout: int) -> list[dict[str, Any]]:
    """Run one start on 2 gloo processes; each rank's record."""
    with tempfile.TemporaryDirectory() as folder, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
               f"--master_port={port}", __file__, "--worker", start, "--model", model_size, "--out-dim",
               str(out_dim), "--result", folder]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"the {start} start failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(2)]


def ratio(record: dict[str, Any]) -> float:
    """Peak resident bytes over the imports' peak, per whole student and teacher float32 byte."""
    return (record["peak_kib"] - record["baseline_kib"]) * 1024 / record["whole_bytes"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-block ViT-S/16 instead of ViT-L/16 (tests)")
    parser.add_argument("--out-dim", type=int, default=256, help="DINO head prototypes (default 256)")
    parser.add_argument("--starts", default=",".join(STARTS), help="comma-separated: whole, meta")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per start")
    parser.add_argument("--worker", choices=STARTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="full", choices=sorted(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.model, args.out_dim, args.result)
        return []
    starts = [s for s in args.starts.split(",") if s]
    bad = [s for s in starts if s not in STARTS]
    if bad or not starts:
        parser.error(f"--starts takes whole and/or meta, got {args.starts!r}")
    model_size = "tiny" if args.tiny else "full"
    rows = []
    print(f"{'start':<6} {'whole student+teacher':>22} {'rank 0':>7} {'rank 1':>7} {'largest':>8}")
    for start in starts:
        records = launch(start, model_size, args.out_dim, args.timeout)
        ratios = [ratio(r) for r in records]
        rows.append(dict(start=start, records=records, ratios=ratios, largest=max(ratios)))
        gb = records[0]["whole_bytes"] / 1e9
        print(
            f"{start:<6} {gb:>19.3f} GB {ratios[0]:>7.3f} {ratios[1]:>7.3f} {max(ratios):>8.3f}", flush=True
        )
    return rows


if __name__ == "__main__":
    main()
