"""The shared store: Parquet exports and incident recordings shipped to an S3-compatible object store
(`recorder export --parquet s3://BUCKET/PREFIX`, `recorder start --keep ... --ship s3://BUCKET/PREFIX`),
and exports read back from it (`recorder cluster explain s3://BUCKET/PREFIX`).

Only an s3:// URL the user passed ever reaches the network: nothing here is imported or run
otherwise. The store is pyarrow's S3 filesystem (pyarrow is a dependency already), configured by
the URL and the usual AWS_* environment variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION (or AWS_DEFAULT_REGION; us-east-1 if unset) and AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL for a store that is not AWS (MinIO, Ceph, ...: http://host:9000).

Credentials never go in the URL (s3://KEY:SECRET@BUCKET is refused: a URL is printed and logged).

What is shipped is first put in a spool, a folder next to the database (DB.spool/), one entry per
upload (its files and a manifest with the destination), then uploaded with retries. An entry the
store did not take (down, unreachable, refused) stays in the spool and is uploaded, oldest first,
by the next shipment to the same destination that reaches the store; nothing recorded is lost
meanwhile.

The spool is read as untrusted input (the recorder may run as root beside other users): it is
created 0700 and refused unless it belongs to this user and no one else can write it; a manifest is
written atomically and read back with the same checks as a URL on the command line, and an entry
is sent only to the destination of the shipment draining it; symbolic links are never followed. An
entry that fails a check (a corrupt or empty manifest, a bad URL, a link or device in its payload)
is moved to DB.spool/quarantine/ and said, and the others go on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
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
QUARANTINE = "quarantine"  # spool entries that failed a check, kept for a person to look at
MANIFEST_MAX_BYTES = 64 << 10
# what new_entry names an entry: the time it was made, a random tag, what it holds
ENTRY_NAME = re.compile(r"\d{20}-[0-9a-f]{8}-[A-Za-z0-9._-]{1,160}")
BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
# one folder or file name of a key the project writes (tables, node=HOST, session=ID, part-0.parquet)
KEY_PART = re.compile(r"[A-Za-z0-9._~%=+-]{1,255}")
NO_FOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class ExportLimits:
    """How much of an export `recorder cluster` reads (an export is input from whoever can write the
    bucket or the folder): files, bytes, and DuckDB's memory and spill."""

    max_bytes: int = 8 << 30
    max_objects: int = 20_000
    memory: str = "4GB"
    spill: str = "16GB"


DEFAULT_LIMITS = ExportLimits()


class StoreUnreachable(Exception):
    """The object store did not take an upload (after the retries)."""


def is_url(target: object) -> bool:
    """True for an object-store URL (s3://...); other schemes are refused by check_url."""
    return "://" in str(target)


def shown(url: str) -> str:
    """`url` as it may be printed: without credentials written into it, without control characters."""
    scheme, sep, rest = str(url).partition("://")
    if sep:
        host, slash, path = rest.partition("/")
        if "@" in host:
            rest = "***@" + host.rpartition("@")[2] + slash + path
    text = scheme + sep + rest
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


