"""The cache folder both caches share: where it is, who may use it, atomic writes, the MAC key,
and pruning. It imports neither numpy nor the snapshot model, so that a cached ``memlens triage``
(``memlens.report_cache``) reads its answer without them.

Three kinds of entry live in it, each named ``<kind><format version>-<64 hex digits>.<ext>``:

* ``v`` (``.columns``): a loaded snapshot's columns (``memlens.snapshot.cache``), signed as a
  whole: the file's last ``SIGNATURE_BYTES`` are the HMAC of all before them (``read_signed_file``),
  so that it can be read and checked in two GIL-free calls on the thread that hashes the snapshot
  (``hash_opened(..., read_ahead=True)``) while the command imports;
* ``r`` (``.json``): a triage report (``memlens.report_cache``);
* ``d`` (``.digest``): a snapshot file's SHA-256, named by the file's identity (device, inode,
  size, modification and change times), signed the same way, so that asking again about an
  unchanged file reads no byte of it (``remembered_digest``; git's index does the same).

The rules (see ``memlens.snapshot.cache`` for why each holds): one folder, ``$MEMLENS_CACHE_DIR``,
else ``$XDG_CACHE_HOME/memlens``, else ``~/.cache/memlens``, created 0700 and used only when it is
owned by this user and no one else may write to it; every file opened relative to the folder's
descriptor, following no link and never blocking; entries written to a temporary file and renamed
into place; a random per-user MAC key (``key``, 0600); after each write, temporaries of dead
writers and entries of older formats go, then the least recently used until the total is under
``$MEMLENS_CACHE_MAX_BYTES`` (default 2 GiB; 0 turns caching off).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from memlens.errors import MemlensUsageError
from memlens.files import OpenedFile, process_alive, trusted_file, trusted_folder
from memlens.units import parse_bytes


class QuietLog:
    """``logging.getLogger(name)``'s ``debug``, with ``logging`` imported at the first message: a
    cached ``memlens triage`` logs nothing and would spend 8 ms of its 0.2 s importing it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def debug(self, message: str, *args: object) -> None:
        import logging

        logging.getLogger(self.name).debug(message, *args)


log = QuietLog("memlens.snapshot.cache")

T = TypeVar("T")

CACHE_DIR_ENV = "MEMLENS_CACHE_DIR"
CACHE_MAX_BYTES_ENV = "MEMLENS_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
# Files this big or bigger are cached unless told otherwise: below it a parse and an analysis
# take well under a second, not worth a file on disk.
CACHE_MIN_BYTES = 8 << 20
# The hash reads 16 MiB at a time: each read and each digest update lets the GIL go, and the
# thread then waits up to a switch interval (5 ms) to get it back from a busy main thread; at
# 1 MiB a chunk, a 70 MB file hashed beside imports took twice as long as alone.
HASH_CHUNK = 16 << 20
# How often a wait for the hash looks at the work it races (``BackgroundHash.done_before``).
HASH_POLL_S = 0.002
FINGERPRINT_BYTES = 64 << 10
KEY_NAME = "key"
KEY_BYTES = 32
TEMP_PREFIX = ".tmp-"
# A temporary file of a live writer is seconds old; one this old was left by a killed process.
STALE_TEMP_SECONDS = 3600

