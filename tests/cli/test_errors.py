"""Expected user errors end every command with one or two lines and exit status 2; ``--traceback`` or
``SSL_XCIT_TRACEBACK=1`` gives the full traceback. Run through the console entry point, in-process."""

from __future__ import annotations

import pytest
import torch
from PIL import UnidentifiedImageError

from ssl_xcit.cli import console_main
from ssl_xcit.cli.errors import HINT, suggest_key
from ssl_xcit.errors import TrainingDiverged, UserError

from .conftest import tiny_config


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        console_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Namespace(" not in err
    lines = err.strip().splitlines()
    assert 2 <= len(lines) <= 3 and lines[-1] == HINT, err  # message (+ suggestion) + the hint
    return err


def test_suggest_key_names_the_closest_valid_key():
    message = (
        "Problem with given class_path 'ssl_xcit.dino.module.DINO':\n  Option 'warmup_epoch' is not accepted"
    )
    assert suggest_key(message, []) == "unknown key `warmup_epoch`: did you mean `warmup_epochs`?"
    assert suggest_key("Unrecognized arguments: --trainer.max_epocs 3", ["--trainer.max_epochs"]) == (
        "unknown key `max_epocs`: did you mean `max_epochs`?"
    )
    assert suggest_key("some other error", ["--x"]) is None


def test_fit_config_typos_suggest_the_key(tmp_path, image_folder, capsys):
    args = tiny_config(tmp_path, image_folder)
    err = _fails(["fit", *args, "--model.init_args.teacher_tmp=0.04"], capsys)
    assert "did you mean `teacher_temp`?" in err
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        "model:\n  class_path: ssl_xcit.dino.module.DINO\n  init_args:\n    momentum_techer: 0.99\n"
    )
    err = _fails(["fit", "-c", str(bad)], capsys)
    assert "'momentum_techer' is not accepted" in err and "did you mean `momentum_teacher`?" in err


def test_fit_bad_data_root_and_backbone(tmp_path, image_folder, capsys):
    args = tiny_config(tmp_path, image_folder)
    missing = tmp_path / "no_such_folder"
    err = _fails(["fit", *args, f"--data.init_args.root={missing}"], capsys)
    assert err.startswith(
        f"ssl-xcit fit: error: data.root {missing} does not exist; expected an image folder"
    )
    err = _fails(["fit", *args, "--model.init_args.backbone=xcit_bogus"], capsys)
    assert "unknown model 'xcit_bogus'" in err and "xcit: xcit_nano_12_p16" in err and "cait: " in err
    assert len(err.strip().splitlines()) <= 2
    # Lightning's MisconfigurationException is a user error too
    err = _fails(["fit", *args, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], capsys)
    assert "enable_progress_bar=False" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _fails(["fit", *args, f"--data.init_args.root={empty}"], capsys)
    assert str(empty) in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no empty run left


