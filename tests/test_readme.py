"""Every ``bash`` command of the README runs, shrunk to seconds, so the docs cannot drift from the code.

The commands are parsed from README.md (whatever is there), run in order in one scratch folder (a command may
use what an earlier one wrote: ``--ckpt_path last``, the exported ``teacher.pth``), with the README's
placeholder paths mapped onto tiny data from ``../shared/data`` and the per-command overrides of ``SHRINK``
appended (later flags win). A command the table does not know fails the test: add its row when you add it.
"""

from __future__ import annotations

import json
import pickle
import re
import shlex
import shutil
from pathlib import Path

from ssl_xcit.cli import main as cli_main
from ssl_xcit.data import datamodule as dm_module
from ssl_xcit.data.synthetic import ensure_synthetic_dataset

README = Path(__file__).resolve().parents[1] / "README.md"

# Tiny DINO: small crops, a small head, one or two steps (the recipe's structure is what is being tested).
_TRAIN = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
          "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
          "--trainer.precision=32"]  # fmt: skip
_DINO = ["--model.init_args.out_dim=64", "--model.init_args.head_hidden_dim=32",
         "--model.init_args.head_bottleneck_dim=16", "--model.init_args.warmup_epochs=0",
         "--model.init_args.warmup_teacher_temp_epochs=0", "--data.init_args.batch_size=4",
         "--data.init_args.num_workers=0", "--data.init_args.persistent_workers=false",
         "--data.init_args.local_crops_number=2", "--data.init_args.global_crops_size=32",
         "--data.init_args.local_crops_size=16", "--data.init_args.eval_resize=32", "--data.init_args.eval_crop=32"]  # fmt: skip
_SHALLOW = ["--model.init_args.backbone_kwargs={depth: 1}"]  # recipes whose weights are not exported below
_FEATURES = ["--batch-size", "8", "--num-workers", "0", "--resize-size", "32", "--crop-size", "32"]
_RETRIEVAL = ["--resolution", "64", "--codebook-size", "4", "--local-dim", "8", "--max-local", "16",
              "--num-workers", "0", "--kmeans-iters", "2"]  # fmt: skip

# (pattern on the command, appended overrides). The first matching row applies; None = not run, with why.
SHRINK: list[tuple[str, list[str] | str]] = [
    (r"^pip install -e \.(\s|$)", "the environment running this test was installed this way"),
    (r'^pip install -e "\.\[dev\]"$', "the environment running this test was installed this way"),
    (r"^pytest$", "this is the test suite itself"),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --ckpt_path last$", [*_TRAIN, *_DINO, "--trainer.max_epochs=2"]),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml$", [*_TRAIN, *_DINO]),
    (r"^ssl-xcit fit -c recipes/(dino_xcit_\w+|small_dataset)\.yaml ", [*_TRAIN, *_DINO, *_SHALLOW]),
    (r"^ssl-xcit validate -c recipes/quickstart\.yaml --ckpt_path last$", [*_TRAIN, *_DINO]),
    (r"^ssl-xcit export ", []),
    (r"^ssl-xcit knn ", _FEATURES),
    (r"^ssl-xcit linear ", [*_FEATURES, "--epochs", "1"]),
    (r"^ssl-xcit fit -c eval/linear_xcit\.yaml ", [*_TRAIN, "--data.batch_size=4", "--data.num_workers=0",
                                                   "--data.crop_size=32", "--data.resize_size=32"]),
    (r"^ssl-xcit retrieval ", _RETRIEVAL),
]  # fmt: skip


