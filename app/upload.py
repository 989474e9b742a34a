"""``POST /upload``: stream a snapshot to a temporary file, then load and analyse it.

The body is the raw file (no base64, no multipart), read from ``request.stream`` in 1 MiB
chunks and written straight to disk, so a 2 GiB snapshot never sits in memory as text. A
declared ``Content-Length`` over the limit is refused with 413 before any of the body is read;
a body that grows past it (chunked uploads) is refused when it does. A body that stops short
(the client went away), stalls longer than ``idle_timeout_s`` between reads, or is still
arriving at its deadline (``idle_timeout_s`` plus its size at ``MIN_UPLOAD_RATE``) is dropped
with its partial file. The answer is JSON: ``{"id", "name", ...}`` on success, ``{"error"}``
with status 400 (not a snapshot, hostile pickle, a limit of the analysis), 408, 413, 429 (the
client's network address already has its share of uploads or analyses in progress, whatever
session cookie it sends or drops), 500, 503 (busy: the session already has its share of uploads
or analyses in progress, the server has as many uploads as it takes at once, or no worker came
free in time; try again) or 507 (a declared size that the server's disk has no room for).

An uploaded sidecar is never parsed here: it is read in an analysis worker, under the analyses'
limits (``Library.check_sidecars``), and one waiting for its snapshot counts in the upload budget.

The upload belongs to the browser session that sent it (``memlens_app.session``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import threading
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import ClientDisconnected

from memlens.errors import MemlensError, one_line
from memlens.sidecar import SIDECAR_MAX_BYTES, SIDECAR_SUFFIX
from memlens.units import GiB, KiB, format_bytes
from memlens_app.archive import ArchiveEntry, ArchiveRefused, open_archive, run_folder_entries, unpack
from memlens_app.library import Library, Source
from memlens_app.scheduler import AddressBusy, ServerBusy
from memlens_app.session import current_address, current_session
from memlens_app.sidecars import is_sidecar_name
from memlens_app.worker import AnalysisCrashed

CHUNK_BYTES = 1 << 20
DEFAULT_IDLE_TIMEOUT_S = 60.0
# The slowest upload accepted end to end: 2 GiB at 256 KiB/s is a little over two hours.
MIN_UPLOAD_RATE = 256 * KiB
# Disk left free for the rest of the machine when an upload declares its size.
DISK_MARGIN_BYTES = 1 * GiB
ZIP_SUFFIX = ".zip"
MAX_FOLDER_PARTS = 8
MAX_FOLDER_CHARS = 200
log = logging.getLogger("memlens.app")


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def deadline_s(self, size: int) -> float:
        """Seconds a body of ``size`` bytes may take to arrive in full."""
        return self.idle_timeout_s + size / MIN_UPLOAD_RATE


class _UploadFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def safe_name(name: str) -> str:
    """A file name that cannot climb out of its folder or confuse a shell: letters, digits, ._-."""
    base = os.path.basename(name.replace("\\", "/")).strip() or "snapshot.pickle"
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", base).lstrip(".")
    return cleaned[:120] or "snapshot.pickle"


# A ticket the page names its upload by, to follow its analysis (``GET /upload/progress``).
TICKET_PATTERN = re.compile(r"[A-Za-z0-9_-]{8,64}")


def register_upload_route(server: Flask, library: Library, limits: UploadLimits) -> None:
    # The uploads being analysed, by (session, the page's ticket): what /upload/progress reads.
    following: dict[tuple[str, str], str] = {}
    following_lock = threading.Lock()

    @server.before_request
    def _heard_from_session() -> None:
        library.session_seen(current_session())  # its waiting sidecars wait on

    @server.route("/upload", methods=["POST"])
    def upload() -> Any:
        name = safe_name(request.args.get("name", "") or request.headers.get("X-File-Name", ""))
        given_folder = request.args.get("folder", "")
        folder = _Folder(safe_folder(given_folder), origin_folder(given_folder))
        declared = request.content_length
        sidecar = is_sidecar_name(name)
        if sidecar and not name.endswith(SIDECAR_SUFFIX):
            return _error(400, _not_a_sidecar_name(name), close=True)
        if sidecar and declared is not None and declared > SIDECAR_MAX_BYTES:
            return _error(413, _sidecar_too_large(name, declared), close=True)
        if declared is not None and declared > limits.max_bytes:
            return _error(413, _too_large_message(name, limits.max_bytes), close=True)
        session = current_session()
        try:
            with library.upload_turn(session, current_address()):
                if sidecar:
                    return _store_sidecar(name, folder, declared, session)
                if name.lower().endswith(ZIP_SUFFIX):
                    return _store_archive(name, declared, session)
                return _store_and_analyse(name, folder, declared, session)
        except ServerBusy as exc:
            return _error(_busy_status(exc), f"{name}: {exc}", close=True)

    @server.route("/upload/progress", methods=["GET"])
    def upload_progress() -> Any:
        """How far the analysis of this session's upload ``ticket`` has got (the page's row shows
        the stages once the bytes are sent): 404 when it is not being analysed (not yet, or over)."""
        session = current_session()
        with following_lock:
            source_id = following.get((session, request.args.get("ticket", "")))
        state = None
        if source_id is not None:
            with contextlib.suppress(MemlensError):
                state = library.progress(source_id, session)
        if state is None:
            return _error(404, "no analysis of this upload is in progress")
        return jsonify(state.as_json())

    @server.route("/upload/queue", methods=["GET"])
    def queue_state() -> Any:
        """This session's own jobs at the workers, and how many wait in all (no one else's ids)."""
        state = library.queue_state(current_session())
        return jsonify(running=state.running, waiting=state.waiting, waiting_in_all=state.waiting_in_all)

    def _receive(name: str, declared: int | None, spool_limits: UploadLimits) -> tuple[str, str, int] | Response:
        """Spool the body to a fresh upload file: (id, path, bytes), or the error to answer."""
        try:
            source_id, path = library.new_upload_file(name)
        except MemlensError as exc:
            return _error(503, str(exc), close=True)
        if declared is not None and not _room_for(path, declared):
            return _error(507, f"{name}: not enough free disk space on the server for "
                               f"{format_bytes(declared)}", close=True)
        try:
            written = _spool(request.stream, path, name, declared, spool_limits)
        except _UploadFailed as exc:
            _remove(path)
            return _error(exc.status, str(exc), close=True)
        except OSError as exc:
            _remove(path)
            log.exception("storing the upload of %s failed", name)
            return _error(500, f"{name}: could not store the upload ({exc.strerror or exc})", close=True)
        except BaseException:
            _remove(path)  # never leave a partial file, whatever stopped us
            raise
        if written == 0:
            _remove(path)
            return _error(400, f"{name}: the upload was empty")
        return source_id, path, written

    def _store_and_analyse(name: str, folder: _Folder, declared: int | None, session: str) -> Any:
        received = _receive(name, declared, limits)
        if isinstance(received, Response):
            return received
        source_id, path, written = received
        try:
            library.add_upload(source_id, name, path, written, owner=session, folder=folder.label,
                               origin_folder=folder.origin)
        except MemlensError as exc:
            return _error(503, str(exc))
        ticket = request.args.get("ticket", "")
        key = (session, ticket) if TICKET_PATTERN.fullmatch(ticket) else None
        if key is not None:
            with following_lock:
                following[key] = source_id
        try:
            analysed = _analyse(source_id, name, path, session)
        finally:
            if key is not None:
                with following_lock:
                    following.pop(key, None)
        if isinstance(analysed, Response):
            return analysed
        return jsonify(**analysed, bytes=written)

    def _analyse(source_id: str, name: str, path: str, session: str) -> dict[str, Any] | Response:
        """The upload's analysis: what the page is told of it, or the error (it is forgotten).

        An analysis that fails with a paired sidecar is tried once more without it (a sidecar
        only adds to a snapshot): the answer then says why the sidecar was not used."""
        answer = _analysed(source_id, name, path, session)
        sidecar = library.sidecar_of(source_id)
        if isinstance(answer, Response) and answer.status_code != 503 and sidecar is not None:
            reason = answer.get_json()["error"].removeprefix(f"{name}: ")
            library.detach_sidecar(source_id)
            retried = _analysed(source_id, name, path, session)
            if isinstance(retried, Response):
                library.forget(source_id)
                return retried
            return {**retried, "note": one_line(f"analysed without {sidecar}, which could not be used: {reason}")}
        if isinstance(answer, Response):
            library.forget(source_id)
            return answer
        if sidecar:
            answer.update(sidecar=sidecar, note=f"analysed with {sidecar}")
        return answer

    def _analysed(source_id: str, name: str, path: str, session: str) -> dict[str, Any] | Response:
        try:
            report = library.analysis(source_id, session, showing=False).report
        except ServerBusy as exc:
            return _error(_busy_status(exc), f"{name}: {exc}")
        except MemlensError as exc:
            return _error(400, str(exc).replace(path, name))
        except Exception as exc:  # a bug, not the user's file: keep serving, log the traceback
            detail = f"\n{exc}" if isinstance(exc, AnalysisCrashed) else ""
            log.exception("analysing %s failed%s", name, detail)
            return _error(500, f"{name}: memlens failed to analyse this file (an internal error; "
                               "see the server log)")
        return {"id": source_id, "name": name, "events": sum(d.events for d in report.devices.values()),
                "findings": len(report.findings)}

    def _store_sidecar(name: str, folder: _Folder, declared: int | None, session: str) -> Any:
        """A sidecar: checked in a worker, then paired with this session's snapshot of it (whose
        analysis is redone with it) or kept until that snapshot comes; a sidecar that cannot be
        used is answered with why, in one line."""
        received = _receive(name, declared, UploadLimits(SIDECAR_MAX_BYTES, limits.idle_timeout_s))
        if isinstance(received, Response):
            if received.status_code == 413:
                return _error(413, _sidecar_too_large(name, None), close=True)
            return received
        _, path, _ = received
        try:
            (problem,) = library.check_sidecars([(path, name)], session)
            if problem is not None:
                _remove(path)
                return _error(400, one_line(problem))
            snapshot = library.add_sidecar(name, path, owner=session, folder=folder.label,
                                           origin_folder=folder.origin)
        except ServerBusy as exc:
            _remove(path)
            return _error(_busy_status(exc), f"{name}: {exc}")
        except MemlensError as exc:
            _remove(path)
            return _error(400, str(exc))
        except BaseException:
            _remove(path)
            raise
        if snapshot is None:
            return jsonify(name=name, sidecar=name,
                           note=f"kept: no snapshot for it yet (upload {_snapshot_of(name)} to pair them)")
        analysed = _analyse(snapshot.id, snapshot.name, snapshot.path, session)
        if isinstance(analysed, Response):
            return analysed
        if library.sidecar_of(snapshot.id) != name:  # the analysis failed with it: done again without
            return _error(400, one_line(f"{name}: {analysed['note']}"))
        return jsonify(**{**analysed, "note": f"paired with {snapshot.label}"})

    def _store_archive(name: str, declared: int | None, session: str) -> Any:
        """A .zip of a run folder: its snapshots and sidecars unpacked as uploads of this session
        (each sidecar paired with the snapshot of its folder), then each snapshot analysed."""
        received = _receive(name, declared, limits)
        if isinstance(received, Response):
            return received
        _, path, _ = received
        try:
            unpacked = _unpack_archive(name, path, session)
        finally:
            _remove(path)
        if isinstance(unpacked, Response):
            return unpacked
        files, snapshots = unpacked
        for source in snapshots:
            analysed = _analyse(source.id, source.label, source.path, session)
            if isinstance(analysed, Response):
                files.append({"name": source.label, "error": analysed.get_json()["error"]})
            else:
                files.append({**analysed, "name": source.label})
        loaded = [f for f in files if f.get("id")]
        if not loaded:
            reasons = "; ".join(f.get("error") or f.get("note", "") for f in files) or "no snapshot in it"
            return _error(400, one_line(f"{name}: nothing to open ({reasons})"))
        return jsonify(id=loaded[0]["id"], name=name, files=files,
                       note=f"{len(loaded)} snapshot{'s' if len(loaded) != 1 else ''} opened")

    def _unpack_archive(name: str, path: str, session: str) -> tuple[list[dict[str, Any]], list[Source]] | Response:
        files: list[dict[str, Any]] = []
        snapshots: list[Source] = []
        unregistered: list[str] = []  # unpacked files not yet the library's: removed if we stop
        try:
            with open_archive(path, name) as zipped:
                entries, skipped = run_folder_entries(zipped, name, limits.max_bytes)
                inflated = sum(e.info.file_size for e in entries)
                if not _room_for(path, inflated):
                    return _error(507, f"{name}: not enough free disk space on the server for "
                                       f"{format_bytes(inflated)}")
                files.extend({"name": s, "note": "skipped: not a snapshot or a sidecar"} for s in skipped)
                unpacked: list[_Unpacked] = []
                for entry in entries:
                    entry_name = safe_name(entry.name)
                    source_id, entry_path = library.new_upload_file(entry_name)
                    unregistered.append(entry_path)
                    unpacked.append(_Unpacked(entry, _Folder(safe_folder(f"{name}/{entry.folder}"),
                                                             f"{name}/{entry.folder}"),
                                              entry_name, source_id, entry_path, unpack(zipped, entry, entry_path)))
            # All the archive's sidecars read in one worker; then they are added before the
            # snapshots, so that each snapshot finds its own as it is added.
            sidecars = [u for u in unpacked if u.entry.kind == "sidecar"]
            problems = library.check_sidecars([(u.path, u.name) for u in sidecars], session)
            for sidecar, problem in zip(sidecars, problems, strict=True):
                unregistered.remove(sidecar.path)
                if problem is not None:
                    _remove(sidecar.path)
                    files.append({"name": sidecar.label, "error": one_line(problem)})
                    continue
                library.add_sidecar(sidecar.name, sidecar.path, owner=session, folder=sidecar.folder.label,
                                    origin_folder=sidecar.folder.origin)
                files.append({"name": sidecar.label, "sidecar": sidecar.name, "note": "sidecar"})
            for snapshot in (u for u in unpacked if u.entry.kind != "sidecar"):
                unregistered.remove(snapshot.path)
                snapshots.append(library.add_upload(snapshot.source_id, snapshot.name, snapshot.path,
                                                    snapshot.written, owner=session, folder=snapshot.folder.label,
                                                    origin_folder=snapshot.folder.origin))
        except ArchiveRefused as exc:
            _forget_all(snapshots)
            return _error(400, str(exc))
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError) as exc:
            _forget_all(snapshots)
            return _error(400, one_line(f"{name}: not a readable zip archive ({exc})"))
        except ServerBusy:
            _forget_all(snapshots)
            raise
        except MemlensError as exc:
            _forget_all(snapshots)
            return _error(503, str(exc))
        finally:
            for unpacked_path in unregistered:
                _remove(unpacked_path)
        return files, snapshots

    def _forget_all(sources: list[Source]) -> None:
        for source in sources:
            library.forget(source.id)


@dataclass(frozen=True)
class _Folder:
    """Where an upload came from: ``label``, cleaned, to show; ``origin``, as named, to pair by."""

    label: str
    origin: str


@dataclass(frozen=True)
class _Unpacked:
    """An archive entry written to its upload file, not yet handed to the library."""

    entry: ArchiveEntry
    folder: _Folder
    name: str
    source_id: str
    path: str
    written: int

    @property
    def label(self) -> str:
        return f"{self.folder.label}/{self.entry.name}"


def _spool(stream: IO[bytes], path: str, name: str, declared: int | None, limits: UploadLimits) -> int:
    """Copy the request body to ``path``; the number of bytes written, or ``_UploadFailed``."""
    written = 0
    with _read_deadline(limits, declared), open(path, "xb") as handle:
        while True:
            try:
                chunk = stream.read(CHUNK_BYTES)
            except ClientDisconnected:
                # werkzeug reports a socket timeout, a reset and a closed connection alike.
                raise _UploadFailed(408 if declared else 400,
                                    f"{name}: the upload stopped after {format_bytes(written)} of "
                                    f"{format_bytes(declared) if declared else 'the file'} "
                                    "(connection closed or too slow)") from None
            if not chunk:
                break
            written += len(chunk)
            if written > limits.max_bytes:
                raise _UploadFailed(413, _too_large_message(name, limits.max_bytes))
            handle.write(chunk)
    if declared is not None and written != declared:
        raise _UploadFailed(400, f"{name}: the upload ended after {format_bytes(written)} of "
                                 f"{format_bytes(declared)}")
    return written


@contextlib.contextmanager
def _read_deadline(limits: UploadLimits, declared: int | None) -> Iterator[None]:
    """Time out a stalled read, and cut the body off at its deadline however it trickles in.

    A per-read socket timeout alone lets a client send one byte every few seconds for ever, so
    a timer shuts the socket's reading side at the deadline: the blocked read then sees the end
    of the stream and the upload fails like a disconnect.
    """
    connection = request.environ.get("werkzeug.socket")
    if not isinstance(connection, socket.socket):  # not werkzeug's server (a test client)
        yield
        return
    connection.settimeout(limits.idle_timeout_s)
    timer = threading.Timer(limits.deadline_s(declared or limits.max_bytes), _shut_reading, (connection,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _room_for(path: str, size: int) -> bool:
    """Whether the upload folder's disk has ``size`` bytes free, plus a margin for everyone else."""
    try:
        free = shutil.disk_usage(os.path.dirname(path)).free
    except OSError:
        return True  # unknown: the write itself will fail cleanly if the disk fills
    return free >= size + DISK_MARGIN_BYTES


