"""LitData's chunk store (obstore) makes ``AWS_MAX_ATTEMPTS`` attempts, as its boto3 client does, instead of
obstore's default 10 retries over up to 3 minutes (``ssl_xcit.data.storage``)."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import litdata
import pytest

from ssl_xcit.data import storage
from ssl_xcit.errors import UserError


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.skipif(
    litdata.__version__ not in storage.HTTP_PATCHED_LITDATA, reason="patched LitData versions only"
)
def test_chunk_downloads_make_aws_max_attempts_attempts(closed_port, monkeypatch):
    import obstore
    from litdata.streaming import downloader

    endpoint = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    options = storage.litdata_options("s3://bucket/x", {"endpoint_url": endpoint, "region_name": "us-east-1",
                                       "aws_access_key_id": "k", "aws_secret_access_key": "s"})  # fmt: skip
    # The store LitData's S3 downloader builds for its chunk downloads, from its own boto3 client.
    chunks = downloader.S3Downloader("s3://bucket/x", "unused", [], options)._get_store("bucket")
    assert chunks.retry_config["max_retries"] == 2
    assert chunks.retry_config["retry_timeout"] == timedelta(seconds=storage.CHUNK_RETRY_SECONDS)
    # LitData's own settings are kept: its endpoint, path-style requests, timeouts, and http:// allowed.
    assert chunks.config["endpoint"] == endpoint and chunks.config["virtual_hosted_style_request"] == "false"
    assert chunks.client_options == {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
    start = time.monotonic()
    with pytest.raises(Exception, match=r"after 2 retries, max_retries: 2") as failed:
        obstore.get(chunks, "x/chunk-0-0.bin")
    assert time.monotonic() - start < 10
    explained = storage.explain(failed.value, "s3://bucket/x", {"endpoint_url": endpoint})
    assert str(explained) == (
        f"s3://bucket/x (endpoint {endpoint}): the store did not answer (GET {endpoint}/bucket/x/chunk-0-0.bin) "
        "after 3 attempts; check that it is up and that AWS_ENDPOINT_URL or the storage options' endpoint_url "
        "names it"
    )


@pytest.mark.parametrize("value", ["0", "many", "-1"])
def test_a_bad_aws_max_attempts_is_one_clear_error(value, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", value)
    with pytest.raises(UserError, match=rf"AWS_MAX_ATTEMPTS='{value}': give a whole number of attempts >= 1"):
        storage.litdata_options("s3://bucket/x", None)
