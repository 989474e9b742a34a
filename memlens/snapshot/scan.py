"""Vet a pickle's opcode stream before CPython's C unpickler executes any of it.

Refusing globals (``find_class``) stops code from running, but the C unpickler can still be
made to hang on plain data: a tuple that refers to itself through the memo twice per level
(a 64-level DAG in a kilobyte) is hashed in 2**64 steps when it is used as a dict key, and
that loop never returns to Python, so not even SIGTERM handlers run. The only place to stop
it is before the opcodes execute.

``VettedStream`` wraps the file: every byte the unpickler reads has been tokenised first,
and the stream is refused at the first opcode that a memory snapshot never needs:

* tuples may hold only scalars (ints, floats, None, bools: PyTorch's ``segment_pool_id``
  is a pair of ints), at most ``MAX_TUPLE_ITEMS`` of them, so hashing any key is cheap;
* no sets or frozensets (hashable containers again), no ``DUP`` (Pickler never emits it;
  it multiplies references), no ``LONG4`` integers (thousands of digits are not a size);
* memo ``PUT`` indices must not exceed the bytes read so far (a huge index makes the C
  unpickler allocate a memo table of that size).

Everything else passes unchanged; the global-like opcodes too, so the unpickler's
``find_class`` keeps refusing them by name. Tokenising is one C-level regular expression
over each chunk (about a third of ``pickle.load``'s time); only the rare opcodes with a
length prefix, a text line or a tuple drop back to Python.
"""

from __future__ import annotations

import re
from collections import deque
from typing import IO, Any

MAX_TUPLE_ITEMS = 8
CHUNK = 1 << 20
PIECE = 16 << 10  # bytes tokenised per regex call
# The longest token the regular expression matches (a 1-byte length prefix and 255 bytes);
# a run that stops closer than this to the end of the buffer may have cut a token in two.
MAX_TOKEN = 260
# How far back from a tuple opcode its items can start (8 text floats/longs and a MARK).
TUPLE_WINDOW = 1024
SHORT_TUPLE_WINDOW = 48


class PickleRefused(Exception):
    """The opcode stream holds something a memory snapshot never needs; message says what."""


def _length_prefixed(opcode: bytes) -> bytes:
    """``opcode``, a 1-byte length n, then exactly n bytes (one alternative per n)."""
    lengths = b"|".join(re.escape(bytes([n])) + b"." * n for n in range(256))
    return re.escape(opcode) + b"(?:" + lengths + b")"


_INTS = [rb"J....", rb"K.", rb"M..", _length_prefixed(b"\x8a")]  # BININT BININT1 BININT2 LONG1
_TEXT_NUMBERS = [rb"I-?[0-9]{1,25}\n", rb"L-?[0-9]{1,80}L?\n", rb"F[-+.0-9a-zA-Z]{1,40}\n"]  # protocol 0
# What a tuple may hold: numbers, None, True, False.
_SCALAR_PARTS = [*_INTS, rb"[N\x88\x89]", rb"G........", *_TEXT_NUMBERS]
# Ordered by how often each appears in real snapshots (the regex tries alternatives in turn;
# this order is 15% faster than the opcode table's).
_TOKEN_PARTS = [
    rb"j....", rb"h.",  # LONG_BINGET, BINGET: most of a real file
    # MEMOIZE EMPTY_DICT EMPTY_LIST MARK SETITEMS APPENDS APPEND EMPTY_TUPLE POP POP_MARK
    # SETITEM LIST DICT NONE NEWTRUE NEWFALSE
    rb"[\x94}\](uea)01sldN\x88\x89]",
    _INTS[3], *_INTS[:3], rb"G........", *_TEXT_NUMBERS,
    _length_prefixed(b"\x8c"),  # SHORT_BINUNICODE
    rb"q.", rb"\x80.", rb"\x95........",  # BINPUT, PROTO, FRAME (its contents are tokens too)
    rb"g[0-9]{1,19}\n",  # GET (protocol 0)
    _length_prefixed(b"C"), _length_prefixed(b"U"),  # SHORT_BINBYTES, SHORT_BINSTRING
]
_TOKEN = b"(?:" + b"|".join(_TOKEN_PARTS) + b")"
_RUN = re.compile(b"(?s:" + _TOKEN + b"*+)")


def _run_end(buffer: bytearray, start: int, end: int | None = None) -> int:
    """Where the run of regex tokens from ``start`` (a token start) stops, before ``end``."""
    match = _RUN.match(buffer, start, len(buffer) if end is None else end)
    return match.end() if match is not None else start  # the run matches the empty string


_ONE_TOKEN = re.compile(b"(?s:" + _TOKEN + b")")
_ONE_SCALAR = re.compile(b"(?s:(?:" + b"|".join(_SCALAR_PARTS) + b"))")