def _shut_reading(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RD)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _error(status: int, message: str, close: bool = False) -> Response:
    response = jsonify(error=message)
    response.status_code = status
    if close:  # the unread rest of the body must not be taken for the next request
        response.headers["Connection"] = "close"
    return response


def safe_folder(folder: str) -> str:
    """A dropped file's folder (or an archive entry's), for pairing and labels only (never a path):
    each part cleaned like a file name, at most ``MAX_FOLDER_PARTS`` parts."""
    parts = [re.sub(r"[^A-Za-z0-9._-]+", "_", p).strip("._") for p in folder.replace("\\", "/").split("/")]
    return "/".join([p for p in parts if p][-MAX_FOLDER_PARTS:])[-MAX_FOLDER_CHARS:]


def origin_folder(folder: str) -> str:
    """A dropped file's folder as the page named it, only made canonical (either slash, no empty
    or "." parts): what its sidecar pairs by, since two folders can clean to one label."""
    return "/".join(p for p in folder.replace("\\", "/").split("/") if p not in ("", "."))


def _busy_status(busy: ServerBusy) -> int:
    """429 for a network address over its share (whatever sessions it claims), else 503."""
    return 429 if isinstance(busy, AddressBusy) else 503


def _not_a_sidecar_name(name: str) -> str:
    return (f"{name}: not a memlens sidecar name (the recorder writes RUN{SIDECAR_SUFFIX} "
            "next to RUN.pickle)")


def _snapshot_of(sidecar: str) -> str:
    return sidecar.removesuffix(SIDECAR_SUFFIX) + ".pickle"


def _sidecar_too_large(name: str, size: int | None) -> str:
    told = f"{format_bytes(size)}, " if size is not None else ""
    return f"{name}: {told}larger than a sidecar may be ({format_bytes(SIDECAR_MAX_BYTES)}); not used"


def _too_large_message(name: str, limit: int) -> str:
    return (f"{name} is larger than this server's upload limit ({format_bytes(limit)}); "
            "open it from the command line (memlens serve FILE) or raise --max-upload")
