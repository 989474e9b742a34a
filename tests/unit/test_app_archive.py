"""The dashboard's .zip of a run folder: bounded and safe before anything is unpacked, and the
pairing rules an uploaded sidecar follows (the loader's own)."""

from __future__ import annotations

import io
import stat
import struct
import zipfile
import zlib
from pathlib import Path

import pytest

from memlens.sidecar import SIDECAR_MAX_BYTES
from memlens_app import archive as archive_module
from memlens_app.archive import ArchiveRefused, run_folder_entries, unpack
from memlens_app.sidecars import SidecarRefused, expected_sidecar, paired_path, read_uploaded_sidecar
from memlens_app.upload import safe_folder

LIMIT = 64 << 20


def make_zip(entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> zipfile.ZipFile:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for info, data in entries:
            archive.writestr(info, data)
    return zipfile.ZipFile(io.BytesIO(buffer.getvalue()))


def entries_of(entries: list[tuple[zipfile.ZipInfo | str, bytes]], limit: int = LIMIT) -> tuple[list[str], list[str]]:
    found, skipped = run_folder_entries(make_zip(entries), "run.zip", limit)
    return [f"{e.kind}:{e.folder}/{e.name}" for e in found], skipped


def test_a_run_folder_gives_its_snapshots_and_sidecars_and_skips_the_rest() -> None:
    found, skipped = entries_of([("run/snapshot.pickle", b"x"), ("run/snapshot.memlens.json", b"{}"),
                                 ("run/rank1.pickle.gz", b"x"), ("run/.snapshot.pickle.reserved", b""),
                                 ("run/train.log", b"log"), ("__MACOSX/run/._snapshot.pickle", b"fork"),
                                 ("run/empty/", b"")])
    assert found == ["snapshot:run/snapshot.pickle", "sidecar:run/snapshot.memlens.json",
                     "snapshot:run/rank1.pickle.gz"]
    assert skipped == ["run/.snapshot.pickle.reserved", "run/train.log", "__MACOSX/run/._snapshot.pickle"]


def test_a_real_files_regular_mode_is_accepted(tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot.pickle"
    snapshot.write_bytes(b"x" * 100)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.write(snapshot, "run/snapshot.pickle")
    info = zipfile.ZipFile(buffer).infolist()[0]
    assert stat.S_ISREG(info.external_attr >> 16)
    found, _ = run_folder_entries(zipfile.ZipFile(buffer), "run.zip", LIMIT)
    assert [e.name for e in found] == ["snapshot.pickle"]


@pytest.mark.parametrize("name", ["../snapshot.pickle", "run/../../snapshot.pickle", "/etc/snapshot.pickle",
                                  "C:/snapshot.pickle", "..\\snapshot.pickle"])
def test_an_entry_that_climbs_out_refuses_the_archive(name: str) -> None:
    with pytest.raises(ArchiveRefused, match="points outside the archive's folder"):
        entries_of([("run/ok.pickle", b"x"), (name, b"x")])


@pytest.mark.parametrize("kind", [stat.S_IFLNK, stat.S_IFCHR, stat.S_IFIFO])
def test_an_entry_that_is_not_a_regular_file_refuses_the_archive(kind: int) -> None:
    info = zipfile.ZipInfo("run/snapshot.pickle")
    info.create_system = 3
    info.external_attr = (kind | 0o777) << 16
    with pytest.raises(ArchiveRefused, match="not a regular file"):
        entries_of([(info, b"/etc/passwd")])


def test_an_encrypted_entry_refuses_the_archive() -> None:
    archive = make_zip([("run/snapshot.pickle", b"x")])
    archive.infolist()[0].flag_bits |= 0x1
    with pytest.raises(ArchiveRefused, match="encrypted"):
        run_folder_entries(archive, "run.zip", LIMIT)


def test_too_many_entries_refuse_the_archive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive_module, "MAX_ENTRIES", 5)
    with pytest.raises(ArchiveRefused, match="6 entries, more than"):
        entries_of([(f"run/{i}.log", b"") for i in range(6)])


def test_what_it_inflates_to_counts_against_the_upload_limit() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB that barely compresses
    assert entries_of([("run/a.pickle", data)], limit=2 << 20)[0]
    with pytest.raises(ArchiveRefused, match=r"inflates to more than 2\.00 MiB, this server's upload limit"):
        entries_of([("run/a.pickle", data), ("run/b.pickle", data), ("run/c.pickle", data)], limit=2 << 20)


def test_an_entry_inflating_far_beyond_any_snapshot_is_refused() -> None:
    zeros = bytes(16 << 20)  # deflates about 1000 to 1
    with pytest.raises(ArchiveRefused, match=r"inflates [\d,]+ times its size"):
        entries_of([("run/bomb.pickle", zeros)])
    assert entries_of([("run/small.pickle", bytes(512 << 10))])[0]  # small entries may compress well


def test_an_entry_whose_data_lies_inside_another_entrys_refuses_the_archive() -> None:
    """The quoted overlap: entry a's stored data is entry b's local header and data, so the
    directory lists b from inside a (one member's bytes inflated twice)."""
    def local(name: bytes, data: bytes) -> bytes:
        return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                           len(name), 0) + name + data

    def central(name: bytes, data: bytes, offset: int) -> bytes:
        return struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, zlib.crc32(data), len(data),
                           len(data), len(name), 0, 0, 0, 0, 0, offset) + name

    inner = local(b"run/b.pickle", b"b" * 1000)
    outer = local(b"run/a.pickle", inner)
    directory = central(b"run/a.pickle", inner, 0) + central(b"run/b.pickle", b"b" * 1000, len(outer) - len(inner))
    data = outer + directory + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 2, 2, len(directory), len(outer), 0)
    with pytest.raises(ArchiveRefused, match=r"entry 'run/b\.pickle' shares its data with 'run/a\.pickle'; refused"):
        run_folder_entries(zipfile.ZipFile(io.BytesIO(data)), "run.zip", LIMIT)