def test_ibot_on_a_family_without_masking_is_one_line(tmp_path, image_folder, capsys):
    args = tiny_config(tmp_path, image_folder)
    argv = [
        "fit",
        *args,
        "--model.init_args.backbone=bixt_ti_l64_p16",
        "--model.init_args.backbone_kwargs={depth: 2}",  # BiXT's smallest depth
        "--model.init_args.ibot_loss_weight=1.0",
    ]
    err = _fails(argv, capsys)
    assert "bixt backbones (bixt_ti_l64_p16) cannot take iBOT's patch masks" in err
    assert "masking works with the xcit, vit, cait, dinov3 families (or set ibot_loss_weight: 0)" in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["knn", "--weights", "{tmp}/missing.pth", "--train", "{tmp}", "--val", "{tmp}"], "weights file not found"),
        (["knn", "--arch", "xcit_bogus", "--train", "{img}/train", "--val", "{img}/val"], "unknown model 'xcit_bogus'"),
        (["knn", "--arch", "xcit_nano_12_p16", "--train", "{tmp}/empty", "--val", "{tmp}/empty"], "is empty"),
        (["linear", "--weights", "{tmp}/missing.pth", "--train", "{tmp}", "--val", "{tmp}"], "weights file not found"),
        (["retrieval", "--weights", "{tmp}/missing.pth", "--dataset", "holidays", "--data-root", "{tmp}"],
         "no Holidays images"),
        (["export", "{tmp}/missing.ckpt", "{tmp}/out.pth"], "missing.ckpt does not exist"),
        (["models", "xcit_bogus"], "unknown model 'xcit_bogus'"),
    ],
    ids=["knn-weights", "knn-arch", "knn-empty", "linear-weights", "retrieval-root", "export", "models"],
)  # fmt: skip
def test_every_command_reports_user_errors_briefly(argv, expected, tmp_path, image_folder, capsys):
    (tmp_path / "empty").mkdir()
    argv = [a.format(tmp=tmp_path, img=image_folder) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        console_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"ssl-xcit {argv[0]}: error:" in err and expected in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2


def test_traceback_flag_and_env_show_the_real_exception(tmp_path, monkeypatch):
    argv = [
        "knn",
        "--weights",
        str(tmp_path / "missing.pth"),
        "--train",
        str(tmp_path),
        "--val",
        str(tmp_path),
    ]
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        console_main([*argv, "--traceback"])
    monkeypatch.setenv("SSL_XCIT_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        console_main(argv)


def test_a_bug_keeps_its_traceback(monkeypatch):
    import ssl_xcit.cli.models as models_cli

    def broken(argv):
        raise RuntimeError("internal bug")

    monkeypatch.setattr(models_cli, "main", broken)
    with pytest.raises(RuntimeError, match="internal bug"):
        console_main(["models"])


def _models_command_raising(monkeypatch, error: BaseException) -> None:
    import ssl_xcit.cli.models as models_cli

    def broken(argv):
        raise error

    monkeypatch.setattr(models_cli, "main", broken)


@pytest.mark.parametrize(
    "error",
    [
        UserError("tile_size must be >= 1, got 0"),
        FileNotFoundError("weights file not found: w.pth"),
        UnidentifiedImageError("cannot identify image file 'x.jpg'"),
        TrainingDiverged("DINO loss is nan at global step 3"),
    ],
    ids=type,
)
def test_the_project_error_and_known_library_errors_are_one_line(error, monkeypatch, capsys):
    _models_command_raising(monkeypatch, error)
    err = _fails(["models"], capsys)
    assert err.startswith(f"ssl-xcit models: error: {error}")


@pytest.mark.parametrize(
    "error",
    [ValueError("too many values to unpack"), KeyError("blocks.3"), TypeError("bad operand")],
    ids=type,
)
def test_a_plain_library_error_deep_inside_keeps_its_traceback(error, monkeypatch):
    _models_command_raising(monkeypatch, error)
    with pytest.raises(type(error)):  # not SystemExit(2): Python prints the traceback and exits 1
        console_main(["models"])


def test_a_bug_while_handling_a_user_error_keeps_its_traceback(monkeypatch):
    def fallback_with_a_bug(argv):
        try:
            raise FileNotFoundError("optional file absent")
        except FileNotFoundError:
            return int("not a number")  # a ValueError whose __context__ is the FileNotFoundError

    import ssl_xcit.cli.models as models_cli

    monkeypatch.setattr(models_cli, "main", fallback_with_a_bug)
    with pytest.raises(ValueError, match="invalid literal") as info:
        console_main(["models"])
    assert isinstance(info.value.__context__, FileNotFoundError)


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


@pytest.mark.parametrize("kind", ["torch", "value"])
def test_a_bug_inside_a_configured_class_keeps_its_traceback(kind, tmp_path, image_folder, monkeypatch):
    """jsonargparse re-raises an ``__init__`` error as its own ValueError: a bug under it is still a bug."""
    import ssl_xcit.dino.module as dino_module

    def broken_create_model(name, **kwargs):
        if kind == "torch":
            return torch.zeros(2).view(3, 5)  # torch's own error, deep inside the model's construction
        raise ValueError("shape mismatch in a layer")

    monkeypatch.setattr(dino_module, "create_model", broken_create_model)
    with pytest.raises(Exception) as info:
        console_main(["fit", *tiny_config(tmp_path, image_folder)])
    assert not isinstance(info.value, SystemExit)  # raised on, so Python prints the traceback
    root = _root_cause(info.value)
    assert isinstance(root, RuntimeError if kind == "torch" else ValueError) and not isinstance(
        root, UserError
    )


def test_user_error_is_a_value_error():
    assert issubclass(UserError, ValueError)  # `except ValueError` in callers keeps working
    from ssl_xcit.models import create_model

    with pytest.raises(UserError, match="unknown model 'xcit_bogus'"):
        create_model("xcit_bogus")


class _RaisesInWorker(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        try:
            raise OSError("connection refused")
        except OSError as err:
            raise UserError("s3://bucket/train: the store did not answer\nsecond line") from err


def test_a_user_error_in_a_dataloader_worker_is_its_own_first_line(monkeypatch, capsys):
    # torch re-raises it in the main process as "Caught UserError in DataLoader worker process 0." + traceback
    loader = torch.utils.data.DataLoader(_RaisesInWorker(), num_workers=1)
    monkeypatch.setattr("ssl_xcit.cli.main", lambda argv: next(iter(loader)))
    err = _fails(["fit"], capsys)
    assert err.splitlines()[0] == "ssl-xcit fit: error: s3://bucket/train: the store did not answer"
