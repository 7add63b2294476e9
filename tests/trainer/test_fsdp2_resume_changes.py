"""Settings changed at resume under FSDP2 (issue 52): Gram anchoring switched on or off when a run resumes from a
sharded folder (``fsdp2``) or one file (``fsdp2_whole``). Lightning's ``ModelParallelStrategy`` loads the weights
inside ``load_checkpoint``, before the module's ``on_load_checkpoint`` could adapt them, so the strategy runs the
module's ``adapt_state_dict`` first: on stand-ins for the folder's tensors (``adapted_state``) or on the file's.
The 2-process runs resume the same change under DDP too, the reference: the strategies agree within float32
reduction order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import tiny_model, torchrun

from ssl_xcit.parallel.fsdp import adapted_state, check_state_fits, sharded_reads

WORKER = Path(__file__).with_name("fsdp2_resume_changes_worker.py")


def _save_folder(state: dict, path: Path) -> dict:
    """``state`` as a DCP folder the way FSDP2's strategy writes the weights (one process: no process group),
    and the folder's tensor metadata by key, as ``_load_sharded`` reads it."""
    dcp.save({"state_dict": state}, checkpoint_id=path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("state_dict."): v for k, v in metadata.items() if k.startswith("state_dict.")}


def _load_folder(model, stored: dict, path: Path) -> None:
    """What ``FSDP2Strategy._load_sharded`` does with the weights, on an unsharded module."""
    state = adapted_state(model, stored, path)
    reads, weights = sharded_reads(state, model.state_dict(), True, path)
    dcp.load({"state_dict": reads}, checkpoint_id=path)
    model.load_state_dict(weights, strict=True)


def test_a_folder_without_gram_teacher_loads_into_a_model_that_anchors(tmp_path):
    """The Gram teacher is the folder's EMA teacher, not taken yet, as the default strategy's
    ``on_load_checkpoint`` makes it; each EMA teacher tensor is read once, for both networks."""
    torch.manual_seed(0)
    saved = tiny_model()
    stored = _save_folder(saved.state_dict(), tmp_path / "ckpt")
    torch.manual_seed(1)
    model = tiny_model(gram_loss_weight=1.0, gram_start_step=3)
    state = adapted_state(model, stored, tmp_path)
    reads, _ = sharded_reads(state, model.state_dict(), True, tmp_path)
    assert not any(key.startswith("gram_teacher.") for key in reads)  # read from the teacher's keys
    _load_folder(model, stored, tmp_path / "ckpt")
    expected = saved.state_dict()
    for key, value in model.state_dict().items():
        if key.startswith("gram_teacher.backbone."):
            assert torch.equal(value, expected["teacher." + key.removeprefix("gram_teacher.")]), key
        elif key == "gram_teacher._extra_state":
            assert value.tolist() == [0, 0]  # not taken: the snapshot comes at gram_start_step
        else:
            assert torch.equal(value, expected[key]), key


def test_a_folder_with_gram_teacher_loads_into_a_model_that_does_not_anchor(tmp_path):
    torch.manual_seed(0)
    saved = tiny_model(gram_loss_weight=1.0, gram_start_step=1)
    stored = _save_folder(saved.state_dict(), tmp_path / "ckpt")
    assert any(key.startswith("gram_teacher.") for key in stored)
    model = tiny_model()
    _load_folder(model, stored, tmp_path / "ckpt")
    expected = saved.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_folder_that_does_not_fit_is_still_refused_clearly(tmp_path):
    torch.manual_seed(0)
    saved = tiny_model().state_dict()
    key = "student.backbone.cls_token"
    missing = {k: v for k, v in saved.items() if k != key}
    stored = _save_folder(missing, tmp_path / "missing")
    with pytest.raises(
        RuntimeError, match=r"does not fit the model: missing keys \['student.backbone.cls_token'\]"
    ):
        _load_folder(tiny_model(), stored, tmp_path / "missing")
    stored = _save_folder(saved, tmp_path / "ckpt")
    wider = tiny_model(out_dim=128)  # 128 prototypes, not 64: the first key in order that differs
    with pytest.raises(
        RuntimeError, match=r"dino_loss.center has shape \(1, 64\), the model's is \(1, 128\)"
    ):
        _load_folder(wider, stored, tmp_path / "ckpt")
    # A one-file checkpoint's tensors are checked alike.
    with pytest.raises(RuntimeError, match="teacher.backbone.cls_token has shape"):
        check_state_fits({"teacher.backbone.cls_token": torch.zeros(1, 1, 3)}, saved, False, "x.ckpt")


def _close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=f"{what} {key}")
        else:
            assert torch.equal(got[key], value), f"{what} {key}"


@pytest.mark.slow  # ~40-85 s: 12 fits of 2 gloo processes; the in-process tests above cover the adaptation
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_gram_anchoring_switched_at_resume_under_fsdp2_as_under_ddp(tmp_path):
    """2 steps, ``last.ckpt``, 2 more steps resumed with Gram anchoring switched on (from step 3) or off, under
    ``ddp``, ``fsdp2`` (a folder) and ``fsdp2_whole`` (one file). Before the fix the ``fsdp2`` resume failed with
    "Missing key in checkpoint state_dict: state_dict.gram_teacher._extra_state" and ``fsdp2_whole`` in a strict
    ``load_state_dict``. The networks at the resumed fit's start and end match DDP's on both ranks."""
    torchrun(WORKER, str(tmp_path), "ddp,fsdp2,fsdp2_whole", "on,off", timeout=580)
    assert (tmp_path / "fsdp2" / "on" / "last.ckpt").is_dir()
    assert (tmp_path / "fsdp2_whole" / "on" / "last.ckpt").is_file()
    for change in ("on", "off"):
        for rank in (0, 1):
            runs = {
                s: torch.load(tmp_path / s / change / f"rank{rank}.pt", weights_only=False)
                for s in ("ddp", "fsdp2", "fsdp2_whole")
            }
            ddp = runs["ddp"]
            assert ddp["global_step"] == 4
            if change == "on":  # the default strategy's Gram teacher: the checkpoint's EMA teacher, not taken
                gram, teacher = ddp["start"]["gram"], ddp["start"]["teacher"]
                assert gram["_extra_state"].tolist() == [0, 0]
                for key, value in gram.items():
                    if key.startswith("backbone."):
                        assert torch.equal(value, teacher[key]), key
                assert ddp["end"]["gram"]["_extra_state"].tolist() == [1, 0]  # taken at step 3
            else:
                assert ddp["start"]["gram"] == {} and ddp["end"]["gram"] == {}
            for strategy in ("fsdp2", "fsdp2_whole"):
                run = runs[strategy]
                assert run["global_step"] == 4
                for when in ("start", "end"):
                    for net in ("student", "teacher", "gram"):
                        _close(run[when][net], ddp[when][net], f"{strategy} {change} {when} {net}")
