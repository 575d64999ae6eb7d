"""Object storage (S3, and what speaks its API) as the home of a cache root, through s3fs.

Besides reading, writing, listing and deleting whole objects, the cache needs two conditional
writes: `put_new` (If-None-Match: *, refused when the object exists) makes a manifest a commit
marker and takes a free lease; `replace` (If-Match: ETAG) renews or takes over a lease only if
nobody wrote it since it was read. s3fs offers them only through its S3 client, so this module
speaks S3; a URL of another protocol is refused with one line (no conditional writes, no
guarantees).

Credentials and the endpoint come from the standard AWS variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_PROFILE, ...) or from fsspec
storage options given with `use_storage_options`, which hands them to child processes in the
environment: they are never written to a file.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Iterable, TypeVar

from .errors import CacheRootError

OPTIONS_ENV = "LORAPIPE_STORAGE_OPTIONS"  # JSON fsspec options for s3:// URLs, inherited by child processes
PROTOCOLS = ("s3", "s3a")
URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
PRECONDITION_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
CONCURRENCY = 32
T = TypeVar("T")


def is_url(value: object) -> bool:
    """Whether `value` names an object-storage location (a `scheme://` string other than file://)."""
    match = URL.match(value) if isinstance(value, str) else None
    return bool(match) and match.group(1) != "file"


def local_path(value: str | Path) -> Path:
    """A local path, `file://` URLs included."""
    match = URL.match(value) if isinstance(value, str) else None
    return Path(match.group(2)) if match and match.group(1) == "file" else Path(value)


def join(url: str, rel: str) -> str:
    return f"{url.rstrip('/')}/{rel}" if rel else url.rstrip("/")


def use_storage_options(options: dict[str, Any]) -> None:
    """Make `options` the fsspec options of every object URL opened by this process and by the
    processes it starts (kept in the environment, never in a file)."""
    if options:
        os.environ[OPTIONS_ENV] = json.dumps(options)
    else:
        os.environ.pop(OPTIONS_ENV, None)


def storage_options() -> dict[str, Any]:
    return json.loads(os.environ.get(OPTIONS_ENV) or "{}")


@dataclass(frozen=True, slots=True)
class Entry:
    """A listed object."""

    size: int
    etag: str
    modified: float  # seconds since the epoch


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """The bucket and prefix of an object URL that can hold a cache; else CacheRootError, one line."""
    match = URL.match(url)
    if not match or match.group(1) not in PROTOCOLS:
        raise CacheRootError(f"{url}: only s3:// URLs (S3 and S3-compatible stores: MinIO, SeaweedFS, R2, ...) or"
                             " local folders can hold a cache: the cache's guarantees need conditional writes")
    if "@" in match.group(2).split("/", 1)[0]:
        raise CacheRootError(f"{url.split('@')[-1]}: credentials in a URL would be written into logs and"
                             " manifests: give them as AWS_* variables or storage_options")
    bucket, _, prefix = match.group(2).strip("/").partition("/")
    if not bucket:
        raise CacheRootError(f"{url}: no bucket named")
    return bucket, prefix.strip("/")


class ObjectRoot:
    """A bucket and prefix, addressed by paths relative to the prefix ("encode/KEY/samples.json")."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = bucket_and_prefix(url)
        self.fs = _filesystem()

    def __repr__(self) -> str:
        return f"ObjectRoot({self.url})"

    @property
    def endpoint(self) -> str:
        """The URL of the S3 service, as the client resolved it (storage_options, AWS_ENDPOINT_URL or
        AWS's own); no request is made."""
        return self.fs.s3.meta.endpoint_url

    def key(self, rel: str) -> str:
        return posixpath.join(self.prefix, rel) if self.prefix else rel

    def url_of(self, rel: str) -> str:
        return join(self.url, rel)

    # ---- reading
    def get(self, rel: str) -> bytes | None:
        """The object's bytes; None when there is no such object."""
        found = self.get_tagged(rel)
        return found[0] if found else None

    def get_tagged(self, rel: str) -> tuple[bytes, str] | None:
        """(bytes, ETag), or None when there is no such object."""
        return self._run(self._get(rel))

    def get_many(self, rels: Iterable[str]) -> dict[str, bytes | None]:
        rels = list(rels)
        found = self._run(_bounded([self._get(rel) for rel in rels]))
        return {rel: got[0] if got else None for rel, got in zip(rels, found)}

    def list(self, prefix: str) -> dict[str, Entry]:
        """Every object whose path starts with `prefix` (give folders with their trailing "/"), by path
        relative to `prefix`: one request per 1,000 objects."""
        return self._run(self._list(prefix))

    def folders(self, prefix: str) -> list[str]:
        """The names of the "folders" right under `prefix` (give it with its trailing "/", or "")."""
        return self._run(self._folders(prefix))

    def download(self, rel: str, local: Path) -> None:
        self._run(self.fs._get_file(f"{self.bucket}/{self.key(rel)}", str(local)), rel)

    def download_many(self, pairs: list[tuple[str, Path]]) -> None:
        self._run(_bounded([self.fs._get_file(f"{self.bucket}/{self.key(rel)}", str(local)) for rel, local in pairs]))

    # ---- writing
    def put(self, rel: str, data: bytes) -> str:
        """Write (or overwrite) an object; returns its ETag."""
        return self._run(self._put(rel, data))

    def put_new(self, rel: str, data: bytes) -> bool:
        """Create the object only if it does not exist (If-None-Match: *); False if it does."""
        return self._conditional(self._put(rel, data, IfNoneMatch="*")) is not None

    def replace(self, rel: str, data: bytes, etag: str) -> str | None:
        """Overwrite the object only if its ETag is still `etag`; returns the new ETag, or None when
        someone else wrote it meanwhile."""
        return self._conditional(self._put(rel, data, IfMatch=etag))

    def upload(self, local: Path, rel: str) -> None:
        self._run(self.fs._put_file(str(local), f"{self.bucket}/{self.key(rel)}"), rel)

    def upload_many(self, pairs: list[tuple[Path, str]]) -> None:
        self._run(_bounded([self.fs._put_file(str(local), f"{self.bucket}/{self.key(rel)}") for local, rel in pairs]))

    def delete(self, rels: Iterable[str]) -> None:
        keys = [self.key(rel) for rel in rels]
        for start in range(0, len(keys), DELETE_BATCH):
            batch = {"Objects": [{"Key": k} for k in keys[start:start + DELETE_BATCH]], "Quiet": True}
            self._run(self.fs._call_s3("delete_objects", Bucket=self.bucket, Delete=batch))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`; returns how many there were."""
        found = self.list(prefix)
        self.delete(prefix + rel for rel in found)
        return len(found)

    # ---- the S3 calls
    async def _get(self, rel: str) -> tuple[bytes, str] | None:
        try:
            response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key(rel))
        except FileNotFoundError as error:
            if _not_s3(error):
                raise
            return None
        async with response["Body"] as body:
            return await body.read(), response["ETag"]

    async def _put(self, rel: str, data: bytes, **condition: str) -> str:
        response = await self.fs._call_s3("put_object", Bucket=self.bucket, Key=self.key(rel), Body=data, **condition)
        if "ETag" not in response:  # an S3 store answers every write with the object's ETag
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise NotS3Answer(f"HTTP {status} without an ETag to PutObject")
        return response["ETag"]

    async def _list(self, prefix: str) -> dict[str, Entry]:
        found, full = {}, self._full(prefix)
        async for page in self._pages(full):
            for item in page.get("Contents", []):
                rel = item["Key"][len(full):]
                if rel and not rel.endswith("/"):  # "folder" marker objects hold nothing
                    found[rel] = Entry(item["Size"], item["ETag"], item["LastModified"].timestamp())
        return found

    async def _folders(self, prefix: str) -> list[str]:
        found, full = [], self._full(prefix)
        async for page in self._pages(full, Delimiter="/"):
            found += [p["Prefix"][len(full):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(found)

    async def _pages(self, full_prefix: str, **options: str):
        """The pages of ListObjectsV2 under a full key prefix (1,000 objects each)."""
        token = None
        while True:
            page = await self.fs._call_s3("list_objects_v2", Bucket=self.bucket, Prefix=full_prefix, **options,
                                          **({"ContinuationToken": token} if token else {}))
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _full(self, prefix: str) -> str:
        return self.key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")

    def _conditional(self, call: Awaitable[str]) -> str | None:
        try:
            return self._run(call)
        except (OSError, CacheRootError) as error:
            if _precondition_failed(error):
                return None
            raise

    def _run(self, call: Awaitable[T], rel: str = "") -> T:
        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, _awaited, call)
        except Exception as error:  # botocore / aiohttp errors: one line naming the place and the cause
            if isinstance(error, FileNotFoundError) and not _not_s3(error):
                raise
            if isinstance(error, OSError) and _precondition_failed(error):
                raise
            raise ObjectStoreError(self.url_of(rel), error, self.endpoint if _not_s3(error) else "") from error


@dataclass(frozen=True)
class ObjectFile:
    """A file on object storage as a listing gave it (size and ETag say which version it is), with
    the few Path methods that readers of a dataset use."""

    root: ObjectRoot
    rel: str
    size: int
    etag: str

    @property
    def url(self) -> str:
        return self.root.url_of(self.rel)

    @property
    def name(self) -> str:
        return posixpath.basename(self.rel)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.rel)[1]

    def __str__(self) -> str:
        return self.url

    def read_bytes(self) -> bytes:
        data = self.root.get(self.rel)
        if data is None:
            raise FileNotFoundError(2, "No such file or directory", self.url)
        return data

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def open(self, mode: str = "rb") -> io.BytesIO:
        if mode != "rb":
            raise ValueError(f"{self.url}: dataset files are read only")
        return io.BytesIO(self.read_bytes())


def json_object(data: bytes | None) -> dict:
    """The JSON object in `data`; {} for none, unreadable JSON or another JSON value."""
    try:
        found = json.loads(data or b"")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def list_files(url: str) -> dict[str, ObjectFile]:
    """Every object under the "folder" `url`, by path relative to it."""
    root = ObjectRoot(url)
    return {rel: ObjectFile(root, rel, entry.size, entry.etag) for rel, entry in sorted(root.list("").items())}


def read_url(url: str) -> bytes:
    """The bytes of one object (FileNotFoundError when there is none)."""
    folder, _, name = url.rstrip("/").rpartition("/")
    return ObjectFile(ObjectRoot(folder), name, 0, "").read_bytes()


class ObjectStoreError(CacheRootError):
    """Object storage refused or could not be reached."""

    def __init__(self, where: str, error: BaseException, endpoint: str = ""):
        self.where, self.cause, self.endpoint = where, error, endpoint
        self.reason = _describe(error, URL.match(where).group(2).split("/", 1)[0], endpoint)
        super().__init__(f"{where}: {self.reason}")

    def __reduce__(self):
        return ObjectStoreError, (self.where, self.cause, self.endpoint)


def _filesystem():
    try:
        import s3fs
    except ImportError:
        raise CacheRootError("an s3:// cache_dir or data path needs s3fs: pip install s3fs") from None
    return s3fs.S3FileSystem(**storage_options())


async def _awaited(call: Awaitable[T]) -> T:
    return await call


async def _bounded(calls: list[Awaitable[T]]) -> list[T]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


def _precondition_failed(error: BaseException) -> bool:
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""
    if isinstance(error, FileExistsError):
        return True
    cause = getattr(error, "cause", None) or error.__cause__
    response = getattr(cause, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code in PRECONDITION_CODES or status in ("412", "409")


class NotS3Answer(Exception):
    """An answer that no S3 store gives."""


def _not_s3(error: BaseException) -> str:
    """How the endpoint answered, when it did not answer as S3 does ("" when it did or did not answer):
    S3 states every error of a GET, PUT or LIST in an XML body with a code of its own (NoSuchKey,
    AccessDenied, ...); without one botocore gives an empty code or the bare HTTP status. A HEAD's
    answer has no body, from S3 too."""
    if isinstance(error, NotS3Answer):
        return str(error)
    cause = error.__cause__ or error
    response = getattr(cause, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    operation = getattr(cause, "operation_name", "")
    if not response or (code and not code.isdigit()) or operation.startswith("Head"):
        return ""
    return f"HTTP {response.get('ResponseMetadata', {}).get('HTTPStatusCode', code)} to {operation}"


def bucket_name_problem(bucket: str) -> str:
    """Which of S3's naming rules `bucket` breaks ("" when none): 3 to 63 lowercase letters, digits,
    dots and hyphens, beginning and ending with a letter or digit, no two dots in a row, not an IP
    address."""
    others = sorted(set(re.sub(r"[a-z0-9.-]", "", bucket)))
    if others:
        return (f"it contains {', '.join(map(repr, others))}: a bucket name has lowercase letters, digits, dots and"
                " hyphens")
    if not 3 <= len(bucket) <= 63:
        return f"it has {len(bucket)} characters: a bucket name has 3 to 63"
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return "it must begin and end with a letter or digit"
    if ".." in bucket:
        return "it has two dots in a row"
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket):
        return "it is an IP address"
    return ""


def _describe(error: BaseException, bucket: str, endpoint: str) -> str:
    """What went wrong and what to do, in one line."""
    cause = error.__cause__ or error
    name = type(cause).__name__
    lines = str(cause).splitlines()
    text = (lines[-1] if name == "ParamValidationError" else lines[0]) if lines else name
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionRefusedError"):
        return f"cannot reach the object store ({text}): check AWS_ENDPOINT_URL or storage_options.endpoint_url"
    if "Invalid bucket name" in text or "InvalidBucketName" in text:
        return f"invalid bucket name {bucket!r}: {bucket_name_problem(bucket) or text}"
    answer = _not_s3(error)
    if answer:
        return (f"{endpoint} did not answer as S3 ({answer}): is it an S3 server? check AWS_ENDPOINT_URL or"
                " storage_options.endpoint_url")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile), or storage_options"
    if isinstance(cause, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"access denied ({text}): check the credentials and the bucket's policy"
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return f"no such bucket ({text}): create it or fix the URL"
    return f"{name}: {text}"
