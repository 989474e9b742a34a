"""Fair turns at the analysis workers for the browser sessions sharing one server.

A plain semaphore serves whoever asked first: six slow uploads from one visitor made a
500-byte upload from another wait 88 s behind them. Here each session has its own line:

- a session may have at most ``per_session`` jobs waiting or running; one more is refused at
  once with ``ServerBusy`` ("busy, try again"), and so is any job while ``max_waiting`` jobs
  are already waiting in all;
- a session is only a cookie, and a client that drops it is a new session with every request
  (30 of 30 such uploads were let in, and another visitor's small upload waited 5-28 s behind
  them), so one network address may also have at most ``per_address`` jobs waiting or running
  (``AddressBusy``, answered 429);
- a free worker goes to the waiting job of the address with the fewest jobs running, then of
  the session with the fewest running, then to the session served least recently (round robin;
  a newcomer first), so a newcomer is served before a busy session's or a busy address's later
  jobs however many sessions those are spread over;
- a job waits at most ``wait_s`` for its turn, then is answered ``ServerBusy`` rather than left
  waiting: with the run's own time limit, every job is answered within ``wait_s`` plus that.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from memlens.errors import MemlensError

# Jobs one session may have waiting or running (a page load asks for one analysis; the ranks
# tab asks for two at a time).
DEFAULT_PER_SESSION = 4
# Jobs one network address may have waiting or running: two browsers' shares (a lab behind one
# NAT shares it), so that a client which sends no cookie has no more than that.
DEFAULT_PER_ADDRESS = 2 * DEFAULT_PER_SESSION
# Jobs waiting in all sessions together before new ones are refused.
DEFAULT_MAX_WAITING = 64
DEFAULT_WAIT_S = 120.0


class ServerBusy(MemlensError):
    """No worker for this job now: the user should try again in a moment (not the file's fault)."""


class AddressBusy(ServerBusy):
    """This network address already has its share of the server's work (HTTP 429)."""


@dataclass(eq=False)
class _Ticket:
    session: str
    address: str
    seq: int
    granted: bool = field(default=False)


@dataclass(frozen=True)
class QueueState:
    """What one session may know of the queue: its own jobs, and how many wait in all."""

    running: int
    waiting: int
    waiting_in_all: int


class FairQueue:
    """``slots`` workers shared round the sessions (see the module's docstring)."""

    def __init__(self, slots: int, *, per_session: int = DEFAULT_PER_SESSION,
                 per_address: int = DEFAULT_PER_ADDRESS, max_waiting: int = DEFAULT_MAX_WAITING,
                 wait_s: float = DEFAULT_WAIT_S) -> None:
        self.slots = max(1, slots)
        self.per_session = max(1, per_session)
        self.per_address = max(1, per_address)
        self.max_waiting = max(0, max_waiting)
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._free = self.slots
        self._waiting: dict[str, deque[_Ticket]] = {}
        self._running: Counter[str] = Counter()
        # Jobs waiting or running, and jobs running, by network address.
        self._address_jobs: Counter[str] = Counter()
        self._address_running: Counter[str] = Counter()
        # When each session with work here was last given a worker (for the round robin).
        self._last_served: dict[str, int] = {}
        self._seq = itertools.count()
        self._grants = itertools.count()

    def state(self, session: str) -> QueueState:
        with self._cond:
            return QueueState(self._running[session], len(self._waiting.get(session, ())), self._waiting_total())

    def _waiting_total(self) -> int:
        return sum(len(line) for line in self._waiting.values())

    @contextlib.contextmanager
    def turn(self, session: str, what: str = "this analysis", address: str = "") -> Iterator[None]:
        """Hold a worker for ``session`` (a client at ``address``; "" for the server's own work)
        while the block runs; ``ServerBusy`` when none comes."""
        self._acquire(session, what, address)
        try:
            yield
        finally:
            with self._cond:
                self._running[session] -= 1
                if self._running[session] <= 0:
                    del self._running[session]
                    if session not in self._waiting:
                        self._last_served.pop(session, None)  # nothing left here: forget it
                _decrement(self._address_running, address)
                _decrement(self._address_jobs, address)
                self._free += 1
                self._grant()

    def _acquire(self, session: str, what: str, address: str) -> None:
        with self._cond:
            mine = self._running[session] + len(self._waiting.get(session, ()))
            if mine >= self.per_session:
                raise ServerBusy(f"busy: {what} waits for your {mine} earlier jobs on this server "
                                 f"(at most {self.per_session} at once); try again when they are done")
            if address and self._address_jobs[address] >= self.per_address:
                raise AddressBusy(f"busy: {what} waits for {self._address_jobs[address]} earlier jobs from your "
                                  f"network address (at most {self.per_address} at once); try again when "
                                  "they are done")
            if self._free > 0 and not self._waiting:
                self._free -= 1
                self._running[session] += 1
                self._address_jobs[address] += 1
                self._address_running[address] += 1
                self._last_served[session] = next(self._grants)
                return
            if self._waiting_total() >= self.max_waiting:
                raise ServerBusy(f"the server is busy ({self._waiting_total()} jobs waiting): "
                                 "try again in a moment")
            ticket = _Ticket(session, address, next(self._seq))
            self._waiting.setdefault(session, deque()).append(ticket)
            self._address_jobs[address] += 1
            self._grant()
            deadline = time.monotonic() + self.wait_s
            while not ticket.granted:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if ticket.granted:
                return
            line = self._waiting[session]
            line.remove(ticket)
            _decrement(self._address_jobs, address)
            if not line:
                del self._waiting[session]
                if not self._running[session]:
                    self._last_served.pop(session, None)
            raise ServerBusy(f"the server is busy: {what} waited {self.wait_s:g} s for a free worker; "
                             "try again in a moment")

    def _grant(self) -> None:
        """Hand free workers to waiting sessions: the address with fewest running first, then the
        session with fewest running, then the one served least recently, then the oldest waiting
        job (caller holds the lock)."""
        granted = False
        while self._free > 0 and self._waiting:
            session = min(self._waiting, key=lambda s: (self._address_running[self._waiting[s][0].address],
                                                        self._running[s], self._last_served.get(s, -1),
                                                        self._waiting[s][0].seq))
            line = self._waiting[session]
            ticket = line.popleft()
            if not line:
                del self._waiting[session]
            ticket.granted = True
            self._free -= 1
            self._running[session] += 1
            self._address_running[ticket.address] += 1
            self._last_served[session] = next(self._grants)
            granted = True
        if granted:
            self._cond.notify_all()


def _decrement(counter: Counter[str], key: str) -> None:
    """One less of ``key``, forgotten at zero (the counters stay as small as the work in flight)."""
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
