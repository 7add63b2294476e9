"""Partial reads of sharded checkpoints (``ssl_xcit.models.sharded``): every reader gets exactly the tensors of
torch's own whole read (``dcp_to_torch_save``) for the keys it needs, and nothing else: the backbone readers
read one network's backbone, ``init_from`` the networks, and none of them the optimiser state, whose bytes
are overwritten with garbage here. ``gather-checkpoint`` writes the whole state, a bounded group at a time.
The folder is written on one process in Lightning's layout (``write_sharded_checkpoint``)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ssl_xcit.cli import main
from ssl_xcit.dino.init_from import read_source
from ssl_xcit.errors import UserError
from ssl_xcit.models import build_backbone, create_model, read_checkpoint, shard_reader, sharded
from ssl_xcit.models.sharded import (
    gather_checkpoint,
    read_sharded_backbone,
    write_sharded_checkpoint,
)

ARCH, KWARGS = "xcit_nano_12_p16", {"depth": 1}


def _random(like: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if like.is_floating_point():
        return torch.randn(like.shape, generator=g, dtype=like.dtype)
    return torch.randint(0, 100, like.shape, generator=g, dtype=like.dtype)


def _checkpoint() -> dict:
    """A tiny DINO checkpoint in our layout: student, teacher (backbone + head), a loss centre, AdamW state."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for net in ("student", "teacher"):
        backbone = create_model(ARCH, **KWARGS).state_dict()
        state.update({f"{net}.backbone.{k}": _random(v, g) for k, v in backbone.items()})
        state[f"{net}.head.mlp.0.weight"] = torch.randn(8, 128, generator=g)
        state[f"{net}.head.last_layer.weight"] = torch.randn(16, 8, generator=g)
    state["dino_loss.center"] = torch.randn(1, 16, generator=g)
    state["gram_teacher._extra_state"] = torch.tensor([100, 2])  # the Gram teacher's record (dino/gram.py)
    names = [k for k in state if k.startswith("student.")]
    moments = {n: {"step": torch.tensor(3.0), "exp_avg": torch.randn(state[n].shape, generator=g),
                   "exp_avg_sq": torch.rand(state[n].shape, generator=g)} for n in names}  # fmt: skip
    groups = [{"lr": 0.1, "betas": (0.9, 0.999), "weight_decay": 0.04, "params": names}]
    return {
        "epoch": 1,
        "global_step": 2,
        "hyper_parameters": {"backbone": ARCH, "backbone_kwargs": dict(KWARGS), "out_dim": 16},
        "rng": torch.arange(6, dtype=torch.uint8),
        "state_dict": state,
        "optimizer_states": [{"state": moments, "param_groups": groups}],
    }


def _whole(folder: Path) -> dict:
    """The reference: torch's own whole read of the folder, with meta.pt, as the old reader assembled it."""
    buffer = io.BytesIO()
    dcp_to_torch_save(folder, buffer)
    buffer.seek(0)
    tensors = torch.load(buffer, weights_only=True)
    whole = torch.load(folder / "meta.pt", weights_only=True)
    whole["state_dict"] = tensors.pop("state_dict")
    whole["optimizer_states"] = [tensors["optimizer_0"]]
    return whole


def _spoil_optimizer(folder: Path) -> None:
    """Overwrite every stored byte of the optimiser's entries: a reader that touches them fails."""
    reader = FileSystemReader(str(folder))
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    for index, info in reader.storage_data.items():
        if index.fqn.startswith("optimizer_"):
            with open(folder / info.relative_path, "r+b") as handle:
                handle.seek(info.offset)
                handle.write(b"\xff" * info.length)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    folder = write_sharded_checkpoint(_checkpoint(), tmp_path_factory.mktemp("sharded") / "last.ckpt")
    return folder, _whole(folder)


@pytest.fixture
def folder(written, tmp_path) -> tuple[Path, dict]:
    """A copy of the module's folder, for a test to spoil."""
    return Path(shutil.copytree(written[0], tmp_path / "last.ckpt")), written[1]


@pytest.fixture
def read_sizes(monkeypatch) -> list[int]:
    """The bytes of tensors of each ``read_dcp_entries`` call, in order (``sharded`` reads through it)."""
    sizes: list[int] = []
    read = sharded.read_dcp_entries

    def spy(source, keys, metadata, trust=False):
        got = read(source, keys, metadata, trust)
        sizes.append(sum(v.numel() * v.element_size() for v in got.values() if isinstance(v, torch.Tensor)))
        return got

    monkeypatch.setattr(sharded, "read_dcp_entries", spy)
    return sizes


def _equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            _equal(got[key], value)
        else:
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


def _teacher_backbone(whole: dict) -> dict[str, torch.Tensor]:
    prefix = "teacher.backbone."
    return {k[len(prefix) :]: v for k, v in whole["state_dict"].items() if k.startswith(prefix)}


def test_the_whole_read_equals_torchs(folder):
    path, whole = folder
    got = read_checkpoint(path)
    _equal(got["state_dict"], whole["state_dict"])
    assert got["optimizer_states"][0]["param_groups"] == whole["optimizer_states"][0]["param_groups"]
    for name, moments in whole["optimizer_states"][0]["state"].items():
        _equal(got["optimizer_states"][0]["state"][name], moments)
    assert got["global_step"] == 2 and torch.equal(got["rng"], whole["rng"])


