"""The shared store: Parquet exports and incident recordings shipped to an S3-compatible object store
(`recorder export --parquet s3://BUCKET/PREFIX`, `recorder start --keep ... --ship s3://BUCKET/PREFIX`),
and exports read back from it (`recorder cluster explain s3://BUCKET/PREFIX`).

Only an s3:// URL the user passed ever reaches the network: nothing here is imported or run
otherwise. The store is pyarrow's S3 filesystem (pyarrow is a dependency already), configured by
the URL and the usual AWS_* environment variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION (or AWS_DEFAULT_REGION; us-east-1 if unset) and AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL for a store that is not AWS (MinIO, Ceph, ...: http://host:9000).

What is shipped is first put in a spool, a folder next to the database (DB.spool/), one entry per
upload (its files and a manifest with the destination), then uploaded with retries. An entry the
store did not take (down, unreachable, refused) stays in the spool and is uploaded, oldest first,
by the next shipment that reaches the store; nothing recorded is lost meanwhile.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from store.errors import UserError

SCHEME = "s3://"
ATTEMPTS = 3  # uploads of one spool entry before it waits for the next shipment
BACKOFF_S = (0.5, 1.0)  # between those attempts
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0
SDK_ATTEMPTS = 2  # tries of one request by the S3 client itself
PARALLEL = 8  # requests in flight at once
MANIFEST = "manifest.json"
ABANDONED_S = 3600  # an entry still without a manifest after this long was left by a process that died filling it
PAYLOAD = "payload"


class StoreUnreachable(Exception):
    """The object store did not take an upload (after the retries)."""


def is_url(target: object) -> bool:
    """True for an object-store URL (s3://...); other schemes are refused by check_url."""
    return "://" in str(target)


def check_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of s3://BUCKET/PREFIX, or a one-line refusal."""
    if not url.startswith(SCHEME):
        raise UserError(f"{url}: only s3:// URLs (an S3-compatible store; AWS_ENDPOINT_URL for a non-AWS one) "
                        "or local folders are supported")
    parts = urlsplit(url)
    if not parts.netloc or parts.query or parts.fragment:
        raise UserError(f"{url} is not s3://BUCKET/PREFIX: pass the bucket and an optional prefix, e.g. "
                        "s3://stall-recordings/run42")
    return parts.netloc, parts.path.strip("/")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def filesystem(url: str):
    """pyarrow's S3 filesystem for `url`, and the path of the URL in it (BUCKET/PREFIX)."""
    bucket, prefix = check_url(url)
    from pyarrow import fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options: dict = {
        "region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S,
        # few retries per request: the spool entry as a whole is retried (ATTEMPTS), and a store that
        # is down should cost seconds, not the SDK's default minute of back-off
        "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=SDK_ATTEMPTS),
    }
    if endpoint:
        where = urlsplit(endpoint)
        if where.scheme not in ("http", "https") or not where.netloc:
            raise UserError(f"AWS_ENDPOINT_URL={endpoint} is not an http(s):// URL: set it to the store's address, "
                            "e.g. http://127.0.0.1:9000")
        options.update(endpoint_override=where.netloc, scheme=where.scheme)
        # a store of its own (MinIO, Ceph) is addressed by path: BUCKET is not a host name there
        options["force_virtual_addressing"] = False
    try:
        return fs.S3FileSystem(**options), f"{bucket}/{prefix}".rstrip("/")
    except (TypeError, ValueError) as e:
        raise UserError(f"cannot use {url}: {e}") from None


# -- the spool ------------------------------------------------------------------------------------
def spool_folder(db: str | os.PathLike) -> Path:
    """The spool of a database: DB.spool/ next to it."""
    db = Path(db).resolve()
    return db.with_name(db.name + ".spool")


def new_entry(spool: Path, name: str) -> Path:
    """A spool entry's payload folder, to be filled, then enqueued with `enqueue`."""
    entry = spool / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}-{name}"
    (entry / PAYLOAD).mkdir(parents=True)
    return entry / PAYLOAD


def enqueue(payload: Path, url: str, replace_folders: bool) -> Path:
    """Mark a filled payload for upload to `url` (its files keep their paths under it). With
    `replace_folders`, each remote folder that receives files is emptied first (an export's
    partition replaces the one exported before)."""
    entry = payload.parent
    (entry / MANIFEST).write_text(json.dumps({"url": url, "replace_folders": replace_folders,
                                              "queued_ns": time.time_ns()}))
    return entry


