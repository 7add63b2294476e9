"""Sharded checkpoints of ``--trainer.strategy fsdp2`` (``ssl_xcit.models.sharded``): every reader takes the folder
as it takes a file, ``ssl-xcit gather-checkpoint`` writes it as one file, an unsafe index is refused, and a
folder is replaced whole. The folder is the one ``ddp_runs`` (conftest) saves at the end of its 2-process FSDP2
run; the reference tensors are the run's own networks, gathered in the workers. Resume: ``test_fsdp2_resume.py``.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ssl_xcit.cli import main
from ssl_xcit.dino.init_from import read_source
from ssl_xcit.errors import UserError
from ssl_xcit.models import read_checkpoint
from ssl_xcit.models.sharded import INDEX_FILE, is_sharded_checkpoint
from ssl_xcit.parallel.fsdp import _replace


def _run(ddp_runs: Path) -> tuple[Path, dict]:
    folder = ddp_runs / "fsdp2-plain" / "last.ckpt"
    assert is_sharded_checkpoint(folder)
    return folder, torch.load(ddp_runs / "fsdp2-plain" / "rank0_of2.pt", weights_only=True)


def _networks(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.split(".")[0] in ("student", "teacher")}


def _expected(result: dict) -> dict[str, torch.Tensor]:
    return {f"{net}.{k}": v for net in ("student", "teacher") for k, v in result[net].items()}


@pytest.mark.distributed
def test_a_sharded_checkpoint_reads_as_the_whole_state(ddp_runs):
    folder, result = _run(ddp_runs)
    checkpoint = read_checkpoint(folder)
    assert checkpoint["global_step"] == 2 and checkpoint["hyper_parameters"]["backbone"] == "xcit_nano_12_p8"
    got, expected = _networks(checkpoint["state_dict"]), _expected(result)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    state = checkpoint["optimizer_states"][0]["state"]  # by parameter name, whole tensors
    assert (
        state["student.head.mlp.0.weight"]["momentum_buffer"].shape
        == expected["student.head.mlp.0.weight"].shape
    )


@pytest.mark.distributed
def test_gather_checkpoint_writes_the_folder_as_one_file(ddp_runs, tmp_path):
    folder, result = _run(ddp_runs)
    out = main(["gather-checkpoint", str(folder), str(tmp_path / "one.ckpt")])
    one = torch.load(out, weights_only=True)
    assert one["global_step"] == 2 and "loops" in one and "rng_states_per_rank" in one
    for key, value in _expected(result).items():
        assert torch.equal(one["state_dict"][key], value), key
    with pytest.raises(UserError, match="is a folder"):
        main(["gather-checkpoint", str(folder), str(tmp_path)])


@pytest.mark.distributed
def test_export_and_init_from_read_the_folder(ddp_runs, tmp_path):
    from safetensors.torch import load_file

    folder, result = _run(ddp_runs)
    main(["export", str(folder), str(tmp_path / "teacher.safetensors")])
    exported = load_file(tmp_path / "teacher.safetensors")
    teacher = {k[len("backbone.") :]: v for k, v in result["teacher"].items() if k.startswith("backbone.")}
    assert exported.keys() == teacher.keys()
    assert all(torch.equal(exported[k], v) for k, v in teacher.items())
    weights = read_source(str(folder))
    for key, value in weights.student["head"].items():
        assert torch.equal(value, result["student"][f"head.{key}"]), key


def _folders(root: Path) -> tuple[Path, Path]:
    """2 classes x 3 train + 1 val images of 32 px (deterministic)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 1)):
        for label in range(2):
            folder = root / split / f"c{label}"
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 128, (32, 32, 3), dtype=np.uint8) + 127 * label
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return root / "train", root / "val"


@pytest.mark.distributed
def test_knn_reads_the_folder_as_the_gathered_file(ddp_runs, tmp_path):
    folder, _ = _run(ddp_runs)
    train, val = _folders(tmp_path / "images")
    one = main(["gather-checkpoint", str(folder), str(tmp_path / "one.ckpt")])
    results = []
    for weights in (folder, one):
        args = ["knn", "--weights", str(weights), "--train", str(train), "--val", str(val), "--resize-size",
                "32", "--crop-size", "32", "--batch-size", "8", "--num-workers", "0", "--k", "2",
                "--cache-dir", str(tmp_path / f"cache_{weights.name}")]  # fmt: skip
        results.append(main(args))
    assert results[0]["checkpoint_sha256"] not in (None, results[1]["checkpoint_sha256"])
    assert results[0]["results"] == results[1]["results"] and results[0]["num_val"] == 2


def test_an_index_that_would_import_other_code_is_refused(tmp_path):
    import os

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({"epoch": 0}, folder / "meta.pt")

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    (folder / INDEX_FILE).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UserError, match=r"getcwd.*--trust-checkpoint"):
        read_checkpoint(folder)


def test_a_folder_is_replaced_whole(tmp_path):
    """The new folder takes the old one's place; the old one goes only once the new one is there."""
    path, new = tmp_path / "last.ckpt", tmp_path / "last.ckpt.partial"
    for folder, text in ((path, "old"), (new, "new")):
        folder.mkdir()
        (folder / "meta.pt").write_text(text)
    (tmp_path / "last.ckpt.old").mkdir()  # left by a kill between the renames
    _replace(new, path)
    assert (path / "meta.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    shutil.rmtree(path)
    new.mkdir()
    _replace(new, path)  # nothing to replace
    assert path.is_dir() and not new.exists()


def test_another_trainers_dcp_folder_is_gathered_whole(tmp_path):
    """A DCP folder with no meta.pt (DINOv3's training checkpoints are such folders): its whole state dict,
    nested as saved, in one file; a folder that is no DCP checkpoint is one line."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "model": {"student.backbone.blocks.0.attn.qkv.weight": torch.randn(12, 4, generator=g),
                  "teacher.backbone.cls_token": torch.randn(1, 1, 4, generator=g)},
        "optimizer": {"state": {"0": {"exp_avg": torch.randn(12, 4, generator=g)}}},
        "iteration": torch.tensor(1250),
    }  # fmt: skip
    folder = tmp_path / "ckpt" / "1250"
    dcp.save(state, checkpoint_id=str(folder))  # one process, no process group: one __0_0.distcp
    assert not is_sharded_checkpoint(folder)  # not ours: the commands that read our runs refuse it
    one = torch.load(
        main(["gather-checkpoint", str(folder), str(tmp_path / "dinov3.pth")]), weights_only=True
    )
    assert one.keys() == state.keys()
    assert torch.equal(one["iteration"], state["iteration"])
    assert one["model"].keys() == state["model"].keys()
    assert all(torch.equal(one["model"][k], v) for k, v in state["model"].items())
    assert torch.equal(one["optimizer"]["state"]["0"]["exp_avg"], state["optimizer"]["state"]["0"]["exp_avg"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty is not a sharded checkpoint: a folder with \.metadata"):
        main(["gather-checkpoint", str(tmp_path / "empty"), str(tmp_path / "x.pth")])