def check_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of s3://BUCKET/PREFIX, or a one-line refusal."""
    url = str(url)
    if not url.startswith(SCHEME):
        raise UserError(f"{shown(url)}: only s3:// URLs (an S3-compatible store; AWS_ENDPOINT_URL for a non-AWS one) "
                        "or local folders are supported")
    if "@" in url[len(SCHEME):].partition("/")[0]:
        raise UserError(f"{shown(url)}: credentials in the URL are refused (they would be shown and logged): set "
                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the credentials file, and pass s3://BUCKET/PREFIX")
    parts = urlsplit(url)
    prefix = parts.path.strip("/")
    if (not parts.netloc or parts.query or parts.fragment or not BUCKET_NAME.fullmatch(parts.netloc)
            or any(not KEY_PART.fullmatch(p) or p in (".", "..") for p in prefix.split("/") if prefix)):
        raise UserError(f"{shown(url)} is not s3://BUCKET/PREFIX: pass the bucket and an optional prefix of "
                        "letters, digits and ._-=%~+ between slashes, e.g. s3://stall-recordings/run42")
    return parts.netloc, prefix


def within(url: str, destination: str) -> bool:
    """True when `url` is `destination` or under it (both checked URLs)."""
    bucket, prefix = check_url(url)
    d_bucket, d_prefix = check_url(destination)
    return bucket == d_bucket and (not d_prefix or prefix == d_prefix or prefix.startswith(d_prefix + "/"))


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
            raise UserError(f"AWS_ENDPOINT_URL={shown(endpoint)} is not an http(s):// URL: set it to the store's "
                            "address, e.g. http://127.0.0.1:9000")
        options.update(endpoint_override=where.netloc, scheme=where.scheme)
        # a store of its own (MinIO, Ceph) is addressed by path: BUCKET is not a host name there
        options["force_virtual_addressing"] = False
    try:
        return fs.S3FileSystem(**options), f"{bucket}/{prefix}".rstrip("/")
    except (TypeError, ValueError) as e:
        raise UserError(f"cannot use {url}: {e}") from None


# -- the spool ------------------------------------------------------------------------------------
class SpoolRefused(UserError):
    """The spool is not this user's private folder: nothing is read from it or put in it."""


class BadEntry(Exception):
    """A spool entry that fails a check: it is set aside, never uploaded."""


def spool_folder(db: str | os.PathLike) -> Path:
    """The spool of a database: DB.spool/ next to it."""
    db = Path(db).resolve()
    return db.with_name(db.name + ".spool")


def _private_folder(path: Path, what: str) -> Path:
    """`path` created 0700 if missing; refused unless it is a folder (not a link) of this user that
    group and others cannot write."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SpoolRefused(f"cannot create the {what} {path}: {e.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolRefused(f"the {what} {path} is not a folder (a link or a file): remove it; the recorder creates "
                           "its own")
    if st.st_uid != os.geteuid():
        raise SpoolRefused(f"the {what} {path} belongs to uid {st.st_uid}, not to this recorder's user "
                           f"(uid {os.geteuid()}): remove it, and keep the database in a folder only that user writes")
    if st.st_mode & 0o022:
        raise SpoolRefused(f"the {what} {path} can be written by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
                           f": check what it holds, then chmod 700 {path}")
    return path


def open_spool(spool: Path) -> Path:
    """The spool folder, created 0700; SpoolRefused unless it is this user's private folder."""
    return _private_folder(Path(spool), "spool")


def check_spool(spool: Path) -> None:
    """SpoolRefused when a spool exists at `spool` and is not this user's private folder."""
    if os.path.lexists(spool):
        open_spool(spool)


def _entry_label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120] or "entry"


def new_entry(spool: Path, name: str) -> Path:
    """A spool entry's payload folder, to be filled, then enqueued with `enqueue`."""
    open_spool(spool)
    entry = spool / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}-{_entry_label(name)}"
    os.mkdir(entry, 0o700)
    os.mkdir(entry / PAYLOAD, 0o700)
    return entry / PAYLOAD


def enqueue(payload: Path, url: str, replace_folders: bool) -> Path:
    """Mark a filled payload for upload to `url` (its files keep their paths under it). With
    `replace_folders`, each remote folder that receives files is emptied first (an export's
    partition replaces the one exported before). The manifest appears whole or not at all: a
    full disk leaves no half-written one."""
    check_url(url)
    entry = payload.parent
    data = json.dumps({"url": url, "replace_folders": replace_folders, "queued_ns": time.time_ns()}).encode()
    tmp = entry / f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, entry / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return entry


def _entries(spool: Path) -> list[str]:
    """Names in the spool other than its quarantine folder, oldest first."""
    try:
        return sorted(n for n in os.listdir(spool) if n != QUARANTINE)
    except FileNotFoundError:
        return []


def pending(spool: Path) -> list[Path]:
    """Entries waiting for upload, oldest first (entries without a manifest are still being filled)."""
    out = []
    for name in _entries(spool):
        try:
            if stat.S_ISREG(os.lstat(spool / name / MANIFEST).st_mode):
                out.append(spool / name)
        except OSError:
            continue
    return out


