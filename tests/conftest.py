"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# Test tensors are small, so a second intra-op thread costs more in synchronisation than it gains; on a shared
# 2-core machine it made a nano XCiT forward ~20x slower (2.2 s vs 0.09 s at 128 px).
torch.set_num_threads(1)


def _shared_data_dir() -> Path:
    # CI clones the repository with `shared/` beside it; SSL_XCIT_SHARED_DATA overrides for other layouts.
    override = os.environ.get("SSL_XCIT_SHARED_DATA")
    return Path(override) if override else REPO_ROOT.parent / "shared" / "data"


# `timeout` in pyproject.toml bounds every default-suite test; the opt-in slow ones train for minutes.
SLOW_TEST_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real photos and ground truth in ``../shared/data``; tests that need them skip when it is absent."""
    path = _shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"shared data not found at {path} (set SSL_XCIT_SHARED_DATA)")
    return path


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Generated datasets and feature caches go to a per-session temporary folder, never to the user's home.
    monkeypatch.setenv("SSL_XCIT_CACHE", str(tmp_path_factory.getbasetemp() / "ssl_xcit_cache"))
    # File modes are tested with and without owner-only files; the caller's own setting must not leak in.
    monkeypatch.delenv("SSL_XCIT_PRIVATE", raising=False)
    yield


# ----------------------------------------------------------------------------------- object storage
S3_REGION = "us-east-1"


def _share_botocore_models() -> None:
    """Parse each of botocore's JSON models once per test process. LitData makes a boto3 session for every
    client, and each session parses them again (~0.5 s of a loaded 2-core machine per client, most of an
    object-storage test's time). botocore already hands one parsed model to every client of a session."""
    import botocore.loaders

    load = botocore.loaders.JSONFileLoader.load_file
    if getattr(load, "shared", False):
        return
    parsed: dict[str, Any] = {}

    def load_file(self, file_path):
        if file_path not in parsed:
            parsed[file_path] = load(self, file_path)
        return parsed[file_path]

    load_file.shared = True
    botocore.loaders.JSONFileLoader.load_file = load_file


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto's server mode) on 127.0.0.1 at a free port, with bucket ``bucket`` and
    IAM authentication on: only the returned access key is accepted, so wrong credentials fail as on a real
    store. Yields ``{"endpoint": ..., "key": ..., "secret": ...}``."""
    import json
    import logging

    import boto3
    import moto.settings
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    _share_botocore_models()
    # The 4 set-up calls below run unauthenticated; every later request must be signed with the user's key.
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 4
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    setup = dict(
        endpoint_url=endpoint, region_name=S3_REGION, aws_access_key_id="x", aws_secret_access_key="x"
    )
    boto3.client("s3", **setup).create_bucket(Bucket="bucket")
    iam = boto3.client("iam", **setup)
    iam.create_user(UserName="ssl-xcit")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="ssl-xcit", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="ssl-xcit")["AccessKey"]
    yield {"endpoint": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    server.stop()


@pytest.fixture
def s3_server_process(s3_env, monkeypatch):
    """A second S3-compatible server, in a process of its own so that a test can kill it (closing every
    connection, as a store that goes down does), with bucket ``bucket`` and no authentication; ``s3_env``'s
    environment points at it. Yields the ``subprocess.Popen``, with its ``endpoint`` set."""
    import socket
    import subprocess
    import sys
    import time

    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto's server did not start on port {port}") from None
            time.sleep(0.05)
    server.endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    boto3.client("s3", endpoint_url=server.endpoint, region_name=S3_REGION).create_bucket(Bucket="bucket")
    yield server
    server.kill()
    server.wait()


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path, request):
    """The environment of a user of ``s3_server``: its endpoint and key in ``AWS_*`` variables, no AWS files,
    LitData's chunk cache under ``tmp_path``, 2 attempts per request. Yields an ``s3://bucket/...`` prefix of
    this test's own."""
    import litdata.utilities.dataset_utilities as litdata_cache

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", S3_REGION)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("LITDATA_CACHE_DIR", str(tmp_path / "litdata_cache"))  # read by subprocesses
    monkeypatch.setattr(litdata_cache, "_LITDATA_CACHE_DIR", str(tmp_path / "litdata_cache"))
    yield f"s3://bucket/{request.node.name.replace('[', '-').rstrip(']')}"


@pytest.fixture(scope="session")
def small_flowers(shared_data, tmp_path_factory):
    """``small_flowers(classes)``: the first ``classes`` flowers5 classes x (3 train + 1 val) photos as
    symlinked ImageFolder trees, (train, val)."""

    def build(classes: int = 5) -> tuple[Path, Path]:
        root = tmp_path_factory.mktemp(f"flowers{4 * classes}")
        for cls_dir in sorted((shared_data / "flowers5").iterdir())[:classes]:
            photos = sorted(cls_dir.glob("*.jpg"))[:4]
            for split, chosen in (("train", photos[:3]), ("val", photos[3:])):
                (root / split / cls_dir.name).mkdir(parents=True)
                for p in chosen:
                    (root / split / cls_dir.name / p.name).symlink_to(p)
        return root / "train", root / "val"

    return build


@pytest.fixture(scope="module")
def twenty_flowers(small_flowers):
    """5 classes x (3 train + 1 val) flowers5 photos."""
    return small_flowers(5)