def pending(spool: Path) -> list[Path]:
    """Entries waiting for upload, oldest first (entries without a manifest are still being filled)."""
    if not spool.is_dir():
        return []
    return sorted(p for p in spool.iterdir() if (p / MANIFEST).is_file())


def drain(spool: Path, sleep=time.sleep) -> dict:
    """Upload the spool's entries, oldest first; stop at the first the store does not take.
    Returns {'uploaded': [urls], 'pending': entries left, 'error': why the store refused, or None}."""
    uploaded: list[str] = []
    error = None
    if spool.is_dir():
        for p in spool.iterdir():
            if not (p / MANIFEST).is_file() and time.time() - p.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(p, ignore_errors=True)
    entries = pending(spool)
    for i, entry in enumerate(entries):
        manifest = json.loads((entry / MANIFEST).read_text())
        try:
            _upload_with_retries(entry / PAYLOAD, manifest["url"], manifest["replace_folders"], sleep)
        except StoreUnreachable as e:
            error = str(e)
            return {"uploaded": uploaded, "pending": len(entries) - i, "error": error}
        uploaded.append(manifest["url"])
        shutil.rmtree(entry, ignore_errors=True)
    try:
        spool.rmdir()  # empty: nothing waits (an entry still being filled keeps it)
    except OSError:
        pass
    return {"uploaded": uploaded, "pending": 0, "error": None}


def ship_folder(payload: Path, url: str, replace_folders: bool) -> dict:
    """Enqueue a filled payload and drain its spool (this entry and every older one)."""
    enqueue(payload, url, replace_folders)
    return drain(payload.parent.parent)


def ship_file(path: Path, url: str, spool: Path) -> dict:
    """Ship one file to `url` (the object's full URL) through the spool."""
    check_url(url)
    payload = new_entry(spool, path.name)
    target = payload / path.name
    try:
        os.link(path, target)  # same file system: no copy
    except OSError:
        shutil.copy2(path, target)
    base, _, name = url.rstrip("/").rpartition("/")
    if name != path.name:
        target.rename(payload / name)
    return ship_folder(payload, base, replace_folders=False)


def _upload_with_retries(payload: Path, url: str, replace_folders: bool, sleep) -> None:
    last = None
    for attempt in range(ATTEMPTS):
        try:
            _upload(payload, url, replace_folders)
            return
        except (OSError, RuntimeError) as e:  # pyarrow raises OSError for network and S3 errors
            last = e
            if attempt < ATTEMPTS - 1:
                sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
    raise StoreUnreachable(_reason(url, last))


def _reason(url: str, e: BaseException | None) -> str:
    text = " ".join(str(e).split()) if e else "unknown error"
    return f"{url}: {text[:300]}"


def _upload(payload: Path, url: str, replace_folders: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    s3, base = filesystem(url)
    files = sorted(p for p in payload.rglob("*") if p.is_file())
    s3.get_file_info(base)  # one request first: a store that is down fails here, not in 80 at once

    def put(f: Path) -> None:
        key = f"{base}/{f.relative_to(payload).as_posix()}"
        with f.open("rb") as src, s3.open_output_stream(key) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    # an export is ~80 small objects: requests in parallel (pyarrow releases the GIL while waiting)
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        if replace_folders:
            folders = sorted({f.parent.relative_to(payload).as_posix() for f in files} - {"."})
            list(pool.map(lambda d: s3.delete_dir_contents(f"{base}/{d}", missing_dir_ok=True), folders))
        list(pool.map(put, files))


# -- reading back ---------------------------------------------------------------------------------
def download_export(url: str, dest: Path, tables: tuple[str, ...]) -> None:
    """Copy the given tables of the Parquet export at `url` into `dest` (its layout kept)."""
    from pyarrow import fs

    s3, base = filesystem(url)
    try:
        found = 0
        for table in tables:
            infos = s3.get_file_info(fs.FileSelector(f"{base}/{table}", recursive=True, allow_not_found=True))
            for info in infos:
                if info.type != fs.FileType.File or not info.path.endswith(".parquet"):
                    continue
                local = dest / info.path[len(base) + 1:]
                local.parent.mkdir(parents=True, exist_ok=True)
                with s3.open_input_stream(info.path) as src, local.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                found += 1
    except OSError as e:
        raise UserError(f"cannot read {url}: {' '.join(str(e).split())[:300]} (check AWS_ENDPOINT_URL and the "
                        "credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
    if not (dest / "session").is_dir() or not (dest / "nccl_call").is_dir():
        raise UserError(f"{url} holds no Parquet export ({found} files read): pass the URL given to "
                        "'recorder export --parquet'")
