"""Every command of the README and of docs/*.md runs, shrunk to seconds, so the docs cannot drift from the code.

The pages are README.md, then docs/getting-started.md, then every other docs/*.md, found by globbing. Their
``bash`` blocks, the ``ssl-xcit ...`` code spans of their tables and their ``python`` blocks run in page order in
one scratch folder (a command may use what an earlier one wrote: ``--ckpt_path last``, the exported
``teacher.safetensors``), with the pages' placeholder paths mapped onto tiny data from ``../shared/data`` and the
per-command overrides of ``SHRINK`` appended (later flags win). A command the table does not know fails the test,
naming its page: add its row when you add it. A ``python`` block that is not meant to run is marked with an
``<!-- excerpt -->`` line just before its fence.
"""

from __future__ import annotations

import json
import pickle
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file

from ssl_xcit.cli import main as cli_main
from ssl_xcit.data import datamodule as dm_module
from ssl_xcit.data.synthetic import ensure_synthetic_dataset

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
EXCERPT = "<!-- excerpt -->"
MINIO = "http://minio.cluster:9000"  # the S3-compatible endpoint of docs/cluster.md  # the line before a ```python fence that is shown, not run

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
_PLAN = ["--model.out_dim=64", "--model.head_hidden_dim=32", "--model.head_bottleneck_dim=16", "--data.batch_size=4",
         "--data.local_crops_number=2", "--data.global_crops_size=32", "--data.local_crops_size=16", "--gpu-memory=2.1"]  # fmt: skip
# One block: the recipes' structure is what is tested, and the quickstart's 4 blocks made its ONNX and pt2 exports
# below the slowest commands of the pages (~50 s of ~160 s on 2 shared cores); the exports are checked per family
# in tests/cli/test_export_formats.py.
_SHALLOW = ["--model.init_args.backbone_kwargs={depth: 1}"]
_FEATURES = ["--batch-size", "8", "--num-workers", "0", "--resize-size", "32", "--crop-size", "32"]
_RETRIEVAL = ["--resolution", "64", "--codebook-size", "4", "--local-dim", "8", "--max-local", "16",
              "--num-workers", "0", "--kmeans-iters", "2"]  # fmt: skip