# Opcodes with a little-endian length prefix of this many bytes, then that many bytes of data.
_PAYLOAD_PREFIX = {
    ord("X"): 4, 0x8D: 8,  # BINUNICODE, BINUNICODE8
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
_TUPLE_SIZES = {0x85: 1, 0x86: 2, 0x87: 3}
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

    def __init__(self, raw: IO[bytes] | Any) -> None:
        self._raw = raw
        self._buf = bytearray()
        self._base = 0  # absolute offset of _buf[0] in the stream
        self._out = 0  # _buf[:_out] was handed to the unpickler
        self._vetted = 0  # _buf[:_vetted] is vetted
        self._boundaries: deque[int] = deque([0])  # recent token starts (absolute), oldest first
        self._payload_left = 0  # bytes of a length-prefixed payload not yet vetted
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
        data = bytes(self._buf[self._out:end])
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
        data = bytes(self._buf[self._out:end])
        self._out = end
        return data

    def peek(self, size: int = 0) -> bytes:
        if self._vetted == self._out and not self._done():
            self._vet_more()
        return bytes(self._buf[self._out:self._vetted])

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
            while len(self._boundaries) > 1 and self._boundaries[1] <= limit:
                self._boundaries.popleft()
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

    def _refuse(self, what: str, at: int) -> PickleRefused:
        return PickleRefused(f"refused to load: the pickle holds {what} at byte {self._base + at:,}")

    def _special(self, at: int) -> None:
        """The opcode at ``at`` (== _vetted) is one the regular expression does not take."""
        opcode = self._buf[at]
        if opcode == ord("."):  # STOP: the unpickler reads nothing after it
            self._boundary(at + 1)
            self._stopped = True
        elif opcode in _PAYLOAD_PREFIX:
            width = _PAYLOAD_PREFIX[opcode]
            if not self._need(1 + width):
                self._vetted = len(self._buf)  # truncated: the unpickler says so
                return
            length = int.from_bytes(self._buf[at + 1:at + 1 + width], "little", signed=opcode == ord("T"))
            self._vetted = at + 1 + width
            self._payload_left = max(length, 0)
            if not self._payload_left:
                self._boundary(self._vetted)
        elif opcode in (ord("S"), ord("V")):  # text STRING / UNICODE: one line
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
                self._vetted = len(self._buf)
        elif opcode in _REFUSED:
            raise self._refuse(_REFUSED[opcode], at)
        else:
            raise self._refuse(f"an opcode no memory snapshot uses, or a malformed one (0x{opcode:02x})", at)

    def _global_name(self, at: int, opcode: int) -> str:
        """``module.name`` of a GLOBAL, or of a STACK_GLOBAL whose two strings come just before."""
        if opcode == ord("c"):
            self._need(MAX_TOKEN)
            lines = bytes(self._buf[at + 1:at + MAX_TOKEN]).split(b"\n")
            if len(lines) >= 3:
                return ".".join(part.decode("utf-8", "replace") for part in lines[:2])
        if opcode == 0x93:
            texts = [bytes(self._buf[s + 2:e]) for s, e in self._tokens_before(at, TUPLE_WINDOW)
                     if self._buf[s] == 0x8C]
            names = [t.decode("utf-8", "replace") for t in texts]
            if len(names) >= 2:
                return f"{names[-2]}.{names[-1]}"
        return f"named by opcode 0x{opcode:02x}"

    def _vet_lines(self, at: int, lines: int) -> None:
        position = at + 1
        for _ in range(lines):
            newline = self._buf.find(b"\n", position)
            while newline < 0 and not self._eof:
                self._fill(keep=True)
                newline = self._buf.find(b"\n", position)
            if newline < 0:
                self._vetted = len(self._buf)  # truncated: the unpickler says so
                return
            position = newline + 1
        self._boundary(position)

    def _vet_put(self, at: int, opcode: int) -> None:
        if opcode == ord("r"):
            if not self._need(5):
                self._vetted = len(self._buf)
                return
            index = int.from_bytes(self._buf[at + 1:at + 5], "little")
            end = at + 5
        else:
            self._need(24)
            newline = self._buf.find(b"\n", at, at + 24)
            digits = self._buf[at + 1:newline] if newline > at else b""
            if not digits.isdigit():
                if len(self._buf) - at < 24:
                    self._vetted = len(self._buf)  # truncated: the unpickler says so
                    return
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
        # Look a little way back first (a pair of small ints); the full window only when needed.
        if not self._tuple_items_are_scalars(at, opcode, SHORT_TUPLE_WINDOW) and not (
            self._tuple_items_are_scalars(at, opcode, TUPLE_WINDOW)
        ):
            raise self._refuse(
                "a tuple of containers, strings, memo references or many items (a snapshot's "
                "tuples hold a few numbers; hashing the other kind can take forever)", at)
        self._boundary(at + 1)

    def _tokens_before(self, at: int, window: int) -> list[tuple[int, int]]:
        """(start, end) of the regex tokens that end exactly at ``at``, from about ``window``
        bytes back (empty when a payload or text line ends right before ``at``)."""
        start = self._boundaries[0] - self._base
        for boundary in reversed(self._boundaries):
            if boundary - self._base <= at - window:
                start = boundary - self._base
                break
        if start < at - window:  # a token start close before the window (C speed)
            start = _run_end(self._buf, start, at - window)
        tokens: list[tuple[int, int]] = []
        position = start
        while position < at:
            match = _ONE_TOKEN.match(self._buf, position, at)
            if match is None:  # a payload or a text line: restart at the token start after it
                later = [b - self._base for b in self._boundaries if position < b - self._base < at]
                if not later:
                    break
                tokens, position = [], later[0]
                continue
            tokens.append((position, match.end()))
            position = match.end()
        return tokens if position == at else []

    def _tuple_items_are_scalars(self, at: int, opcode: int, window: int) -> bool:
        tokens = self._tokens_before(at, window)
        if opcode in _TUPLE_SIZES:
            count = _TUPLE_SIZES[opcode]
            items = tokens[-count:] if len(tokens) >= count else None
        else:
            marks = [i for i, (s, _e) in enumerate(tokens) if self._buf[s] == ord("(")]
            items = tokens[marks[-1] + 1:] if marks else None
            if items is not None and len(items) > MAX_TUPLE_ITEMS:
                items = None
        return items is not None and all(_ONE_SCALAR.fullmatch(self._buf, s, e) for s, e in items)
