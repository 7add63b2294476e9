"""Object storage for prepared datasets: storage options, ``http://`` endpoints, and one-line errors.

LitData reads and writes ``s3://`` through boto3 (listing, ``index.json``, small files) and obstore (chunk
uploads and downloads). Both take the endpoint, credentials and region from where boto3 looks for them
(``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_REGION``,
``~/.aws/config``), or from ``storage_options``: keyword arguments of boto3's ``client("s3", ...)`` such as
``endpoint_url``, which override them. docs/cluster.md lists them.

Two things of LitData's S3 path are changed here:

- **Retries.** LitData's boto3 client retries 1,000 times (``adaptive``), so a store that stops answering
  hangs a run for hours. The client gets ``AWS_MAX_ATTEMPTS`` attempts instead (default 5, boto3's
  ``standard`` mode), then the error names the URL and the endpoint. Chunks are downloaded by obstore,
  whose store LitData builds with obstore's default retries (10, for up to 3 minutes) whatever boto3's are;
  :func:`bound_chunk_retries` gives that store the same ``AWS_MAX_ATTEMPTS`` (same version check).
- **http:// endpoints.** LitData 0.2.76's obstore store passes the endpoint but not ``allow_http``, and obstore
  refuses a plain-HTTP endpoint ("HTTP error: builder error"), which in-cluster MinIO and Ceph gateways often
  are. :func:`allow_http_endpoints` adds ``allow_http`` to LitData's obstore client options. It lets obstore
  follow an endpoint URL that itself says ``http://``; AWS and ``https://`` endpoints are unchanged. Applied
  only to the LitData versions checked (:data:`HTTP_PATCHED_LITDATA`); reported upstream, see
  docs/cluster.md.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from ssl_xcit.errors import UserError

# boto3 ``client("s3", ...)`` keywords a user may give (JSON values; ``config`` is set here, see the doc).
S3_OPTION_KEYS = (
    "endpoint_url",
    "region_name",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "verify",
    "use_ssl",
)
DEFAULT_MAX_ATTEMPTS = 5
# Longest time obstore keeps retrying one chunk request (its default is 3 minutes).
CHUNK_RETRY_SECONDS = 60
# LitData versions whose obstore store is built without ``allow_http`` (read from a module dict) and with
# obstore's default retries (built by ``_build_obstore_s3_store``, looked up by name): both patches check it.
HTTP_PATCHED_LITDATA = ("0.2.76",)


def storage_options(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``value`` (a JSON object as text, a mapping or None) as LitData's ``storage_options``; a clear error
    for text that is not a JSON object or for a key boto3's S3 client does not take."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise UserError(
                f"storage options {value!r}: not JSON ({err.msg}); give an object such as "
                '\'{"endpoint_url": "http://minio:9000"}\''
            ) from None
    if not isinstance(value, Mapping):
        raise UserError(f"storage options {value!r}: give a JSON object of {', '.join(S3_OPTION_KEYS)}")
    unknown = sorted(set(value) - set(S3_OPTION_KEYS))
    if unknown:
        raise UserError(
            f"storage options: unknown key(s) {', '.join(unknown)}; valid: {', '.join(S3_OPTION_KEYS)} (a "
            "profile is chosen with AWS_PROFILE)"
        )
    return dict(value)


def litdata_options(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``storage_options`` to hand LitData for ``url``: the user's, and for ``s3://`` a boto3 config with
    bounded retries (module doc)."""
    options = dict(options or {})
    if str(url).startswith("s3://"):
        from botocore.config import Config

        options["config"] = Config(
            retries={"mode": "standard", "total_max_attempts": max_attempts()},
            connect_timeout=10,
            read_timeout=60,
        )
    return options


def max_attempts() -> int:
    """Attempts per storage request: ``AWS_MAX_ATTEMPTS`` (as boto3 reads it), default 5."""
    value = os.environ.get("AWS_MAX_ATTEMPTS", "")
    try:
        attempts = int(value) if value else DEFAULT_MAX_ATTEMPTS
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise UserError(f"AWS_MAX_ATTEMPTS={value!r}: give a whole number of attempts >= 1 (default 5)")
    return attempts


def allow_http_endpoints() -> bool:
    """Let LitData's obstore store use an ``http://`` endpoint (module doc); True when the patch applies."""
    import litdata
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if litdata.__version__ not in HTTP_PATCHED_LITDATA or not isinstance(options, dict):
        return False
    if "allow_http" not in options:
        # A new dict, not an update: the store reads the module attribute each time it is built.
        downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": "true"}
    return True


def bound_chunk_retries() -> bool:
    """Give LitData's obstore chunk store ``AWS_MAX_ATTEMPTS`` attempts (module doc); True when it applies."""
    import litdata
    from litdata.streaming import downloader

    build = getattr(downloader, "_build_obstore_s3_store", None)
    if litdata.__version__ not in HTTP_PATCHED_LITDATA or build is None:
        return False
    if getattr(build, "bounded_retries", False):
        return True

    def bounded(bucket: str, s3_client: Any) -> Any:
        from datetime import timedelta

        from obstore.store import S3Store

        store = build(bucket, s3_client)
        # S3Store takes its retries only when built; the rest of LitData's settings are carried over.
        return S3Store(
            config=store.config,
            client_options=store.client_options,
            credential_provider=store.credential_provider,
            retry_config={
                "max_retries": max_attempts() - 1,
                "retry_timeout": timedelta(seconds=CHUNK_RETRY_SECONDS),
            },
        )

    bounded.bounded_retries = True  # type: ignore[attr-defined]
    downloader._build_obstore_s3_store = bounded  # looked up by name each time a store is built
    return True