# Each kind's current format version; an entry of an older one is pruned. Snapshot copies:
# 3: allocated as memory_allocated counts it, pending frees apart; 4: strings cut at 4 KiB;
# 5: allocated in block bytes (the block_size column), no longer requested bytes; 6: the
# segments' blocks as columns; 7: one signed file of aligned columns, no longer an .npz with a MAC
# member. Reports: 1: the first. Digests: 1: the first.
ENTRY_VERSIONS = {"v": 7, "r": 1, "d": 1}
ENTRY_SUFFIXES = {"v": "columns", "r": "json", "d": "digest"}
ENTRY_RE = re.compile(r"^([vrd])(\d+)-([0-9a-f]{64})\.(?:columns|npz|json|digest)$")
_TEMP_RE = re.compile(r"^\.tmp-(\d+)-[0-9a-f]+\.(?:columns|npz|json|digest|key)$")
# A file's digest is remembered only once its last change is this much older than the hash that
# read it (git's "racily clean" rule): a write within the same tick of a coarse file system clock
# (FAT's is 2 s) could otherwise leave the times the digest was remembered under unchanged.
RACY_MARGIN_NS = 3_000_000_000
# A signed entry ends with the HMAC-SHA256 of everything before it (``read_signed_file``).
SIGNATURE_BYTES = 32
_LEGACY_ENTRY_RE = re.compile(r"\.[0-9a-f]{16}\.memlens-cache\.npz$")  # snapshot format 1 names

OPEN_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# Reading: also without blocking, since opening a FIFO planted as the key or an entry would wait
# for a writer for ever; what is opened is then refused unless it is a regular file.
OPEN_TO_READ = os.O_RDONLY | OPEN_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
# The checks below need POSIX owners and descriptor-relative opens; elsewhere nothing is cached.
SUPPORTED = os.name == "posix" and bool(OPEN_NOFOLLOW) and os.open in os.supports_dir_fd


def entry_name(kind: str, digest: str) -> str:
    """The file name of an entry of ``kind`` (``v`` or ``r``) named by ``digest`` (64 hex digits)."""
    return f"{kind}{ENTRY_VERSIONS[kind]}-{digest}.{ENTRY_SUFFIXES[kind]}"


def cache_dir() -> Path:
    """The one folder entries live in (it may not exist yet)."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "memlens"



def file_identity(st: os.stat_result) -> tuple[int, ...]:
    # ctime changes on every write and rename and cannot be set by utime: with the inode it
    # tells whether the file is still the one that was hashed.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fingerprint_fd(fd: int, size: int) -> str:
    digest = hashlib.sha256(f"{size}|".encode())
    digest.update(os.pread(fd, FINGERPRINT_BYTES, 0))
    if size > FINGERPRINT_BYTES:
        digest.update(os.pread(fd, FINGERPRINT_BYTES, max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES)))
    return digest.hexdigest()


def hash_file(source: str) -> tuple[str, tuple[int, ...]]:
    with open(source, "rb", buffering=0) as handle:
        return hash_fd(handle.fileno())


def hash_fd(fd: int) -> tuple[str, tuple[int, ...]]:
    """The SHA-256 of the file open as ``fd`` (read with ``pread``: its position is untouched)."""
    identity = file_identity(os.fstat(fd))
    digest = hashlib.sha256()
    chunk = bytearray(HASH_CHUNK)
    view = memoryview(chunk)
    offset = 0
    while count := os.preadv(fd, [chunk], offset):
        digest.update(view[:count])
        offset += count
    return digest.hexdigest(), identity


class EntryRefused(ValueError):
    """A signed entry that must not be used (the reason says why)."""


def signer(key: bytes, kind: str) -> hmac.HMAC:
    """The HMAC that signs an entry of ``kind``: keyed with this user's key, and started with the
    kind and its format version, so that no entry passes for one of another kind or format."""
    return hmac.new(key, f"memlens {kind}{ENTRY_VERSIONS[kind]}\0".encode(), hashlib.sha256)


def read_signed_file(fd: int, key: bytes, kind: str) -> bytearray:
    """The whole of the entry open as ``fd`` but its signature, once the signature is found to be
    this key's (``EntryRefused`` otherwise). One read and one HMAC update, each without the GIL,
    so it runs well beside a busy main thread (``EntryAhead``). An entry over the folder's size
    limit is refused unread: the pruning after every write keeps none that big. An entry that
    passes is marked used (its modification time): the least recently used are pruned first."""
    st = os.fstat(fd)
    if not trusted_file(st):
        raise EntryRefused("not a regular file owned by this user and private to it")
    size = st.st_size
    if size < SIGNATURE_BYTES:
        raise EntryRefused("shorter than its signature")
    if size > size_limit():
        raise EntryRefused(f"{size:,} bytes, over the cache's size limit")
    data = bytearray(size)
    view = memoryview(data)
    filled = 0
    while filled < size:
        count = os.preadv(fd, [view[filled:]], filled)
        if not count:
            raise EntryRefused("truncated while it was read")
        filled += count
    body = view[: size - SIGNATURE_BYTES]
    mac = signer(key, kind)
    mac.update(body)
    good = hmac.compare_digest(view[size - SIGNATURE_BYTES:], mac.digest())
    body.release()
    view.release()
    if not good:
        raise EntryRefused("MAC mismatch (not written by this user's memlens, or edited since)")
    del data[size - SIGNATURE_BYTES:]
    with contextlib.suppress(OSError):
        os.utime(fd)
    return data


def size_limit() -> int:
    """The folder's size limit: ``$MEMLENS_CACHE_MAX_BYTES``, else 2 GiB (0: nothing is cached)."""
    text = os.environ.get(CACHE_MAX_BYTES_ENV)
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return parse_bytes(text)
    except MemlensUsageError:
        log.debug("memlens cache: ignoring %s=%r", CACHE_MAX_BYTES_ENV, text)
        return DEFAULT_MAX_BYTES