def readme_commands(text: str) -> list[str]:
    """The shell commands of the README's ```bash blocks: continuation lines joined, comments dropped, each
    ``a && b`` split in two."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands += [" ".join(part.split()) for part in line.split("&&")]
    return commands


def shrink(command: str) -> list[str] | str:
    for pattern, extra in SHRINK:
        if re.search(pattern, command):
            return extra
    raise AssertionError(f"README command not in tests/test_readme.py SHRINK, add a row for it: {command}")


def _image_tree(root: Path, flowers: Path, per_class: int) -> None:
    for name in ("daisy", "tulip"):
        (root / name).mkdir(parents=True, exist_ok=True)
        for path in sorted((flowers / name).glob("*.jpg"))[:per_class]:
            shutil.copy(path, root / name / path.name)


def _workspace(root: Path, shared: Path) -> dict[str, str]:
    """The README's placeholder paths -> tiny data under ``root``."""
    for split, n in (("train", 8), ("val", 3)):
        _image_tree(root / "D" / split, shared / "flowers5", n)
    train = sorted((shared / "flowers5" / "rose").glob("*.jpg"))[:6]
    (root / "train_imgs.txt").write_text("\n".join(map(str, train)) + "\n")
    # A miniature R-Oxford (jpg/ + gnd pickle), as the revisited protocol lays it out.
    oxford = root / "roxford5k"
    (oxford / "jpg").mkdir(parents=True)
    for i, path in enumerate(sorted((shared / "retrieval_mini" / "ukbench").glob("*.jpg"))[:6]):
        shutil.copy(path, oxford / "jpg" / f"img{i}.jpg")
    gnd = {"imlist": [f"img{i}" for i in range(1, 6)], "qimlist": ["img0"],
           "gnd": [{"bbx": [0.0, 0.0, 200.0, 200.0], "easy": [0], "hard": [1], "junk": [2]}]}  # fmt: skip
    (oxford / "gnd_roxford5k.pkl").write_bytes(pickle.dumps(gnd))
    d = root / "D"
    return {
        "/data/imagenet/train": f"{d}/train", "/data/imagenet/val": f"{d}/val", "imagenet/train": f"{d}/train",
        "imagenet/val": f"{d}/val", "D/train": f"{d}/train", "D/val": f"{d}/val", "my_photos/": f"{d}/train",
        "W": "teacher.pth", "data/roxford5k": str(oxford), "data/holidays": str(shared / "retrieval_mini" / "holidays"),
        "data/train_imgs": str(root / "train_imgs.txt"),
    }  # fmt: skip


def test_readme_commands_parse_and_every_one_is_known():
    commands = readme_commands(README.read_text())
    assert any(c.startswith("ssl-xcit retrieval") for c in commands) and len(commands) >= 15
    for command in commands:
        shrink(command)  # raises on a command without a row


def test_every_readme_command_runs(shared_data, tmp_path, monkeypatch):
    # The built-in dataset's wiring with 60 images instead of 2,500 (generation is tested in tests/data).
    monkeypatch.setattr(dm_module, "ensure_synthetic_dataset", lambda: ensure_synthetic_dataset(
        num_train_per_class=4, num_val_per_class=2))  # fmt: skip
    paths = _workspace(tmp_path / "data", shared_data)
    for folder in ("recipes", "eval"):  # the README's relative config paths
        (tmp_path / folder).symlink_to(README.parent / folder)
    monkeypatch.chdir(tmp_path)
    previous: dict[str, list[str]] = {}
    done = set()
    for command in readme_commands(README.read_text()):
        extra = shrink(command)
        if isinstance(extra, str) or command in done:  # not runnable here, or already run (same command)
            continue
        done.add(command)
        argv = shlex.split(command)[1:]
        if "..." in argv:  # "ssl-xcit knn ... --backend faiss": the arguments of the previous command
            i = argv.index("...")
            argv = argv[:i] + previous[argv[0]] + argv[i + 1 :]
        previous[argv[0]] = argv[1:]
        argv = [paths.get(a, a) for a in argv] + extra
        try:
            cli_main(argv)
        except SystemExit as err:  # a parse error ends with SystemExit; 0/None is a clean exit
            assert err.code in (0, None), f"README command failed: {command}"
        except Exception as err:
            raise AssertionError(f"README command failed: {command}\n  ran: {shlex.join(argv)}") from err
    assert len(done) >= 15  # every ssl-xcit command of the README ran
    assert Path("teacher.pth").is_file() and json.loads(Path("knn.json").read_text())["results"]
    assert json.loads(Path("results/roxf_vlad.json").read_text())["metrics"]["medium"]["n_queries"] == 1
    assert sorted(p.name for p in Path("runs/quickstart").iterdir()) == [
        "version_0"
    ]  # resumed, not restarted