def provider(url: str, options: Mapping[str, Any] | None = None) -> Any:
    """LitData's file-system provider for ``url`` (s3 and gs; LitData has no azure provider)."""
    from litdata.streaming.fs_provider import _get_fs_provider

    try:
        return _get_fs_provider(url, litdata_options(url, options))
    except ValueError:
        raise UserError(
            f"{url}: this version of ssl-xcit reads prepared datasets from s3:// and gs:// URLs or local "
            "folders; copy the dataset to one of those"
        ) from None


def endpoint(url: str, options: Mapping[str, Any] | None = None) -> str:
    """The endpoint requests for ``url`` go to, as boto3 resolves it (options, environment, profile)."""
    if not str(url).startswith("s3://"):
        return urlparse(str(url)).scheme + " storage"
    try:
        return provider(url, options).client.client.meta.endpoint_url
    except Exception:  # only for a message: fall back to what the user set
        return (options or {}).get("endpoint_url") or os.environ.get(
            "AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL", "the default AWS endpoint")
        )


def _error_code(err: BaseException) -> str:
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _request(err: BaseException, text: str) -> str:
    """``"(GET URL) "`` from obstore's message of a failed request, ``"(URL) "`` from botocore's, else
    ``"(MESSAGE) "``."""
    found = re.search(r"Error performing (\w+ \S+)", text)
    if found:
        return f"({found.group(1)}) "
    kwargs = getattr(err, "kwargs", None)  # botocore keeps the request's URL here
    if isinstance(kwargs, dict) and kwargs.get("endpoint_url"):
        return f"({kwargs['endpoint_url']}) "
    return f"({text[:120]}) "


def explain(err: BaseException, url: str, options: Mapping[str, Any] | None = None) -> UserError | None:
    """A one-line :class:`UserError` for a storage failure of ``url`` that bad settings or an unreachable store
    cause (naming the URL, the endpoint and the fix); None for anything else."""
    try:
        import botocore.exceptions as boto
    except ImportError:  # pragma: no cover - boto3 is a LitData dependency
        boto = None
    text = " ".join(str(err).split())
    code = _error_code(err)
    bucket = urlparse(str(url)).netloc
    where = f"{url} (endpoint {endpoint(url, options)})"
    credentials = (
        "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the storage options' "
        "aws_access_key_id / aws_secret_access_key"
    )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden") or (
        type(err).__name__ in ("PermissionDeniedError", "UnauthenticatedError")
    ):
        return UserError(
            f"{where}: the store refused the credentials ({code or type(err).__name__}); {credentials}"
        )
    if code == "NoSuchBucket" or "NoSuchBucket" in text:
        return UserError(f"{where}: bucket {bucket} does not exist; create it or correct the URL")
    if boto is not None and isinstance(err, boto.NoCredentialsError | boto.PartialCredentialsError):
        return UserError(f"{where}: no credentials found; {credentials}")
    unreachable = (
        (boto.EndpointConnectionError, boto.ConnectTimeoutError, boto.ReadTimeoutError) if boto else ()
    )
    if isinstance(err, unreachable) or (
        type(err).__name__ == "GenericError" and "error sending request" in text
    ):
        return UserError(
            f"{where}: the store did not answer {_request(err, text)}after {max_attempts()} attempts; check that "
            "it is up and that AWS_ENDPOINT_URL or the storage options' endpoint_url names it"
        )
    if type(err).__name__ == "GenericError" and "builder error" in text:
        return UserError(
            f"{where}: LitData's obstore client refused the endpoint (an http:// endpoint needs the "
            f"allow_http patch, which this LitData version does not take); use an https:// endpoint or "
            f"litdata {HTTP_PATCHED_LITDATA[-1]}"
        )
    return None


@contextmanager
def storage_errors(url: str, options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Turn a storage failure of ``url`` that :func:`explain` recognises into its one-line error."""
    if not str(url).startswith(("s3://", "gs://")):
        yield
        return
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        # LitData wraps failures of its worker threads; the cause is what the store said.
        cause: BaseException | None = err
        while cause is not None:
            explained = explain(cause, url, options)
            if explained is not None:
                raise explained from err
            cause = cause.__cause__ or cause.__context__
        raise


def missing_dataset(url: str, name: str, options: Mapping[str, Any] | None = None) -> UserError | None:
    """Why ``url`` has no ``name`` when the reason is a missing bucket or an empty prefix; None when the prefix
    holds other objects (an interrupted or foreign output)."""
    if not str(url).startswith("s3://"):
        return None
    parsed = urlparse(str(url))
    prefix = parsed.path.strip("/")
    client = provider(url, options).client.client
    with storage_errors(url, options):
        try:
            listed = client.list_objects_v2(
                Bucket=parsed.netloc, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1
            )
        except Exception as err:
            if _error_code(err) == "NoSuchBucket":
                return explain(err, url, options)
            raise
    if listed.get("KeyCount", 0) == 0:
        return UserError(
            f"{url} (endpoint {endpoint(url, options)}): nothing is stored under this prefix, so there is no "
            f"{name}; correct the URL, or run `ssl-xcit prepare SRC {url}` first"
        )
    return None


# At import, so that DataLoader and LitData workers (spawned too) have them.
allow_http_endpoints()
bound_chunk_retries()