def caches(size: int, asked: bool | None = None) -> bool:
    """Whether a file of ``size`` bytes is read from and written to the cache: as ``asked``, else
    when it is ``CACHE_MIN_BYTES`` or more (the loader's rule; the faces that hash a file before
    loading it follow it too, so that they hash exactly the files the loader will look up)."""
    return asked if asked is not None else size >= CACHE_MIN_BYTES


class BackgroundHash:
    """``hash_fd`` of an open file on a thread of its own (hashlib releases the GIL), so that the
    caller reads an entry or imports meanwhile. ``result()`` waits for it: ``(digest, identity)``,
    or ``None`` when the file could not be hashed (then no cache is used). The descriptor must stay
    open until ``result()`` has returned.

    ``known``: the file's digest as remembered for its identity (``remembered_digest``): then
    nothing is hashed (a cached triage of a 4M-entry file spent 0.2 s on it), ``known`` is true,
    and the thread only runs ``then``. A digest computed here is remembered for the next run."""

    def __init__(self, fd: int, source: str, then: EntryAhead | None = None,
                 known: tuple[str, tuple[int, ...]] | None = None) -> None:
        self._fd = fd
        self._source = source
        self._then = then
        self.known = known is not None
        self._result: list[tuple[str, tuple[int, ...]] | None] = [known] if known is not None else []
        self._thread: threading.Thread | None = None
        if known is None or then is not None:
            self._thread = threading.Thread(target=self._run, name="memlens-cache-hash", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        hashed = self._result[0] if self.known else None
        try:
            if not self.known:
                started_ns = time.time_ns()
                hashed = hash_fd(self._fd)
                remember_digest(self._fd, hashed, started_ns)
        except Exception as error:  # the thread must always leave an answer (None: no cache)
            log.debug("memlens cache: cannot hash %s: %s", self._source, error)
        finally:
            if not self.known:
                self._result.append(hashed)
            if self._then is not None:
                self._then.run(read=hashed is not None)  # never raises; without a hash no entry is used

    def done_before(self, other_done: Callable[[], bool]) -> bool:
        """Wait for the hash unless ``other_done()`` turns true first; whether the hash is done."""
        while self._thread is not None and self._thread.is_alive():
            if other_done():
                return False
            self._thread.join(HASH_POLL_S)
        return True

    def result(self) -> tuple[str, tuple[int, ...]] | None:
        if self._thread is not None:
            self._thread.join()
        return self._result[0] if self._result else None


def _digest_entry(identity: tuple[int, ...]) -> tuple[str, bytes]:
    """The digest entry's name for a file of ``identity``, and the identity as the entry says it."""
    text = ",".join(str(number) for number in identity).encode()
    return entry_name("d", hashlib.sha256(b"memlens digest\0" + text).hexdigest()), text


def remembered_digest(fd: int) -> tuple[str, tuple[int, ...]] | None:
    """``(digest, identity)`` of the file open as ``fd`` without reading it: the SHA-256 a hash of
    this very file (device, inode, size, modification and change times: ``file_identity``) left in
    the cache folder, signed with this user's key; ``None`` when there is none or it fails a check.
    A write to the file changes its change time, which no ``utime`` can set back, so a file
    changed since is another identity and is hashed again."""
    try:
        identity = file_identity(os.fstat(fd))
    except OSError:
        return None
    name, identity_text = _digest_entry(identity)

    def read(folder: CacheFolder, key: bytes) -> str:
        entry = os.open(name, OPEN_TO_READ, dir_fd=folder.fd)
        try:
            body = bytes(read_signed_file(entry, key, "d"))
        finally:
            os.close(entry)
        stored_identity, _, digest = body.partition(b" ")
        if stored_identity != identity_text or not re.fullmatch(rb"[0-9a-f]{64}", digest):
            raise EntryRefused("not this file's digest")
        return digest.decode()

    digest = read_signed(name, read, "a digest entry")
    return (digest, identity) if digest is not None else None


def remember_digest(fd: int, hashed: tuple[str, tuple[int, ...]], started_ns: int) -> None:
    """Keep ``hashed`` (``hash_fd``'s answer, begun at ``started_ns``) for ``remembered_digest``,
    if the file is still what was hashed and its last change is well before the hash began
    (``RACY_MARGIN_NS``); a file written moments ago is hashed again next time instead."""
    digest, identity = hashed
    try:
        if file_identity(os.fstat(fd)) != identity:
            return
    except OSError:
        return
    modified_ns, changed_ns = identity[3], identity[4]
    if max(modified_ns, changed_ns) > started_ns - RACY_MARGIN_NS:
        return
    name, identity_text = _digest_entry(identity)
    body = identity_text + b" " + digest.encode()

    def signed(key: bytes) -> Callable[[IO[bytes]], int]:
        mac = signer(key, "d")
        mac.update(body)
        signature = mac.digest()
        return lambda handle: handle.write(body + signature)

    write_signed(name, signed, suffix="digest")


class EntryAhead:
    """The snapshot entry (kind ``v``) of a file, read and its signature checked on the thread
    that hashes the file, once it has: both are done by the time the command has imported what it
    needs, instead of after. The entry is opened here, on the calling thread (a few system calls,
    each of which would otherwise wait for the GIL on a busy main thread)."""

    def __init__(self, folder: Path, name: str, key: bytes, fd: int) -> None:
        self.folder = folder
        self.name = name
        self.key = key
        self._fd = fd
        self.data: bytearray | None = None
        self.error: Exception | None = None

    @classmethod
    def open(cls, opened: OpenedFile) -> EntryAhead | None:
        """The entry ``opened``'s bytes would be cached under, opened; ``None`` when there is none
        (or no usable folder or key): then nothing is read ahead."""
        with keyed_folder() as keyed:
            if keyed is None:
                return None
            folder, key = keyed
            name = entry_name("v", fingerprint_fd(opened.fd, opened.size))
            try:
                fd = os.open(name, OPEN_TO_READ, dir_fd=folder.fd)
            except OSError:  # none yet (the first open), or not something to read
                return None
            return cls(folder.path, name, key, fd)

    def run(self, read: bool = True) -> None:
        try:
            if read:
                self.data = read_signed_file(self._fd, self.key, "v")
        except Exception as error:  # kept for the reader, which would have met it reading the entry
            self.error = error
        finally:
            os.close(self._fd)

    def matches(self, folder: Path, name: str, key: bytes) -> bool:
        """Whether this is the entry the reader is about to read: same folder, name and key."""
        return self.folder == folder and self.name == name and hmac.compare_digest(self.key, key)


# The hash running for each opened file, so the report slot and the snapshot entry of one triage
# hash the file once between them (weak keys: it goes with the file object); and the snapshot
# entry read on the same thread, where one was asked for.
_HASHES: weakref.WeakKeyDictionary[OpenedFile, BackgroundHash] = weakref.WeakKeyDictionary()
_AHEAD: weakref.WeakKeyDictionary[OpenedFile, EntryAhead] = weakref.WeakKeyDictionary()


def hash_opened(opened: OpenedFile, read_ahead: bool = False) -> BackgroundHash:
    """The background hash of ``opened`` (through its own descriptor), started on first ask and
    shared with later askers (``hash_started``). Whoever starts it waits for ``result()`` before
    the file is closed. ``read_ahead``: the same thread then reads the file's snapshot entry, if
    there is one (``EntryAhead``; the snapshot cache takes it with ``entry_read_ahead``)."""
    hashed = _HASHES.get(opened)
    if hashed is None:
        ahead = EntryAhead.open(opened) if read_ahead else None
        if ahead is not None:
            _AHEAD[opened] = ahead
        known = remembered_digest(opened.fd)
        hashed = _HASHES[opened] = BackgroundHash(opened.fd, opened.name, then=ahead, known=known)
    return hashed


def entry_read_ahead(opened: OpenedFile) -> EntryAhead | None:
    """The snapshot entry being read ahead for ``opened`` (see ``hash_opened``), handed over once:
    whoever takes it waits for the hash's ``result()`` before using it."""
    return _AHEAD.pop(opened, None)


def hash_started(opened: OpenedFile) -> BackgroundHash | None:
    """The hash of ``opened`` already running (``hash_opened``), if any."""
    return _HASHES.get(opened)


@contextlib.contextmanager
def keyed_folder() -> Iterator[tuple[CacheFolder, bytes] | None]:
    """The cache folder, opened, and this user's key, for reading (neither is created); ``None``
    when either is missing or unusable."""
    folder = CacheFolder.open(create=False)
    if folder is None:
        yield None
        return
    with folder:
        key = folder.key(create=False)
        yield None if key is None else (folder, key)


def read_signed(name: str, read: Callable[[CacheFolder, bytes], T], source: str) -> T | None:
    """``read(folder, key)`` of the entry ``name`` in the cache folder, with this user's key;
    ``None`` when there is no folder, key or entry, or when ``read`` fails in any way (logged):
    a cache that cannot be read costs speed only, never a crash or an answer."""
    with keyed_folder() as keyed:
        if keyed is None:
            return None
        folder, key = keyed
        try:
            return read(folder, key)
        except FileNotFoundError:
            return None
        except Exception as error:  # any failure at all means "compute it again", never a crash
            log.debug("memlens cache: ignoring %s for %s: %s: %s", name, source, type(error).__name__, error)
            return None


def write_signed(name: str, fill: Callable[[bytes], Callable[[IO[bytes]], object]], suffix: str) -> Path | None:
    """Write the entry ``name`` atomically, ``fill(key)`` giving what writes it with this user's
    key, then prune the folder; the entry's path, or ``None`` when nothing was written (caching
    off, no folder or key, or a failed write)."""
    limit = size_limit()
    if limit <= 0:
        return None
    folder = CacheFolder.open(create=True)
    if folder is None:
        return None
    with folder:
        key = folder.key(create=True)
        if key is None:
            return None
        if not folder.write_atomically(name, fill(key), suffix=suffix):
            return None
        folder.prune(limit, keep=name)
        return folder.path / name


def _write_new_key(handle: IO[bytes]) -> None:
    import secrets  # only when a key is made: a cached read does without it

    handle.write(secrets.token_bytes(KEY_BYTES))


class CacheFolder:
    """The cache folder, opened once and checked through its descriptor.

    Every file inside is opened relative to that descriptor, so swapping the folder for another
    after the check changes nothing.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, create: bool) -> CacheFolder | None:
        if not SUPPORTED:
            return None
        try:
            path = cache_dir()
        except (RuntimeError, KeyError):  # no home directory to put it in
            return None
        if create:
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as error:
                log.debug("memlens cache: cannot create %s: %s", path, error)
                return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        if not trusted_folder(st):
            log.debug("memlens cache: %s is not a folder owned by this user and private to it; not used", path)
            os.close(fd)
            return None
        return cls(path, fd)

    def __enter__(self) -> CacheFolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.fd)

    def _temp_name(self, suffix: str) -> str:
        import secrets  # only when writing: a cached read does without it

        return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}.{suffix}"

    def write_atomically(self, name: str, fill: Any, suffix: str = "columns", replace: bool = True) -> bool:
        """Write via a private temporary file renamed into place; no temporary survives a failure.

        With ``replace=False`` an existing file wins (the temporary is linked, not renamed).
        """
        temp = self._temp_name(suffix)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_NOFOLLOW, 0o600, dir_fd=self.fd)
            with os.fdopen(fd, "wb") as handle:
                fill(handle)
            if replace:
                os.replace(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            else:
                try:
                    os.link(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                except FileExistsError:
                    return False
                except OSError:  # a file system without hard links: the last writer wins
                    os.replace(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            return True
        except OSError as error:
            log.debug("memlens cache: cannot write %s in %s: %s", name, self.path, error)
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self.fd)

    def key(self, create: bool) -> bytes | None:
        """This user's MAC key; with ``create``, made (or replaced, if unusable) when needed."""
        for _ in range(3):  # another process may be creating it at the same moment
            try:
                fd = os.open(KEY_NAME, OPEN_TO_READ, dir_fd=self.fd)
            except FileNotFoundError:
                if not create:
                    return None
                self.write_atomically(KEY_NAME, _write_new_key, "key",
                                      replace=False)
                continue
            except OSError:  # a symlink or worse where the key should be
                fd = -1
            if fd >= 0:
                with os.fdopen(fd, "rb") as handle:
                    trusted = trusted_file(os.fstat(handle.fileno()), forbidden_bits=0o077)
                    key = handle.read(KEY_BYTES + 1) if trusted else b""  # never read what is not a file
                if trusted and len(key) == KEY_BYTES:
                    return key
            if not create:
                return None
            log.debug("memlens cache: replacing an unusable key in %s", self.path)
            self.write_atomically(KEY_NAME, _write_new_key, "key")
        return None

    def prune(self, max_bytes: int, keep: str | None) -> None:
        """Drop stale temporaries and old-format entries, then the least recently used entries
        until the total is at most ``max_bytes`` (``keep`` goes last)."""
        now = time.time()
        current: list[tuple[bool, float, int, str]] = []
        try:
            listing = list(os.scandir(self.fd))
        except OSError:
            return
        for item in listing:
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            name = item.name
            temp = _TEMP_RE.match(name)
            entry = ENTRY_RE.match(name)
            if temp:
                pid = int(temp.group(1))
                # Our own temporaries (another thread may be writing one) go by age only.
                stale = now - st.st_mtime > STALE_TEMP_SECONDS or not process_alive(pid)
                if stale:
                    self._remove(name)
            elif _LEGACY_ENTRY_RE.search(name) or (entry and int(entry.group(2)) < ENTRY_VERSIONS[entry.group(1)]):
                self._remove(name)
            elif entry:
                # Entries of a newer memlens sharing the folder count towards the limit too.
                current.append((name == keep, st.st_mtime, st.st_size, name))
        total = sum(size for _, _, size, _ in current)
        for _, _, size, name in sorted(current):  # not-kept first, oldest first
            if total <= max_bytes:
                break
            self._remove(name)
            total -= size

    def _remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self.fd)