# (pattern on the command, appended overrides). The first matching row applies; None = not run, with why.
SHRINK: list[tuple[str, list[str] | str]] = [
    (r"^pip install -e \.(\s|$)", "the environment running this test was installed this way"),
    (r'^pip install -e "\.\[dev\]"$', "the environment running this test was installed this way"),
    (r'^pip install -e "\.\[export\]"$', "the dev extra that installed this environment includes it"),
    (r"^pytest$", "this is the test suite itself"),
    (r"^bash benchmarks/gpu_check\.sh --dry-run$", "tests/benchmarks/test_gpu_check.py runs it (minutes: marked slow)"),
    (r"^bash benchmarks/gpu_check\.sh$", "needs a CUDA GPU; its --dry-run form is tested in tests/benchmarks"),
    (r"^bash tests/min_versions\.sh$", "installs the oldest accepted releases (~3 GB) in a venv of its own: run by hand"),
    (r"^python tests/invariants/matrix\.py ", "tests/invariants/test_matrix.py runs it (the whole matrix: slow)"),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --ckpt_path last$", [*_TRAIN, *_DINO, *_SHALLOW, "--trainer.max_epochs=2"]),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml$", [*_TRAIN, *_DINO, *_SHALLOW]),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --trainer\.strategy fsdp2 --trainer\.devices 2$", "tests/cli/test_fsdp2_cli.py runs it on 2 processes (minutes: marked slow)"),
    (r"^ssl-xcit gather-checkpoint ", "tests/dino/test_fsdp2_checkpoints.py runs it on the sharded folder of a 2-process run"),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --model\.activation_checkpointing true$", [*_TRAIN, *_DINO, *_SHALLOW, "--run_dir", "runs/activation_checkpointing"]),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --model\.init_from teacher\.safetensors$", [*_TRAIN, *_DINO, *_SHALLOW, "--run_dir", "runs/init_from"]),
    # timm's 12 blocks (the page clears the depth cut), read from the local file _workspace writes for the name
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --model\.init_from timm:\S+ --model\.backbone_kwargs \{\}$", [*_TRAIN, *_DINO, "--run_dir", "runs/init_from_timm"]),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --data\.augment_on device$", [*_TRAIN, *_DINO, *_SHALLOW, "--run_dir", "runs/device_augment"]),
    (r"^ssl-xcit fit -c recipes/quickstart\.yaml --data\.augment_on device --data\.decode_on device$", [*_TRAIN, *_DINO, *_SHALLOW, "--run_dir", "runs/device_decode"]),
    # the student cut to one block; a timm teacher keeps its depth (read from the local file _workspace writes)
    (r"^ssl-xcit fit -c recipes/distill\.yaml ", [*_TRAIN, *_DINO, *_SHALLOW]),
    (r"^ssl-xcit prepare /data/imagenet/(train|val) /data/imagenet(-val)?-shards --workers 32$", ["--workers", "2", "--no-progress"]),
    (r"^ssl-xcit prepare \S+ s3://", ["--workers", "2", "--no-progress"]),  # to the S3 server of tests/conftest.py
    (r"^ssl-xcit fit -c recipes/dino_xcit_s12_16\.yaml --data\.root /data/imagenet-shards .* --ckpt_path last$",
     [*_TRAIN, *_DINO, *_SHALLOW, "--trainer.max_epochs=2"]),
    (r"^ssl-xcit fit -c recipes/(dino_xcit_\w+|dinov2_xcit_\w+|small_dataset)\.yaml ", [*_TRAIN, *_DINO, *_SHALLOW]),
    (r"^ssl-xcit validate -c recipes/quickstart\.yaml --ckpt_path last$", [*_TRAIN, *_DINO, *_SHALLOW]),
    # ONNX / pt2: traced and checked at 64 px instead of 224 (the docs' python blocks run them at 224).
    (r"^ssl-xcit export \S+ teacher\.(onnx|pt2)$", ["--resolution", "64"]),
    (r"^ssl-xcit export ", []),
    (r"^ssl-xcit knn ", _FEATURES),
    (r"^ssl-xcit linear ", [*_FEATURES, "--epochs", "1"]),
    (r"^ssl-xcit embed ", _FEATURES),
    (r"^ssl-xcit segment .*--fast", ["--short-side", "64", "--epochs", "1", "--batch-size", "4",
                                     "--num-workers", "0", "--no-progress"]),
    # DINOv2's protocol at 2 iterations of 2 crops of 32 px (its sliding windows still overlap: stride 21)
    (r"^ssl-xcit segment ", ["--short-side", "32", "--crop-size", "32", "--stride", "21", "--iters", "2",
                             "--batch-size", "2", "--num-workers", "0", "--no-progress"]),
    (r"^ssl-xcit prepare ", ["--no-progress"]),
    (r"^ssl-xcit fit -c eval/linear_xcit\.yaml ", [*_TRAIN, "--data.batch_size=4", "--data.num_workers=0",
                                                   "--data.crop_size=32", "--data.resize_size=32"]),
    (r"^ssl-xcit retrieval ", _RETRIEVAL),
    (r"^ssl-xcit visualize ", []),  # the pages' own small settings (shipped images, small backbones)
    # one or two blocks, tiny heads and crops; 2.1 GB leaves ~1.1 GB beside one GPU's 1 GB margin (a fake trace's
    # time does not grow with the batch, so --max-batch still ends fast)
    (r"^ssl-xcit plan --table ", "tests/cli/test_plan.py runs it, shrunk (16 traces: marked slow)"),
    # a distillation plan traces its teacher whole: ViT-7B's 40 blocks become a 12-block ViT-Ti
    (r"^ssl-xcit plan -c recipes/distill\.yaml ", ["--model.teacher=timm:vit_tiny_patch16_224",
                                                    "--model.backbone_kwargs={depth: 1}", *_PLAN]),
    (r"^ssl-xcit plan ", ["--model.backbone_kwargs={depth: 1}", *_PLAN]),
    (r"^ssl-xcit models$", ["--family", "vit"]),  # all ~45 variants' FLOP counts take ~40 s; the quickest family
]  # fmt: skip


@dataclass(frozen=True)
class Block:
    """One runnable piece of a page: a shell command or a Python block, with the file it came from."""

    kind: str  # "bash" or "python"
    text: str
    source: str


def doc_pages() -> list[Path]:
    """README.md, then docs/getting-started.md, then every other docs/*.md (found, not listed: a new page's
    commands are run without touching this file)."""
    pages = sorted(DOCS.glob("*.md"), key=lambda p: (p.name != "getting-started.md", p.name))
    return [README, *pages]


