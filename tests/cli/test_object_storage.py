"""Prepared datasets on an S3-compatible server over HTTP (moto's server on 127.0.0.1, tests/conftest.py):
``prepare`` to ``s3://``, then ``fit``, ``knn`` and ``embed`` reading it, with the endpoint named by
``AWS_ENDPOINT_URL`` and by ``storage_options``; bad storage settings end in one line."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ssl_xcit.cli import console_main, main
from ssl_xcit.cli.train import main as train
from ssl_xcit.data.shard_dataset import ShardImageDataset
from ssl_xcit.data.shards import prepare_shards

from .conftest import TINY_ARGS, tiny_config

FEATURES = ["--arch", "xcit_nano_12_p16", "--resize-size", "32", "--crop-size", "32", "--batch-size", "8",
            "--num-workers", "0", "--no-progress"]  # fmt: skip


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_prepare_fit_knn_embed_on_s3(s3_env, s3_server, image_folder, tmp_path, monkeypatch):
    train_url, val_url = f"{s3_env}/train", f"{s3_env}/val"
    # storage_options alone name the endpoint: nothing in the environment does
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = json.dumps({"endpoint_url": s3_server["endpoint"]})
    summary = main(["prepare", str(image_folder / "train"), train_url, "--storage-options", options,
                    "--chunk-bytes", "2kB", "--no-progress"])  # fmt: skip
    assert summary["records"] == 16 and summary["shards"] > 1
    fit = train([
        "fit", *tiny_config(tmp_path, image_folder), f"--data.init_args.root={train_url}",
        f"--data.init_args.storage_options={options}", "--data.init_args.val_root=null", "--trainer.max_steps=2",
    ])  # fmt: skip
    assert fit.trainer.global_step == 2 and fit.datamodule.train_dataset.num_records == 16
    seen = fit.datamodule.train_dataset.classes
    assert seen == ["class0", "class1"]

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])  # from here on the environment names it
    main(["prepare", str(image_folder / "val"), val_url, "--no-progress"])
    cache = str(tmp_path / "cache")
    on_s3 = main(["knn", "--train", train_url, "--val", val_url, "--k", "3", "--cache-dir", cache, *FEATURES])
    assert (on_s3["num_train"], on_s3["num_val"]) == (16, 6) and on_s3["results"]
    # What came over HTTP is the files' bytes (tests/data/test_shards.py checks that decoding them matches
    # reading the folder).
    val = ShardImageDataset(val_url)
    assert [val.read_record(i)["image"] for i in range(len(val))] == [
        (image_folder / "val" / path).read_bytes() for path, _ in val.samples
    ]

    from ssl_xcit.evaluation.embedding_files import read_embeddings

    main(["embed", "--data", val_url, "--output", str(tmp_path / "e.npz"), *FEATURES])
    rows = read_embeddings(tmp_path / "e.npz")
    assert rows["paths"] == [p.relative_to(image_folder / "val").as_posix()
                             for p in sorted((image_folder / "val").rglob("*.jpg"))]  # fmt: skip


def _one_line(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        console_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "Traceback" not in err and len(err.strip().splitlines()) == 2
    )  # the message and the --traceback hint
    return err.splitlines()[0]


def test_bad_storage_settings_are_one_line(s3_env, s3_server, image_folder, monkeypatch, capsys):
    src = str(image_folder / "val")
    endpoint = s3_server["endpoint"]
    err = _one_line(["knn", "--train", f"{s3_env}/nothing", "--val", src, *FEATURES], capsys)
    assert f"{s3_env}/nothing (endpoint {endpoint}): nothing is stored under this prefix" in err
    err = _one_line(["prepare", src, "s3://no-such-bucket/x", "--no-progress"], capsys)
    assert f"s3://no-such-bucket/x (endpoint {endpoint}): bucket no-such-bucket does not exist" in err
    err = _one_line(["embed", "--data", "s3://no-such-bucket/x", "--output", "e.npz", *FEATURES], capsys)
    assert "bucket no-such-bucket does not exist; create it or correct the URL" in err
    err = _one_line(["prepare", src, f"{s3_env}/x", "--storage-options", '{"endpoint": 1}'], capsys)
    assert "storage options: unknown key(s) endpoint; valid: endpoint_url, region_name" in err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    err = _one_line(["prepare", src, f"{s3_env}/x", "--no-progress"], capsys)
    assert (
        f"{s3_env}/x (endpoint {endpoint}): the store refused the credentials (403); check AWS_ACCESS" in err
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    err = _one_line(["prepare", src, f"{s3_env}/x", "--no-progress"], capsys)
    assert f"{s3_env}/x (endpoint http://127.0.0.1:9): the store did not answer" in err
    assert "check that it is up and that AWS_ENDPOINT_URL" in err


def _upload(folder: Path, url: str) -> None:
    """Copy a prepared folder to ``url`` with boto3 (the environment's endpoint)."""
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


def test_a_store_that_stops_answering_mid_epoch_ends_in_one_line_and_keeps_the_step_checkpoint(
    s3_env, s3_server_process, tmp_path, capsys
):
    # 48 records of one chunk each: LitData fetches at most 32 chunks ahead, so some are still on the store
    # when it goes down after the first step (4 records).
    src = tmp_path / "src"
    gen = np.random.default_rng(0)
    for i in range(48):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(gen.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
            src / f"c{i % 2}" / f"{i}.jpg"
        )
    prepare_shards(src, str(tmp_path / "shards"), chunk_bytes="100B", progress=False, print_summary=False)
    url = f"{s3_env}/train"
    _upload(tmp_path / "shards", url)
    runs = tmp_path / "runs"
    (tmp_path / "c.yaml").write_text(f"""
trainer:
  default_root_dir: {runs}
  logger: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{filename: last, every_n_train_steps: 1, enable_version_counter: false}}
model:
  class_path: ssl_xcit.dino.module.DINO
data:
  class_path: ssl_xcit.data.DINODataModule
  init_args: {{root: {url}, val_root: null}}
""")  # fmt: skip
    stopped: list[float] = []

    def stop_at_the_first_step_checkpoint() -> None:
        while not list(runs.rglob("last.ckpt")) and s3_server_process.poll() is None:
            time.sleep(0.01)
        s3_server_process.kill()  # every open connection closes too
        stopped.append(time.monotonic())

    threading.Thread(target=stop_at_the_first_step_checkpoint, daemon=True).start()
    # One DataLoader worker: the failure happens there and must reach the command line as its own message.
    with pytest.raises(SystemExit) as exit_info:
        console_main(["fit", "-c", str(tmp_path / "c.yaml"), *TINY_ARGS, "--data.init_args.num_workers=1"])
    assert exit_info.value.code == 2 and stopped and time.monotonic() - stopped[0] < 60
    last = capsys.readouterr().err.strip().splitlines()[-2:]
    endpoint = s3_server_process.endpoint
    assert last[0].startswith(
        f"ssl-xcit fit: error: {url} (endpoint {endpoint}): the store did not answer ("
    ), last
    assert f"{endpoint}/bucket/{url.removeprefix('s3://bucket/')}/chunk-" in last[0]
    assert "after 2 attempts; check that it is up" in last[0] and last[1].startswith("(add --traceback")

    (checkpoint,) = runs.rglob("last.ckpt")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert 1 <= state["global_step"] < 12  # written mid-epoch, before the store went down
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
