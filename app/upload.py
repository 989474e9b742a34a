"""``POST /upload``: stream a snapshot to a temporary file, then load and analyse it.

The body is the raw file (no base64, no multipart), read from ``request.stream`` in 1 MiB
chunks and written straight to disk, so a 2 GiB snapshot never sits in memory as text. Past
the size limit the request is refused with 413. The answer is JSON: ``{"id", "name"}`` on
success, ``{"error"}`` with status 400 (not a snapshot, hostile pickle), 413 or 500.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any

from flask import Flask, jsonify, request

from memlens.errors import MemlensError
from memlens.units import format_bytes
from memlens_app.library import Library

CHUNK_BYTES = 1 << 20
log = logging.getLogger("memlens.app")


def safe_name(name: str) -> str:
    """A file name that cannot climb out of its folder or confuse a shell: letters, digits, ._-."""
    base = os.path.basename(name.replace("\\", "/")).strip() or "snapshot.pickle"
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", base).lstrip(".")
    return cleaned[:120] or "snapshot.pickle"


def register_upload_route(server: Flask, library: Library, max_upload_bytes: int) -> None:
    @server.route("/upload", methods=["POST"])
    def upload() -> Any:
        name = safe_name(request.args.get("name", "") or request.headers.get("X-File-Name", ""))
        declared = request.content_length
        if declared is not None and declared > max_upload_bytes:
            return _too_large(name, max_upload_bytes)
        upload_dir = tempfile.mkdtemp(prefix="memlens-upload-")
        path = os.path.join(upload_dir, name)
        try:
            written = 0
            with open(path, "wb") as handle:
                while True:
                    chunk = request.stream.read(CHUNK_BYTES)
                    if not chunk:
                        break
                    written += len(chunk)
                    if written > max_upload_bytes:
                        shutil.rmtree(upload_dir, ignore_errors=True)
                        return _too_large(name, max_upload_bytes)
                    handle.write(chunk)
            if written == 0:
                shutil.rmtree(upload_dir, ignore_errors=True)
                return jsonify(error=f"{name}: the upload was empty"), 400
        except OSError as exc:
            shutil.rmtree(upload_dir, ignore_errors=True)
            log.exception("upload of %s failed", name)
            return jsonify(error=f"{name}: could not store the upload ({exc.strerror or exc})"), 500

        source = library.add_upload(f"u-{uuid.uuid4().hex[:16]}", name, path, upload_dir)
        try:
            report = library.report(source.id)
        except MemlensError as exc:
            library.forget(source.id)
            return jsonify(error=_user_message(exc, path, name)), 400
        except Exception:  # a bug, not the user's file: keep serving, log the traceback
            library.forget(source.id)
            log.exception("analysing %s failed", name)
            return jsonify(error=f"{name}: memlens failed to analyse this file (an internal error; "
                                 "see the server log)"), 500
        return jsonify(id=source.id, name=name, bytes=written,
                       events=sum(d.events for d in report.devices.values()),
                       findings=len(report.findings))


def _too_large(name: str, limit: int) -> Any:
    return jsonify(error=f"{name} is larger than this server's upload limit ({format_bytes(limit)}); "
                         "open it from the command line (memlens serve FILE) or raise --max-upload"), 413


def _user_message(exc: MemlensError, path: str, name: str) -> str:
    """The error with the temporary path replaced by the name the user knows."""
    return str(exc).replace(path, name)