def read_manifest(entry: Path) -> dict:
    """An entry's manifest, checked as user input: {'url', 'replace_folders'}; BadEntry otherwise."""
    try:
        fd = os.open(entry / MANIFEST, os.O_RDONLY | NO_FOLLOW)
    except OSError as e:
        raise BadEntry(f"its manifest cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BadEntry("its manifest is not a file")
        raw = f.read(MANIFEST_MAX_BYTES + 1)
    if not raw.strip():
        raise BadEntry("its manifest is empty (a full disk, or a write cut short)")
    if len(raw) > MANIFEST_MAX_BYTES:
        raise BadEntry(f"its manifest is larger than {MANIFEST_MAX_BYTES} bytes")
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadEntry("its manifest is not JSON (corrupt)") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("url"), str) \
            or not isinstance(manifest.get("replace_folders"), bool):
        raise BadEntry("its manifest lacks a string url and a true/false replace_folders")
    try:
        check_url(manifest["url"])
    except UserError as e:
        raise BadEntry(f"its manifest names a bad destination: {e}") from None
    return {"url": manifest["url"], "replace_folders": manifest["replace_folders"]}


def payload_files(payload: Path) -> list[tuple[str, Path]]:
    """(key under the destination, path) of each file of a payload; BadEntry at a symbolic link,
    a device, a FIFO or a name the project does not write. Nothing is followed."""
    try:
        if not stat.S_ISDIR(os.lstat(payload).st_mode):
            raise BadEntry("its payload is not a folder")
    except FileNotFoundError:
        raise BadEntry("it has no payload folder") from None
    out: list[tuple[str, Path]] = []

    def walk(folder: Path, key: str) -> None:
        with os.scandir(folder) as it:
            for item in sorted(it, key=lambda e: e.name):
                if not KEY_PART.fullmatch(item.name) or item.name in (".", ".."):
                    raise BadEntry(f"its payload holds a name the recorder does not write: {item.name[:80]!r}")
                sub = f"{key}/{item.name}" if key else item.name
                if item.is_symlink():
                    raise BadEntry(f"its payload holds a symbolic link: {sub}")
                if item.is_dir(follow_symlinks=False):
                    walk(Path(item.path), sub)
                elif item.is_file(follow_symlinks=False):
                    out.append((sub, Path(item.path)))
                else:
                    raise BadEntry(f"its payload holds something that is not a file or a folder: {sub}")

    walk(payload, "")
    return out


def quarantine(spool: Path, name: str, why: str) -> str:
    """Move a spool entry that failed a check into DB.spool/quarantine/; the line that says so."""
    folder = _private_folder(spool / QUARANTINE, "spool's quarantine")
    target = folder / name
    if os.path.lexists(target):
        target = folder / f"{name}.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(spool / name, target)  # moves a link itself, never what it points to
        where = f"moved to {target}"
    except OSError as e:
        where = f"and could not be moved ({e.strerror}): remove it"
    return f"spool entry {name[:160]!r} was not uploaded, {where}: {why}"