def _commands(line: str) -> list[str]:
    line = re.sub(r"\s+#.*$", "", line).strip()
    if not line or line.startswith("#"):
        return []
    return [" ".join(part.split()) for part in line.split("&&")]


def page_blocks(text: str, source: str) -> list[Block]:
    """In page order: the commands of every ```bash block (continuation lines joined, comments dropped, each
    ``a && b`` split in two), every ``ssl-xcit ...`` code span in a table row, and every ```python block not
    marked with an ``<!-- excerpt -->`` line just before it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            body = "\n".join(lines[i + 1 : j]) + "\n"
            previous = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            if fence.group(1) == "bash":
                for command_line in body.replace("\\\n", " ").splitlines():
                    blocks += [Block("bash", c, source) for c in _commands(command_line)]
            elif fence.group(1) == "python" and previous != EXCERPT:
                blocks.append(Block("python", body, source))
            i = j + 1
            continue
        if line.startswith("|"):
            blocks += [
                Block("bash", " ".join(s.split()), source) for s in re.findall(r"`(ssl-xcit [^`]+)`", line)
            ]
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    root = README.parent
    return [b for page in doc_pages() for b in page_blocks(page.read_text(), str(page.relative_to(root)))]


def readme_commands(text: str) -> list[str]:
    """The shell commands of a page (see :func:`page_blocks`)."""
    return [b.text for b in page_blocks(text, "README.md") if b.kind == "bash"]


def shrink(command: str, source: str = "README.md") -> list[str] | str:
    for pattern, extra in SHRINK:
        if re.search(pattern, command):
            return extra
    raise AssertionError(f"{source}: command not in tests/test_readme.py SHRINK, add a row for it: {command}")


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
    for split, n in (("train", 3), ("val", 2)):  # a few CamVid photos and masks, symlinked
        for image in sorted((shared / "camvid" / split / "images").glob("*.jpg"))[:n]:
            mask = image.parent.parent / "masks" / f"{image.stem}.png"
            for sub, path in (("images", image), ("masks", mask)):
                (root / "camvid" / split / sub).mkdir(parents=True, exist_ok=True)
                (root / "camvid" / split / sub / path.name).symlink_to(path)
    # timm's ImageNet XCiT-N12/8 as its hub stores it (random values: this machine has no network)
    save_file(
        timm.create_model("xcit_nano_12_p8_224", num_classes=1000).state_dict(),
        root / "xcit_nano.safetensors",
    )
    save_file(  # timm's DINO ViT-S/16, the teacher of docs/training.md's distillation (random values, as above)
        timm.create_model("vit_small_patch16_224", num_classes=0).state_dict(),
        root / "vit_small_dino.safetensors",
    )
    d = root / "D"
    return {
        "/data/imagenet/train": f"{d}/train", "/data/imagenet/val": f"{d}/val", "imagenet/train": f"{d}/train",
        "imagenet/val": f"{d}/val", "D/train": f"{d}/train", "D/val": f"{d}/val", "my_photos/": f"{d}/train",
        "my_photo.jpg": str(train[0]),
        "camvid/train": str(root / "camvid" / "train"), "camvid/val": str(root / "camvid" / "val"),
        "timm:xcit_nano_12_p8_224.fb_in1k": f"timm:xcit_nano_12_p8_224.fb_in1k@{root / 'xcit_nano.safetensors'}",
        "timm:vit_small_patch16_224.dino": f"timm:vit_small_patch16_224.dino@{root / 'vit_small_dino.safetensors'}",
        "W": "teacher.safetensors", "data/roxford5k": str(oxford), "data/holidays": str(shared / "retrieval_mini" / "holidays"),
        "data/train_imgs": str(root / "train_imgs.txt"),
        "/data/imagenet-shards": str(root / "imagenet-shards"), "/data/imagenet-val-shards": str(root / "imagenet-val-shards"),
        # docs/pictures.md draws the run of docs/make_pictures.sh; here the quickstart's stands in for it
        "runs/pictures/version_0/checkpoints/last.ckpt": "runs/quickstart/version_0/checkpoints/last.ckpt",
    }  # fmt: skip


def _local(arg: str, shared: Path) -> str:
    """Repository-relative paths of the README (shipped data, test fixtures) as seen from the scratch folder."""
    if arg.startswith("../shared/data/"):
        return str(shared / arg.removeprefix("../shared/data/"))
    if arg.startswith("tests/"):
        return str(README.parent / arg)
    return arg


def test_pages_are_discovered_and_every_command_is_known():
    blocks = all_blocks()
    sources = {b.source for b in blocks}
    assert {"README.md", "docs/getting-started.md", "docs/training.md", "docs/pictures.md"} <= sources
    readme = [b.text for b in blocks if b.source == "README.md" and b.kind == "bash"]
    tasks = (
        "fit",
        "validate",
        "export",
        "knn",
        "linear",
        "segment",
        "embed",
        "retrieval",
        "visualize",
        "models",
    )
    for task in tasks:
        assert any(c.startswith(f"ssl-xcit {task} ") or c == f"ssl-xcit {task}" for c in readme), task
    assert any(b.kind == "python" and b.source == "docs/backbones.md" for b in blocks)
    for block in blocks:
        if block.kind == "bash":
            shrink(block.text, block.source)  # raises on a command without a row, naming its page


def test_blocks_are_parsed_in_order_and_excerpts_are_skipped():
    text = """intro