def test_backbone_readers_read_only_the_teacher_backbone(folder, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    path, whole = folder
    _spoil_optimizer(path)
    with pytest.raises(CheckpointException, match="Unsupported operand 255"):  # a whole read fails on them
        _whole(path)
    asked: list[str] = []
    read_data = shard_reader.ShardReader.read_data

    def spy(self, plan, planner):
        asked.extend(item.dest_index.fqn for item in plan.items)
        return read_data(self, plan, planner)

    monkeypatch.setattr(shard_reader.ShardReader, "read_data", spy)
    teacher = _teacher_backbone(whole)
    checkpoint = read_sharded_backbone(path)
    _equal(checkpoint["state_dict"], {f"teacher.backbone.{k}": v for k, v in teacher.items()})
    assert checkpoint["hyper_parameters"]["backbone"] == ARCH and "optimizer_states" not in checkpoint
    _equal(build_backbone(path).state_dict(), teacher)  # knn, linear, embed
    main(["export", str(path), str(tmp_path / "teacher.safetensors")])
    _equal(load_file(tmp_path / "teacher.safetensors"), teacher)
    main(["export", str(path), str(tmp_path / "teacher.pth")])
    _equal(torch.load(tmp_path / "teacher.pth", weights_only=True)["state_dict"], teacher)
    assert asked and all(key.startswith("state_dict.teacher.backbone.") for key in asked), sorted(set(asked))


def test_init_from_reads_the_networks_not_the_optimiser(folder):
    path, whole = folder
    _spoil_optimizer(path)
    weights = read_source(str(path))
    state = whole["state_dict"]
    for side in ("student", "teacher"):
        for part, tensors in getattr(weights, side).items():
            _equal(tensors, {k[len(f"{side}.{part}.") :]: v for k, v in state.items()
                             if k.startswith(f"{side}.{part}.")})  # fmt: skip
    _equal(weights.centres, {"dino_loss.center": state["dino_loss.center"]})


@pytest.mark.parametrize("group_bytes", [1 << 16, 1 << 30])
def test_gather_writes_the_whole_state_a_group_at_a_time(folder, tmp_path, group_bytes):
    path, whole = folder
    out = gather_checkpoint(path, tmp_path / "one.ckpt", group_bytes=group_bytes)
    for mmap in (False, True):
        one = torch.load(out, weights_only=True, mmap=mmap)
        assert one.keys() == whole.keys() and one["epoch"] == 1 and torch.equal(one["rng"], whole["rng"])
        _equal(one["state_dict"], whole["state_dict"])
        assert one["optimizer_states"][0]["param_groups"] == whole["optimizer_states"][0]["param_groups"]
        for name, moments in whole["optimizer_states"][0]["state"].items():
            _equal(one["optimizer_states"][0]["state"][name], moments)
    _equal(build_backbone(out).state_dict(), _teacher_backbone(whole))  # and every reader takes the file


def test_gather_reads_a_bounded_group_at_a_time(folder, tmp_path, read_sizes):
    path, whole = folder
    sizes = read_sizes
    gather_checkpoint(path, tmp_path / "one.ckpt", group_bytes=1 << 17)
    moments = [t for m in whole["optimizer_states"][0]["state"].values() for t in m.values()]
    largest = max(t.numel() * t.element_size() for t in [*whole["state_dict"].values(), *moments])
    assert largest > 1 << 17  # a tensor larger than a group is read alone
    assert len(sizes) > 10 and max(sizes) == largest


def test_gather_to_safetensors_writes_the_model_a_group_at_a_time(folder, tmp_path, read_sizes):
    """A ``.safetensors`` OUT: the model's tensors by model key, byte for byte, read a bounded group at a time
    (the optimiser's spoilt bytes are never read), in a file safetensors itself reads, with the backbone in
    its metadata so that every reader (``init_from``, ``export``, k-NN's loader) takes it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path, whole = folder
    _spoil_optimizer(path)
    sizes = read_sizes
    out = main(["gather-checkpoint", str(path), str(tmp_path / "one.safetensors")])
    _equal(load_file(out), whole["state_dict"])
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["backbone"] == ARCH
    assert len(sizes) == 1  # the default group (256 MiB) holds this small model at once
    sizes.clear()
    gather_checkpoint(path, tmp_path / "small.safetensors", group_bytes=1 << 17)
    _equal(load_file(tmp_path / "small.safetensors"), whole["state_dict"])
    largest = max(t.numel() * t.element_size() for t in whole["state_dict"].values())
    assert len(sizes) > 3 and max(sizes) == largest
    weights = read_source(str(out))
    _equal(weights.student["head"], {k[len("student.head.") :]: v for k, v in whole["state_dict"].items()
                                     if k.startswith("student.head.")})  # fmt: skip
    _equal(build_backbone(out).state_dict(), _teacher_backbone(whole))


def test_a_missing_or_spoilt_shard_is_one_line(folder):
    path, _ = folder
    _spoil_optimizer(path)
    with pytest.raises(UserError, match=r"^cannot read sharded checkpoint .*Unsupported operand 255"):
        read_checkpoint(path)  # the whole read, optimiser included
    (path / "__0_0.distcp").unlink()
    with pytest.raises(
        UserError, match=r"^cannot read sharded checkpoint .*last\.ckpt: FileNotFoundError: .*__0_0\.distcp"
    ):
        build_backbone(path)
