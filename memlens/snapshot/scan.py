"""Vet a pickle's opcode stream before CPython's C unpickler executes any of it.

Refusing globals (``find_class``) stops code from running, but the C unpickler can still be
made to hang on plain data: a tuple that refers to itself through the memo twice per level
(a 64-level DAG in a kilobyte) is hashed in 2**64 steps when it is used as a dict key, and
that loop never returns to Python, so not even SIGTERM handlers run. The only place to stop
it is before the opcodes execute.

``VettedStream`` wraps the file: every byte the unpickler reads has been tokenised first,
and the stream is refused at the first opcode that a memory snapshot never needs:

* tuples may hold only integers within 32 bits, None and bools (PyTorch's
  ``segment_pool_id`` is a pair of small ints), at most ``MAX_TUPLE_ITEMS`` of them, so
  hashing any key is cheap and no two crafted tuples share a hash;
* at most ``MAX_LARGE_INTS`` integers beyond +-2**61 (below that ints never share a hash);
* no sets or frozensets (hashable containers again), no ``DUP`` (Pickler never emits it;
  it multiplies references), no ``LONG4`` integers (thousands of digits are not a size);
* memo ``PUT`` indices must not exceed the bytes read so far (a huge index makes the C
  unpickler allocate a memo table of that size).

Everything else passes unchanged; the global-like opcodes too, so the unpickler's
``find_class`` keeps refusing them by name. Tokenising is one C-level regular expression
over each piece (about 180 MB/s, a third of ``pickle.load``'s time); only the rare opcodes
with a long length prefix, a text line or a tuple drop back to Python. Files of
``PARALLEL_MIN_BYTES`` or more are vetted by a child process (``PipedVetting``) on another
CPU while this one unpickles exactly the bytes the child sends.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import runpy
import struct
import subprocess
import sys
from typing import IO, Any

try:
    import fcntl
except ImportError:  # not on a POSIX system: the pipe keeps its default size
    fcntl = None  # type: ignore[assignment]

# The limits the native scanner holds to as well, declared once in limits.py beside this file.
# Read by path, not imported: the vetting child runs this file by path under ``-I -S``, where
# memlens is not importable (and a package import would cost the child its start-up).
_LIMITS = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "limits.py"))
MAX_TUPLE_ITEMS: int = _LIMITS["MAX_TUPLE_ITEMS"]
MAX_LARGE_INTS: int = _LIMITS["MAX_LARGE_INTS"]
MAX_WIDE_TUPLES: int = _LIMITS["MAX_WIDE_TUPLES"]
CHUNK = 1 << 20
PIECE = 16 << 10  # bytes tokenised per regex call
# More than the longest token the regular expression matches (a short string: 129 bytes);
# a run that stops closer than this to the end of the buffer may have cut a token in two.
MAX_TOKEN = 260
# How far back from a tuple opcode its items can start (8 text floats/longs and a MARK).
TUPLE_WINDOW = 1024


class PickleRefused(Exception):
    """The opcode stream holds something a memory snapshot never needs; message says what."""


def _length_prefixed(opcode: bytes, lengths: int) -> bytes:
    """``opcode``, a 1-byte length n < ``lengths``, then exactly n bytes (one alternative per n;
    longer ones are vetted in Python: every alternative costs compile time at import)."""
    alternatives = b"|".join(re.escape(bytes([n])) + b"." * n for n in range(lengths))
    return re.escape(opcode) + b"(?:" + alternatives + b")"


# Integers are kept below 2**61 in magnitude by the regular expression: below that, distinct
# ints have distinct hashes (CPython hashes an int modulo 2**61 - 1), so no dict of int keys
# can be made to collide. Larger ones are vetted in Python and counted (MAX_LARGE_INTS).
_LONG1_SMALL = (  # LONG1 of up to 7 bytes, or 8 whose top byte keeps it within +-2**61
    _length_prefixed(b"\x8a", 8)[:-1] + rb"|\x08.......[\x00-\x1f\xe0-\xff])"
)
# 2**64 - 1 as LONG1: the line PyTorch writes for a Python frame it has none for (-1 as uint64),
# in every such frame of a real file. One value cannot share a hash with many: not counted.
_LONG1_UINT64_MAX = re.escape(b"\x8a\x09" + b"\xff" * 8 + b"\x00")
_INTS = [_LONG1_SMALL, rb"J....", rb"K.", rb"M..", _LONG1_UINT64_MAX]  # LONG1, BININT, BININT1, BININT2
# Protocol 0 numbers (longer ones are vetted in Python, a line at a time: see MAX_TOKEN).
_TEXT_NUMBERS = [rb"I-?[0-9]{1,18}\n", rb"L-?[0-9]{1,18}L?\n", rb"F[-+.0-9a-zA-Z]{1,40}\n"]
# What a tuple may hold: integers within 32 bits, None, True, False. Not floats and not larger
# integers: with those, many tuples with one hash are easy to compute, and a dict keyed by
# them takes quadratic time to build.
_TUPLE_ITEM_PARTS = [
    _length_prefixed(b"\x8a", 5), rb"J....", rb"K.", rb"M..", rb"[N\x88\x89]",
    rb"I-?[0-9]{1,10}\n", rb"L-?[0-9]{1,10}L?\n",
]
# Ordered by how often each appears in real snapshots (the regex tries alternatives in turn;
# this order is 15% faster than the opcode table's).
_TOKEN_PARTS = [
    rb"j....", rb"h.",  # LONG_BINGET, BINGET: most of a real file
    # MEMOIZE EMPTY_DICT EMPTY_LIST MARK SETITEMS APPENDS APPEND EMPTY_TUPLE POP POP_MARK
    # SETITEM LIST DICT NONE NEWTRUE NEWFALSE
    rb"[\x94}\](uea)01sldN\x88\x89]",
    *_INTS, rb"G........", *_TEXT_NUMBERS,
    _length_prefixed(b"\x8c", 128),  # SHORT_BINUNICODE (95% of real ones are under 32 bytes)
    rb"q.", rb"\x80.", rb"\x95........",  # BINPUT, PROTO, FRAME (its contents are tokens too)
    rb"g[0-9]{1,19}\n",  # GET (protocol 0)
]
_RUN = re.compile(b"(?s:(?:" + b"|".join(_TOKEN_PARTS) + b")*+)")
_TUPLE_ITEM = re.compile(b"(?s:(?:" + b"|".join(_TUPLE_ITEM_PARTS) + b"))")
# segment_pool_id is a pair of CaptureId_t (unsigned 64-bit): PyTorch's ids are small counters,
# but any within +-2**61 (and 2**64 - 1, "none") is legal. Such wide tuples are counted: with
# items of 61 bits, tuples with one hash are easy to compute, and MAX_WIDE_TUPLES of them as dict
# keys cost seconds, not hours.
_WIDE_TUPLE_ITEM = re.compile(b"(?s:(?:" + b"|".join([
    *_TUPLE_ITEM_PARTS, _LONG1_SMALL, _LONG1_UINT64_MAX, rb"I-?[0-9]{1,18}\n", rb"L-?[0-9]{1,18}L?\n",
]) + b"))")


def _run_end(buffer: bytearray, start: int, end: int | None = None) -> int:
    """Where the run of regex tokens from ``start`` (a token start) stops, before ``end``.

    Each token is told by its first byte, so a run cut short by ``end`` still stops on a
    token start: the last one at or before ``end``.
    """
    match = _RUN.match(buffer, start, len(buffer) if end is None else end)
    return match.end() if match is not None else start  # the run matches the empty string


# Opcodes with a little-endian length prefix of this many bytes, then that many bytes of data.
_PAYLOAD_PREFIX = {
    0x8C: 1, ord("X"): 4, 0x8D: 8,  # SHORT_BINUNICODE (the long ones), BINUNICODE, BINUNICODE8
    0x8A: 1,  # LONG1 beyond +-2**61 (counted: see MAX_LARGE_INTS)
    ord("C"): 1, ord("U"): 1,  # SHORT_BINBYTES, SHORT_BINSTRING
    ord("B"): 4, 0x8E: 8, 0x96: 8,  # BINBYTES, BINBYTES8, BYTEARRAY8
    ord("T"): 4,  # BINSTRING
}
# Opcodes refused by the unpickler itself (find_class / persistent_load refuse them by name,
# or they need a callable that only a global could supply): passed through so its message
# stays the one users see. Value: bytes of argument after the opcode; -1: text lines.
_PASS_THROUGH = {
    ord("c"): -2, ord("i"): -2, ord("P"): -1,  # GLOBAL, INST, PERSID
    0x93: 0, ord("R"): 0, ord("b"): 0, 0x81: 0, 0x92: 0, ord("o"): 0, ord("Q"): 0,
    0x97: 0, 0x98: 0,  # STACK_GLOBAL REDUCE BUILD NEWOBJ NEWOBJ_EX OBJ BINPERSID buffers
    0x82: 1, 0x83: 2, 0x84: 4,  # EXT1 EXT2 EXT4
}
_GLOBAL_OPCODES = {ord("c"), ord("i"), 0x93, 0x82, 0x83, 0x84}
# The regular expression's opcodes with an argument of a fixed size: one it did not take, it
# did not take because the input ends inside that argument.
_FIXED_ARGUMENT = {
    ord("j"): 4, ord("h"): 1, ord("q"): 1, ord("J"): 4, ord("K"): 1, ord("M"): 2, ord("G"): 8,  # GETs, PUT, ints
    0x80: 1, 0x95: 8,  # PROTO, FRAME
}
_FRAME = 0x95
_TUPLE_SIZES = {0x85: 1, 0x86: 2, 0x87: 3}
_LARGE_INT_OPCODES = {0x8A, ord("I"), ord("L")}  # LONG1, INT, LONG
_TEXT_LINES = {ord("S"), ord("V"), ord("I"), ord("L"), ord("F")}  # STRING UNICODE INT LONG FLOAT
_REFUSED = {
    ord("2"): "the DUP opcode (no pickler emits it for plain data; it multiplies references)",
    0x8F: "a set (a memory snapshot holds none)",
    0x90: "a set (a memory snapshot holds none)",
    0x91: "a frozenset (a memory snapshot holds none)",
    0x8B: "an integer of more than 255 bytes (LONG4; no snapshot field is that large)",
}


class VettedStream:
    """A read-only file object that hands the unpickler only bytes already vetted.

    It offers ``read``, ``readinto``, ``readline`` and ``peek``, the methods the C unpickler
    uses; ``peek`` lets it prefetch unframed (protocol 0-3) pickles without a call per opcode.
    Positions in ``_boundaries`` are absolute stream offsets where a token starts.
    """

    def __init__(self, raw: IO[bytes] | Any, total: int | None = None, total_is_limit: bool = False) -> None:
        """``total``: the stream's length (a file's size) or, with ``total_is_limit``, the most
        it may hold (a gzip stream's inflation limit): a string or bytes payload longer than
        what is left is refused before the unpickler allocates it."""
        self._raw = raw
        self._total = total
        self._total_is_limit = total_is_limit
        self._buf = bytearray()
        self._base = 0  # absolute offset of _buf[0] in the stream
        self._out = 0  # _buf[:_out] was handed to the unpickler
        self._vetted = 0  # _buf[:_vetted] is vetted
        self._boundaries: list[int] = [0]  # recent token starts (absolute), ascending
        self._payload_left = 0  # bytes of a length-prefixed payload not yet vetted
        self._payload_at = 0  # where that payload's opcode starts (absolute)
        self._large_ints = 0
        self._wide_tuples = 0
        self._eof = False
        self._stopped = False  # after STOP (or a refusal) nothing more is handed out
        # Set when vetting refused the stream: the unpickler gets the bytes before the refused
        # opcode (so a global there is still refused by name) and then an early end of data.
        self.refusal: PickleRefused | None = None
        # The first global the stream names ("module.name" when it can be read off the bytes):
        # a refusal reports it, as the unpickler's find_class would have.
        self.first_global: str | None = None

    # ---------------------------------------------------------------- file interface

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            while not self._done():
                self._vet_more()
            size = self._vetted - self._out
        while self._vetted - self._out < size and not self._done():
            self._vet_more()
        end = min(self._out + size, self._vetted)
        data = self._copy(self._out, end)
        self._out = end
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, size: int = -1) -> bytes:
        while self._buf.find(b"\n", self._out, self._vetted) < 0 and not self._done():
            self._vet_more()
        newline = self._buf.find(b"\n", self._out, self._vetted)
        end = newline + 1 if newline >= 0 else self._vetted
        if size is not None and size >= 0:
            end = min(end, self._out + size)
        data = self._copy(self._out, end)
        self._out = end
        return data

    def peek(self, size: int = 0) -> bytes:
        if self._vetted == self._out and not self._done():
            self._vet_more()
        end = self._vetted if size <= 0 else min(self._vetted, self._out + size)
        return self._copy(self._out, end)

    def _copy(self, start: int, end: int) -> bytes:
        with memoryview(self._buf) as view:  # released at once: the buffer must stay resizable
            return bytes(view[start:end])

    # ---------------------------------------------------------------- buffering

    def _done(self) -> bool:
        return self._stopped or (self._eof and self._vetted == len(self._buf))

    def _fill(self, keep: bool = False) -> None:
        """Read another chunk. Unless ``keep`` (positions in use), drop what the unpickler
        has consumed, back to a token start far enough behind ``_vetted`` for a tuple check."""
        chunk = self._raw.read(min(max(CHUNK, self._payload_left), 64 * CHUNK)) if not self._eof else b""
        if not chunk:
            self._eof = True
            return
        if not keep:
            limit = self._base + min(self._out, self._vetted - TUPLE_WINDOW)
            oldest_needed = max(bisect.bisect_right(self._boundaries, limit) - 1, 0)
            del self._boundaries[:oldest_needed]
            drop = self._boundaries[0] - self._base
            if drop > 0:
                del self._buf[:drop]
                self._base += drop
                self._out -= drop
                self._vetted -= drop
        self._buf += chunk

    def _need(self, count: int) -> bool:
        """Buffer at least ``count`` bytes after _vetted (False at the end of the input)."""
        while len(self._buf) - self._vetted < count and not self._eof:
            self._fill(keep=True)
        return len(self._buf) - self._vetted >= count

    def _boundary(self, position: int) -> None:
        self._vetted = position
        self._boundaries.append(self._base + position)

    # ---------------------------------------------------------------- vetting

    def _vet_more(self) -> None:
        """Extend the vetted region (reading more input when it is needed)."""
        before = self._vetted
        while self._vetted == before and not self._done():
            if self._payload_left:
                take = min(self._payload_left, len(self._buf) - self._vetted)
                self._payload_left -= take
                if self._payload_left:
                    self._vetted += take
                    self._fill()
                else:
                    self._boundary(self._vetted + take)
                continue
            # Pieces of PIECE bytes leave a token start every few kilobytes for _vet_tuple.
            limit = min(len(self._buf), self._vetted + PIECE)
            end = _run_end(self._buf, self._vetted, limit)
            if end == self._vetted and limit < len(self._buf):  # a token across the piece's end
                end = _run_end(self._buf, self._vetted, min(len(self._buf), limit + MAX_TOKEN))
            if end > self._vetted:
                self._boundary(end)
                continue
            if not self._eof and len(self._buf) - end < MAX_TOKEN:
                self._fill()  # the next token may be cut by the end of the buffer
                continue
            if end == len(self._buf):
                self._eof = True  # nothing left: the unpickler reports the truncation
                continue
            try:
                self._special(end)
            except PickleRefused as exc:
                self.refusal = exc
                self._stopped = True
        if self._eof and not self._stopped and self._vetted == len(self._buf):
            # Every byte vetted and no STOP: the file was cut, at a token's end or in a payload.
            self.refusal = self._ends_early(self._payload_at - self._base if self._payload_left else self._vetted)
            self._stopped = True

    def _refuse(self, what: str, at: int) -> PickleRefused:
        return PickleRefused(f"refused to load: the pickle holds {what} at byte {self._base + at:,}")

    def _ends_early(self, at: int, what: str = "") -> PickleRefused:
        """The input ends inside the opcode at ``at`` (a buffer position), or before a STOP there.

        Said with where reading stopped and the size of what there is, so a copy still being
        written or a partial download is told apart from damage ("an opcode no snapshot uses")."""
        if self._total is not None and not self._total_is_limit:
            size, whole = self._total, "the file"
        else:  # a gzip: its pickle's bytes, all of them inflated by now
            size, whole = self._base + len(self._buf), "the pickle inside the gzip"
        return PickleRefused(f"{whole} ends early at byte {self._base + at:,} of {size:,}{what}: it is truncated "
                             "or was still being written")

    def _special(self, at: int) -> None:
        """The opcode at ``at`` (== _vetted) is one the regular expression does not take."""
        opcode = self._buf[at]
        if opcode in _LARGE_INT_OPCODES:  # the regular expression takes the small ones
            self._large_ints += 1
            if self._large_ints > MAX_LARGE_INTS:
                raise self._refuse(
                    f"more than {MAX_LARGE_INTS:,} integers beyond +-2**61 (PyTorch writes none but 2**64 - 1; as dict "
                    "keys they can share one hash and take quadratic time)", at)
        if opcode == ord("."):  # STOP: the unpickler reads nothing after it
            self._boundary(at + 1)
            self._stopped = True
        elif opcode in _PAYLOAD_PREFIX:
            width = _PAYLOAD_PREFIX[opcode]
            if not self._need(1 + width):
                raise self._ends_early(at)
            length = int.from_bytes(self._buf[at + 1:at + 1 + width], "little", signed=opcode == ord("T"))
            left = None if self._total is None else self._total - (self._base + at + 1 + width)
            if left is not None and length > left:
                # Refused before the opcode is handed on: the unpickler allocates the length it
                # declares (BYTEARRAY8, BINBYTES8: a gigabyte for a 75-byte file) before it reads.
                if self._total_is_limit:
                    raise PickleRefused(f"refused to load: a {length:,}-byte string at byte {self._base + at:,} "
                                        f"would inflate the stream past {self._total:,} bytes")
                raise self._ends_early(at, f" (a {length:,}-byte string there runs past its end)")
            self._vetted = at + 1 + width
            self._payload_left = max(length, 0)
            self._payload_at = self._base + at
            if not self._payload_left:
                self._boundary(self._vetted)
        elif opcode in _TEXT_LINES:  # a text string or a long text number: one line
            self._vet_lines(at, 1)
        elif opcode in (ord("r"), ord("p")):  # LONG_BINPUT / PUT
            self._vet_put(at, opcode)
        elif opcode in _TUPLE_SIZES or opcode == ord("t"):
            self._vet_tuple(at, opcode)
        elif opcode in _PASS_THROUGH:
            if opcode in _GLOBAL_OPCODES and self.first_global is None:
                self.first_global = self._global_name(at, opcode)
            argument = _PASS_THROUGH[opcode]
            if argument < 0:
                self._vet_lines(at, -argument)
            elif self._need(1 + argument):
                self._boundary(at + 1 + argument)
            else:
                raise self._ends_early(at)
        elif opcode in _REFUSED:
            raise self._refuse(_REFUSED[opcode], at)
        elif self._cut_here(at, opcode):
            raise self._ends_early(at)
        else:
            raise self._refuse(f"an opcode no memory snapshot uses, or a malformed one (0x{opcode:02x})", at)

    def _cut_here(self, at: int, opcode: int) -> bool:
        """The regular expression did not take the opcode at ``at`` because the input ends
        inside its argument (a fixed-size one, or a protocol 0 GET's line)."""
        if opcode in _FIXED_ARGUMENT:
            return not self._need(1 + _FIXED_ARGUMENT[opcode])
        return opcode == ord("g") and self._eof and self._buf.find(b"\n", at) < 0

    def _global_name(self, at: int, opcode: int) -> str:
        """``module.name`` of a GLOBAL, or of a STACK_GLOBAL whose two strings come just before."""
        if opcode == ord("c"):
            self._need(MAX_TOKEN)
            lines = bytes(self._buf[at + 1:at + MAX_TOKEN]).split(b"\n")
            if len(lines) >= 3:
                return ".".join(part.decode("utf-8", "replace") for part in lines[:2])
        if opcode == 0x93:  # the module and name strings (and their MEMOIZEs) just before
            texts = [bytes(self._buf[start + 2:end]) for start, end in self._tokens_before(at, 4)
                     if self._buf[start] == 0x8C]
            if len(texts) >= 2:
                return ".".join(text.decode("utf-8", "replace") for text in texts[-2:])
        return f"named by opcode 0x{opcode:02x}"

    def _vet_lines(self, at: int, lines: int) -> None:
        position = at + 1
        for _ in range(lines):
            newline = self._buf.find(b"\n", position)
            while newline < 0 and not self._eof:
                self._fill(keep=True)
                newline = self._buf.find(b"\n", position)
            if newline < 0:
                raise self._ends_early(at)
            position = newline + 1
        self._boundary(position)

    def _vet_put(self, at: int, opcode: int) -> None:
        if opcode == ord("r"):
            if not self._need(5):
                raise self._ends_early(at)
            index = int.from_bytes(self._buf[at + 1:at + 5], "little")
            end = at + 5
        else:
            self._need(24)
            newline = self._buf.find(b"\n", at, at + 24)
            digits = self._buf[at + 1:newline] if newline > at else b""
            if not digits.isdigit():
                if len(self._buf) - at < 24 and self._buf.find(b"\n", at) < 0:
                    raise self._ends_early(at)
                raise self._refuse("a malformed PUT", at)
            index = int(digits)
            end = newline + 1
        if index > self._base + at:
            # Indices count memoised objects, each at least a byte: a larger one only makes
            # the unpickler allocate a memo table of that size.
            raise self._refuse(f"a memo index of {index:,}, more than the bytes before it,", at)
        self._boundary(end)

    def _vet_tuple(self, at: int, opcode: int) -> None:
        """A tuple may hold only scalars, which the tokens just before it must all be."""
        if opcode in _TUPLE_SIZES:
            items = self._tokens_before(at, _TUPLE_SIZES[opcode])
            ok = len(items) == _TUPLE_SIZES[opcode]
        else:  # MARK ... TUPLE: the tokens after the nearest MARK
            tokens = self._tokens_before(at, MAX_TUPLE_ITEMS + 1, stop_at_mark=True)
            ok = bool(tokens) and self._buf[tokens[0][0]] == ord("(")
            items = tokens[1:]
        if ok and not all(_TUPLE_ITEM.fullmatch(self._buf, start, end) for start, end in items):
            ok = all(_WIDE_TUPLE_ITEM.fullmatch(self._buf, start, end) for start, end in items)
            self._wide_tuples += ok
            if self._wide_tuples > MAX_WIDE_TUPLES:
                raise self._refuse(f"more than {MAX_WIDE_TUPLES:,} tuples of integers beyond 32 bits (a snapshot "
                                   "has one pool id per segment, small counters)", at)
        if not ok:
            raise self._refuse(
                "a tuple of anything but a few small integers (a snapshot's tuples hold two; "
                "hashing other tuples can take forever)", at)
        self._boundary(at + 1)

    def _tokens_before(self, at: int, count: int, stop_at_mark: bool = False) -> list[tuple[int, int]]:
        """(start, end) of up to ``count`` regex tokens ending exactly at ``at``, oldest first
        (fewer when a payload, text line or other special opcode comes first)."""
        start = self._run_start_before(at)
        tokens: list[tuple[int, int]] = []
        end = at
        while end > start and len(tokens) < count:
            begin = _run_end(self._buf, start, end - 1)  # the last token start before end
            if self._buf[begin] != _FRAME:  # a frame may start between any two opcodes: no item
                tokens.append((begin, end))
            if stop_at_mark and self._buf[begin] == ord("("):
                break
            end = begin
        return tokens[::-1]

    def _run_start_before(self, at: int) -> int:
        """A token start, about TUPLE_WINDOW before ``at``, from which regex tokens run to ``at``
        (``at`` itself when a special opcode ends right before it)."""
        base = self._base
        index = bisect.bisect_right(self._boundaries, base + at - TUPLE_WINDOW) - 1
        start = self._boundaries[max(index, 0)] - base
        while True:
            if start < at - TUPLE_WINDOW:
                start = _run_end(self._buf, start, at - TUPLE_WINDOW)  # closer, at C speed
            if _run_end(self._buf, start, at) == at:
                return start
            # A special opcode in between: start again at the token start recorded after it.
            index = bisect.bisect_right(self._boundaries, base + start)
            if index >= len(self._boundaries) or self._boundaries[index] - base > at:
                return at
            start = self._boundaries[index] - base


# --------------------------------------------------------------------------- vetting in parallel

# Files at least this large are vetted by a child process while this one unpickles (on two or
# more CPUs): tokenising costs about a third of pickle.load, and on a second core it costs
# the load nothing. Smaller files are vetted in-process (a process start is ~50 ms).
PARALLEL_MIN_BYTES = 32 << 20
_MESSAGE = struct.Struct("<cQ")  # kind, length; then that many bytes
_DATA, _GLOBAL, _REFUSAL, _END = b"D", b"G", b"R", b"E"
# The child runs this file alone (isolated, no site): it needs the standard library only, so
# it starts in tens of milliseconds and cannot import anything from the snapshot's folder.
_CHILD = "import runpy, sys; runpy.run_path(sys.argv[1])['vet_to_pipe'](int(sys.argv[2]))"


def vet_to_pipe(fd: int) -> None:
    """Child side: vet the file open as ``fd`` (inherited from the parent, which opened and
    checked it) and send it to stdout as framed messages (vetted data, then the first global's
    name and the refusal if there are any, then end).

    The parent unpickles exactly the bytes sent here, so nothing unvetted reaches the unpickler;
    and the child reads the very file the parent checked, not whatever its path names now.
    """
    out = sys.stdout.buffer
    with open(fd, "rb") as handle:
        handle.seek(0)
        stream = VettedStream(handle, total=os.fstat(handle.fileno()).st_size)
        _send(stream, out)


def _send(stream: VettedStream, out: IO[bytes]) -> None:
    while data := stream.read(CHUNK):
        out.write(_MESSAGE.pack(_DATA, len(data)))
        out.write(data)
    for kind, text in ((_GLOBAL, stream.first_global), (_REFUSAL, stream.refusal)):
        if text is not None:
            payload = str(text).encode()
            out.write(_MESSAGE.pack(kind, len(payload)) + payload)
    out.write(_MESSAGE.pack(_END, 0))
    out.flush()


def parallel_vetting_pays(size: int) -> bool:
    """True when a child process should vet a file of ``size`` bytes."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return size >= PARALLEL_MIN_BYTES and cpus >= 2


class PipedVetting:
    """The unpickler's file object when a child process vets: the bytes come from the child
    (so they are exactly the bytes it vetted), with its refusal and first global, like
    ``VettedStream``. ``close`` ends the child if the unpickler stopped early."""

    def __init__(self, fd: int, on_bytes: Any = None) -> None:
        # The descriptor is the child's as the same number (pass_fds); from here on only the
        # child moves its position: the parent reads the pipe.
        self._child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD, os.path.abspath(__file__), str(fd)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(fd,),
        )
        assert self._child.stdout is not None
        self._pipe = self._child.stdout
        with contextlib.suppress(OSError, AttributeError):  # a larger pipe: fewer wake-ups
            fcntl.fcntl(self._pipe.fileno(), fcntl.F_SETPIPE_SZ, CHUNK)
        self._buf = bytearray()
        self._out = 0
        self._received = 0
        self._ended = False
        self._on_bytes = on_bytes
        self.refusal: PickleRefused | None = None
        self.first_global: str | None = None

    def _pull(self) -> None:
        """Receive one message; OSError if the child ended without saying so."""
        header = self._pipe.read(_MESSAGE.size)
        if len(header) < _MESSAGE.size:
            self._ended = True
            code = self._child.wait()
            detail = (self._child.stderr.read() if self._child.stderr else b"").decode(errors="replace")
            raise OSError(f"the vetting process stopped (exit code {code}) {detail.strip()[-200:]}".strip())
        kind, length = _MESSAGE.unpack(header)
        payload = self._pipe.read(length)
        if kind == _DATA:
            if self._out:
                del self._buf[:self._out]
                self._out = 0
            self._buf += payload
            self._received += len(payload)
            if self._on_bytes is not None:
                self._on_bytes(self._received)
        elif kind == _GLOBAL:
            self.first_global = payload.decode()
        elif kind == _REFUSAL:
            self.refusal = PickleRefused(payload.decode())
        else:
            self._ended = True

    def started(self) -> bool:
        """Wait for the child's first message: False if it ended without sending one (an
        interpreter that cannot run it), so the caller can vet in-process instead."""
        try:
            self._pull()
        except OSError:
            return False
        return True

    def _want(self, size: int) -> None:
        while len(self._buf) - self._out < size and not self._ended:
            self._pull()

    def _take(self, end: int) -> bytes:
        with memoryview(self._buf) as view:
            data = bytes(view[self._out:end])
        self._out = end
        return data

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = 1 << 62
        self._want(size)
        return self._take(min(self._out + size, len(self._buf)))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, size: int = -1) -> bytes:
        while self._buf.find(b"\n", self._out) < 0 and not self._ended:
            self._pull()
        newline = self._buf.find(b"\n", self._out)
        end = newline + 1 if newline >= 0 else len(self._buf)
        if size is not None and size >= 0:
            end = min(end, self._out + size)
        return self._take(end)

    def peek(self, size: int = 0) -> bytes:
        self._want(1)
        end = len(self._buf) if size <= 0 else min(len(self._buf), self._out + size)
        with memoryview(self._buf) as view:
            return bytes(view[self._out:end])

    def close(self) -> None:
        if self._child.poll() is None:
            self._child.kill()
        self._child.wait()
        self._pipe.close()
        if self._child.stderr is not None:
            self._child.stderr.close()