| a | `ssl-xcit models` |

```bash
pip install -e . && ssl-xcit fit -c r.yaml \\
    --trainer.max_epochs 2   # a comment
# a comment line
```

<!-- excerpt -->
```python
not run
```

```python
x = 1
```
"""
    blocks = page_blocks(text, "docs/x.md")
    assert [(b.kind, b.text) for b in blocks] == [
        ("bash", "ssl-xcit models"),
        ("bash", "pip install -e ."),
        ("bash", "ssl-xcit fit -c r.yaml --trainer.max_epochs 2"),
        ("python", "x = 1\n"),
    ]
    assert {b.source for b in blocks} == {"docs/x.md"}


def test_an_unknown_command_names_its_page():
    with pytest.raises(
        AssertionError, match=r"docs/new\.md: command not in tests/test_readme\.py SHRINK.*ssl-xcit nope"
    ):
        shrink("ssl-xcit nope --x", "docs/new.md")


def test_every_page_command_runs(shared_data, tmp_path, monkeypatch, s3_env, s3_server):
    # The built-in dataset's wiring with 60 images instead of 2,500 (generation is tested in tests/data).
    monkeypatch.setattr(dm_module, "ensure_synthetic_dataset", lambda: ensure_synthetic_dataset(
        num_train_per_class=4, num_val_per_class=2))  # fmt: skip
    paths = _workspace(tmp_path / "data", shared_data)
    for folder in ("recipes", "eval"):  # the pages' relative config paths
        (tmp_path / folder).symlink_to(README.parent / folder)
    monkeypatch.chdir(tmp_path)
    previous: dict[str, list[str]] = {}
    done = set()
    ran_python = []
    for block in all_blocks():
        if block.kind == "python":
            try:
                exec(
                    compile(block.text, f"<python block of {block.source}>", "exec"), {"__name__": "__main__"}
                )
            except Exception as err:
                raise AssertionError(f"{block.source}: python block failed:\n{block.text}") from err
            ran_python.append(block.source)
            continue
        command = block.text
        extra = shrink(command, block.source)
        if isinstance(extra, str) or command in done:  # not runnable here, or already run (same command)
            continue
        done.add(command)
        argv = shlex.split(command)[1:]
        if "..." in argv:  # "ssl-xcit knn ... --backend faiss": the arguments of the previous command
            i = argv.index("...")
            argv = argv[:i] + previous[argv[0]] + argv[i + 1 :]
        previous[argv[0]] = argv[1:]
        # docs/cluster.md's MinIO endpoint is the S3 server of tests/conftest.py (s3_env names it for the rest)
        argv = [
            _local(paths.get(a, a), shared_data).replace(MINIO, s3_server["endpoint"]) for a in argv
        ] + extra
        try:
            cli_main(argv)
        except SystemExit as err:  # a parse error ends with SystemExit; 0/None is a clean exit
            assert err.code in (0, None), f"{block.source}: command failed: {command}"
        except Exception as err:
            raise AssertionError(
                f"{block.source}: command failed: {command}\n  ran: {shlex.join(argv)}"
            ) from err
    assert len(done) >= 22 and "docs/backbones.md" in ran_python
    assert Path("teacher.safetensors").is_file() and json.loads(Path("knn.json").read_text())["results"]
    assert json.loads(Path("results/roxf_vlad.json").read_text())["metrics"]["medium"]["n_queries"] == 1
    assert sorted(p.name for p in Path("runs/quickstart").iterdir()) == [
        "version_0"
    ]  # resumed, not restarted
    assert {p.name for p in Path("docs/img").glob("*.png")} >= {"attention.png", "pca.png", "neighbours.png"}
