"""Peak memory of reading a sharded (``--trainer.strategy fsdp2``) checkpoint: ``ssl-xcit export`` and
``ssl-xcit gather-checkpoint``, today's partial, streaming reads against the former whole read, side by side.

The checkpoint is a DINO run's in our layout, written on one process as Lightning's ``ModelParallelStrategy``
writes it (``ssl_xcit.models.sharded.write_sharded_checkpoint``): student and teacher (``--arch`` backbone and a
DINO head of ``--out-dim`` outputs) and the student's AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``) as a
DCP folder, the rest in ``meta.pt``. It is built once under ``--work`` and kept between runs.

Each measurement runs in its own process: after its imports it notes its resident memory (VmRSS, the
baseline), runs the command, and reports its peak (VmHWM) minus that baseline, divided by the bytes of the
backbone export writes. ``old`` is the former reader: DCP's whole folder turned into an in-memory
``torch.save`` (``dcp_to_torch_save``) and loaded, then export's full model, a copy of its state dict and
safetensors' in-memory ``save``; gather wrote the loaded dict with ``torch.save``.

    python benchmarks/bench_checkpoint_reads.py --work /tmp/bench_checkpoint_reads
    python benchmarks/bench_checkpoint_reads.py --tiny --work /tmp/bench_checkpoint_reads_tiny
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODES = ("export-old", "export", "gather-old", "gather")


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def build_checkpoint(
    folder: Path, arch: str, out_dim: int, hidden_dim: int = 2048, **backbone_kwargs: Any
) -> Path:
    """A DINO checkpoint of ``arch`` with ``backbone_kwargs`` (student, teacher with heads of ``out_dim``
    outputs and ``hidden_dim`` hidden units, AdamW state) as a sharded folder at ``folder``."""
    from ssl_xcit.dino.head import DINOHead
    from ssl_xcit.models import create_model
    from ssl_xcit.models.sharded import write_sharded_checkpoint

    torch.manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for net in ("student", "teacher"):
        backbone = create_model(arch, **backbone_kwargs)
        head = DINOHead(
            backbone.embed_dim, out_dim, hidden_dim=hidden_dim, bottleneck_dim=min(256, hidden_dim)
        )
        state.update({f"{net}.backbone.{k}": v for k, v in backbone.state_dict().items()})
        state.update({f"{net}.head.{k}": v for k, v in head.state_dict().items()})
        del backbone, head
    names = [k for k, v in state.items() if k.startswith("student.") and v.is_floating_point()]
    moments = {
        n: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn_like(state[n]),
            "exp_avg_sq": torch.rand_like(state[n]),
        }
        for n in names
    }
    checkpoint: dict[str, Any] = {
        "epoch": 0,
        "global_step": 10,
        "hyper_parameters": {"backbone": arch, "backbone_kwargs": dict(backbone_kwargs), "out_dim": out_dim},
        "state_dict": state,
        "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-4, "params": names}]}],
    }
    partial = folder.with_name(folder.name + ".partial")
    write_sharded_checkpoint(checkpoint, partial)
    partial.rename(folder)
    return folder


def _old_whole_read(folder: Path) -> dict[str, Any]:
    """The former ``read_sharded_checkpoint``: the whole folder as an in-memory torch.save, loaded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ssl_xcit.models.checkpoint import read_checkpoint

    buffer = io.BytesIO()
    dcp_to_torch_save(folder, buffer)
    buffer.seek(0)
    tensors = torch.load(buffer, map_location="cpu", weights_only=True)
    checkpoint = dict(read_checkpoint(folder / "meta.pt"))
    checkpoint["state_dict"] = tensors.pop("state_dict")
    checkpoint["optimizer_states"] = [
        tensors[k] for k in sorted(k for k in tensors if k.startswith("optimizer_"))
    ]
    return checkpoint


def _old_export(folder: Path, out: Path) -> None:
    """The former ``ssl-xcit export`` to safetensors."""
    from safetensors.torch import save

    from ssl_xcit.cli.export import teacher_backbone_state
    from ssl_xcit.models import create_model

    checkpoint = _old_whole_read(folder)
    state = teacher_backbone_state(checkpoint, str(folder))
    hparams = checkpoint["hyper_parameters"]
    model = create_model(hparams["backbone"], **hparams["backbone_kwargs"])
    model.load_state_dict(state, strict=True)
    plain = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    out.write_bytes(save(plain, metadata={"format": "pt"}))


def child(mode: str, folder: Path, out: Path) -> dict[str, float]:
    """Run ``mode`` once in this process: its peak memory above the baseline after imports, and seconds."""
    import ssl_xcit.cli.export  # noqa: F401 - the imports are part of the baseline, not of the read
    import ssl_xcit.dino.head  # noqa: F401
    from ssl_xcit.cli import main
    from ssl_xcit.models.sharded import gather_checkpoint
    from ssl_xcit.utils.io import atomic_torch_save

    baseline = _status("VmRSS")
    start = time.perf_counter()
    if mode == "export":
        main(["export", str(folder), str(out)])
    elif mode == "export-old":
        _old_export(folder, out)
    elif mode == "gather":
        gather_checkpoint(folder, out)
    elif mode == "gather-old":
        atomic_torch_save(_old_whole_read(folder), out)
    else:
        raise SystemExit(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    seconds = time.perf_counter() - start
    return {"peak": float(_status("VmHWM") - baseline), "seconds": seconds}


def measure(mode: str, folder: Path, work: Path) -> dict[str, float]:
    """``mode`` in a fresh process (``--child``), so that each peak is its own."""
    out = work / ("out.safetensors" if mode.startswith("export") else "out.ckpt")
    command = [sys.executable, __file__, "--child", mode, "--work", str(work), "--checkpoint", str(folder)]
    done = subprocess.run(command + ["--out", str(out)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    out.unlink(missing_ok=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command line (``main``'s)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work", type=Path, required=True, help="folder for the checkpoint (kept) and outputs"
    )
    parser.add_argument("--arch", default="vit_large_patch16_224", help="the backbone")
    parser.add_argument("--out-dim", type=int, default=65536, help="the DINO head's outputs")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="xcit_nano_12_p16, a 256-output head of 64 hidden units (a smoke run)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Build the checkpoint (once), measure each mode in its own process, print the table; returns its rows."""
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.checkpoint, args.out)))
        return []
    arch, out_dim, hidden = ("xcit_nano_12_p16", 256, 64) if args.tiny else (args.arch, args.out_dim, 2048)
    args.work.mkdir(parents=True, exist_ok=True)
    folder = args.work / f"{arch}_{out_dim}_{hidden}.ckpt"
    if not folder.is_dir():
        build_checkpoint(folder, arch, out_dim, hidden)
    from ssl_xcit.models import create_model

    backbone = sum(
        v.numel() * v.element_size() for v in create_model(arch, device="meta").state_dict().values()
    )
    on_disk = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{arch} sharded checkpoint: {on_disk / 1e9:.2f} GB; exported backbone {backbone / 1e9:.3f} GB")
    print(f"{'mode':<11} {'peak - baseline (GB)':>21} {'/ backbone':>11} {'seconds':>8}")
    rows = []
    for mode in args.modes.split(","):
        result = measure(mode, folder, args.work)
        row = {"mode": mode, **result, "ratio": result["peak"] / backbone, "backbone": backbone}
        rows.append(row)
        print(
            f"{mode:<11} {row['peak'] / 1e9:>21.3f} {row['ratio']:>11.2f} {row['seconds']:>8.1f}", flush=True
        )
    return rows


if __name__ == "__main__":
    main()