def drain(spool: Path, destination: str, sleep=time.sleep) -> dict:
    """Upload the spool's entries for `destination` (the URL of this shipment: entries for other
    destinations wait for theirs), oldest first; stop at the first the store does not take. An entry
    that fails a check is set aside (quarantine) and the rest go on. Returns {'uploaded': [urls],
    'pending': entries left for this destination, 'error': why the store refused, or None,
    'quarantined': [what was set aside and why], 'waiting': entries for other destinations}."""
    uploaded: list[str] = []
    quarantined: list[str] = []
    waiting = 0
    check_url(destination)
    if not os.path.lexists(spool):
        return {"uploaded": [], "pending": 0, "error": None, "quarantined": [], "waiting": 0}
    open_spool(spool)
    ready: list[tuple[str, dict]] = []
    for name in _entries(spool):
        path = spool / name
        try:
            st = os.lstat(path)
            if not ENTRY_NAME.fullmatch(name) or not stat.S_ISDIR(st.st_mode):
                raise BadEntry("the recorder makes no such entry (a link, a file, or another name)")
            if not os.path.lexists(path / MANIFEST):  # still being filled, or left by a process that died
                if time.time() - st.st_mtime > ABANDONED_S:
                    shutil.rmtree(path, ignore_errors=True)  # removes links, never follows them
                continue
            manifest = read_manifest(path)
        except BadEntry as e:
            quarantined.append(quarantine(spool, name, str(e)))
            continue
        except FileNotFoundError:  # taken by another shipment meanwhile
            continue
        if not within(manifest["url"], destination):
            waiting += 1
            continue
        ready.append((name, manifest))
    for i, (name, manifest) in enumerate(ready):
        try:
            _upload_with_retries(spool / name / PAYLOAD, manifest["url"], manifest["replace_folders"], sleep)
        except BadEntry as e:
            if os.path.lexists(spool / name):  # not one another shipment took meanwhile
                quarantined.append(quarantine(spool, name, str(e)))
            continue
        except StoreUnreachable as e:
            return {"uploaded": uploaded, "pending": len(ready) - i, "error": str(e), "quarantined": quarantined,
                    "waiting": waiting}
        uploaded.append(manifest["url"])
        shutil.rmtree(spool / name, ignore_errors=True)
    try:
        spool.rmdir()  # empty: nothing waits (an entry still being filled, or the quarantine, keeps it)
    except OSError:
        pass
    return {"uploaded": uploaded, "pending": 0, "error": None, "quarantined": quarantined, "waiting": waiting}


def ship_folder(payload: Path, url: str, replace_folders: bool, destination: str | None = None) -> dict:
    """Enqueue a filled payload and drain its spool for `destination` (default `url`): this entry
    and every older one for it."""
    enqueue(payload, url, replace_folders)
    return drain(payload.parent.parent, destination or url)


def ship_file(path: Path, url: str, spool: Path, destination: str | None = None) -> dict:
    """Ship one file to `url` (the object's full URL) through the spool."""
    check_url(url)
    payload = new_entry(spool, path.name)
    base, _, name = url.rstrip("/").rpartition("/")
    if not KEY_PART.fullmatch(name):
        raise UserError(f"cannot ship {path.name!r}: name it with letters, digits and ._-")
    target = payload / name
    try:
        os.link(path, target, follow_symlinks=False)  # same file system: no copy
    except OSError:
        shutil.copy2(path, target, follow_symlinks=False)
    return ship_folder(payload, base, replace_folders=False, destination=destination or base)


def _upload_with_retries(payload: Path, url: str, replace_folders: bool, sleep) -> None:
    last = None
    for attempt in range(ATTEMPTS):
        try:
            _upload(payload, url, replace_folders)
            return
        except BadEntry:
            raise
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

    files = payload_files(payload)  # BadEntry before any request
    s3, base = filesystem(url)
    s3.get_file_info(base)  # one request first: a store that is down fails here, not in 80 at once

    def put(item: tuple[str, Path]) -> None:
        key, path = item
        fd = os.open(path, os.O_RDONLY | NO_FOLLOW)  # a file swapped for a link since the walk is refused
        with os.fdopen(fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                raise BadEntry(f"its payload holds something that is not a file: {key}")
            with s3.open_output_stream(f"{base}/{key}") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)

    # an export is ~80 small objects: requests in parallel (pyarrow releases the GIL while waiting)
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        if replace_folders:  # only folders under the destination that receive files
            folders = sorted({key.rpartition("/")[0] for key, _ in files} - {""})
            list(pool.map(lambda d: s3.delete_dir_contents(f"{base}/{d}", missing_dir_ok=True), folders))
        list(pool.map(put, files))


# -- reading back ---------------------------------------------------------------------------------
# The layout `recorder export --parquet` writes: TABLE/node=HOST/session=ID/part-N.parquet (HOST
# percent-quoted). Only keys of that shape are read back; anything else in the bucket is skipped.
EXPORT_KEY = re.compile(r"(?P<table>[a-z][a-z0-9_]{0,62})/node=(?P<node>[A-Za-z0-9._~%-]{1,768})"
                        r"/session=(?P<session>[0-9]{1,19})/part-[0-9]{1,6}\.parquet")