def test_unpack_writes_the_entry_and_never_over_a_file(tmp_path: Path) -> None:
    archive = make_zip([("run/snapshot.pickle", b"pickle bytes")])
    (entry,), _ = run_folder_entries(archive, "run.zip", LIMIT)
    target = tmp_path / "u-1-snapshot.pickle"
    assert unpack(archive, entry, str(target)) == len(b"pickle bytes")
    assert target.read_bytes() == b"pickle bytes"
    with pytest.raises(FileExistsError):
        unpack(archive, entry, str(target))


def test_an_entry_that_inflates_past_its_declared_size_is_not_written_in_full(tmp_path: Path) -> None:
    archive = make_zip([("run/snapshot.pickle", b"x" * 10_000)])
    (entry,), _ = run_folder_entries(archive, "run.zip", LIMIT)
    entry.info.file_size = 100  # the central directory lies
    with pytest.raises((ArchiveRefused, zipfile.BadZipFile)):
        unpack(archive, entry, str(tmp_path / "out.pickle"))
    assert (tmp_path / "out.pickle").stat().st_size <= 100


# --------------------------------------------------------------------------- sidecar pairing


def test_pairing_is_the_loaders() -> None:
    assert expected_sidecar("snapshot.pickle") == "snapshot.memlens.json"
    assert expected_sidecar("rank1.pickle.gz") == "rank1.memlens.json"
    assert paired_path("/up/u-abc-snapshot.pickle") == "/up/u-abc-snapshot.memlens.json"


def test_an_uploaded_sidecar_is_read_or_refused_with_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"memlens_sidecar_version": 1, "model": null}')
    assert read_uploaded_sidecar(str(path), "snapshot.memlens.json")["memlens_sidecar_version"] == 1
    path.write_text("[" * 100_000)
    with pytest.raises(SidecarRefused, match=r"snapshot\.memlens\.json: not"):
        read_uploaded_sidecar(str(path), "snapshot.memlens.json")
    path.write_bytes(b" " * (SIDECAR_MAX_BYTES + 1))
    with pytest.raises(SidecarRefused, match="larger than a sidecar may be"):
        read_uploaded_sidecar(str(path), "snapshot.memlens.json")


@pytest.mark.parametrize(("given", "folder"), [
    ("", ""), ("runs/a", "runs/a"), ("../../etc", "etc"), ("a\\b", "a/b"), ("a b/c$d", "a_b/c_d"),
    ("/".join("x" * 20), "x/" * 7 + "x")])
def test_a_folder_is_only_a_label(given: str, folder: str) -> None:
    assert safe_folder(given) == folder