def export_key(key: str) -> tuple[str, ...] | None:
    """The folder and file names of an export's object key (relative to the export's URL), or None
    when it is not the layout the project writes (a `..`, another shape, another table)."""
    m = EXPORT_KEY.fullmatch(key)
    if not m or m["node"] in ("node=.", "node=..") or m["node"] in (".", ".."):
        return None
    return tuple(key.split("/"))


def _check_caps(url: str, objects: int, size: int, limits: ExportLimits) -> None:
    if objects > limits.max_objects:
        raise UserError(f"{shown(url)} holds more than {limits.max_objects} export files: nothing of it was used; "
                        "name a smaller prefix, or raise --max-export-objects if the export is trusted")
    if size > limits.max_bytes:
        raise UserError(f"{shown(url)} holds more than {limits.max_bytes} bytes of export files: nothing of it was "
                        "used; name a smaller prefix, or raise --max-export-size if the export is trusted")


def download_export(url: str, dest: Path, tables: tuple[str, ...],
                    limits: ExportLimits = DEFAULT_LIMITS) -> list[str]:
    """Copy the given tables of the Parquet export at `url` into `dest` (its layout kept), at most
    limits.max_objects files and limits.max_bytes bytes. Keys not in the export's layout are
    skipped, never written: returns a line for each one skipped."""
    from pyarrow import fs

    s3, base = filesystem(url)
    root = dest.resolve()
    skipped: list[str] = []
    found = in_listing = 0
    total = 0
    try:
        for table in tables:
            infos = s3.get_file_info(fs.FileSelector(f"{base}/{table}", recursive=True, allow_not_found=True))
            in_listing += sum(1 for i in infos if i.type == fs.FileType.File)
            _check_caps(url, in_listing, 0, limits)  # a listing of millions is refused before any download
            for info in infos:
                if info.type != fs.FileType.File:
                    continue
                rel = info.path[len(base) + 1:] if info.path.startswith(base + "/") else info.path
                parts = export_key(rel)
                if parts is None or parts[0] != table:
                    if info.path.endswith(".parquet") or ".." in rel:
                        skipped.append(rel)
                    continue
                local = root.joinpath(*parts)
                if local.resolve().parent != root.joinpath(*parts[:-1]) or not local.is_relative_to(root):
                    skipped.append(rel)
                    continue
                found += 1
                total += info.size or 0
                _check_caps(url, found, total, limits)
                for i in range(1, len(parts)):  # each folder made here, private, never through a link
                    folder = root.joinpath(*parts[:i])
                    if not os.path.lexists(folder):
                        os.mkdir(folder, 0o700)
                    elif not stat.S_ISDIR(os.lstat(folder).st_mode):
                        raise UserError(f"{folder} is not a folder: the download folder was changed meanwhile")
                fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o600)
                listed, got = info.size or 0, 0
                with s3.open_input_stream(info.path) as src, os.fdopen(fd, "wb") as dst:
                    while chunk := src.read(1 << 20):  # the bytes that come count, not the size listed
                        got += len(chunk)
                        _check_caps(url, found, total - listed + got, limits)
                        dst.write(chunk)
                total += got - listed
    except OSError as e:
        raise UserError(f"cannot read {shown(url)}: {' '.join(str(e).split())[:300]} (check AWS_ENDPOINT_URL and "
                        "the credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
    if not (dest / "session").is_dir() or not (dest / "nccl_call").is_dir():
        raise UserError(f"{shown(url)} holds no Parquet export ({found} files read): pass the URL given to "
                        "'recorder export --parquet'")
    return [f"skipped {len(skipped)} object(s) of {shown(url)} that are not in the layout 'recorder export "
            f"--parquet' writes (TABLE/node=HOST/session=ID/part-N.parquet), e.g. {shown(skipped[0])[:160]!r}: "
            "not read"] if skipped else []
