"""memlens for assistants: an MCP server over stdio (``memlens mcp``).

An assistant that holds a snapshot path can ask what the CLI answers: ``triage`` (the report),
``findings``, ``group_by`` (what was live at a moment, grouped), ``diff``, ``whatif`` and
``budget``. Each tool returns, as its text, the very JSON the matching ``memlens ... --json``
command prints: both are the answer of the same ``memlens.ops`` service; the tests compare them.

Every file a tool reads is opened once, by the server, and checked through that descriptor (a
regular file: a folder, a FIFO or a device is refused without waiting on it); under ``--root`` it
is opened beneath the root's folder descriptor following no symbolic link (``PathPolicy``). The
tool call itself then runs in a child process under a dashboard analysis's time and memory limits
(``ToolCalls``, ``memlens.ops.runner``) and reads those descriptors, the sidecar beside the snapshot
included: what is analysed is what was checked. Files go through the same safe loader as the CLI
(a pickle naming any global is refused before anything runs). Every failure is an MCP tool error
of one line (``is_error``), the CLI's error text, never a traceback, and every request gets an
answer (``_Wire``: lines the SDK would drop, calls in flight when stdin closes).

The payload functions (``Tools``) need no MCP SDK; ``build_server`` imports it
(``pip install 'memlens[mcp]'``). Each tool is declared once, as a ``Tools`` method: its
parameters (described with ``Doc``) and its docstring are what the SDK publishes.

No ``from __future__ import annotations`` here: the server hands the SDK each method's parameter
types, which must be objects (``Annotated[..., Doc(...)]``, rewritten for the SDK), not strings.
"""

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import re
import sys
import threading
import time
import typing
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from memlens.errors import MemlensUsageError
from memlens.files import FileRefused, OpenedFile, open_beneath, open_regular
from memlens.ops.errors import describe
from memlens.ops.runner import DEFAULT_PRELOAD, Crashed, Limits, ProcessGroup, run_limited
from memlens.printable import printable
from memlens.units import MAX_SPLIT_SIZE_MB, MAX_WHOLE, parse_capacity, parse_real, parse_whole

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis
    from memlens.analysis.lenses.rules import Rule
    from memlens.analysis.report import Report

log = logging.getLogger("memlens.mcp")

SERVER_NAME = "memlens"
INSTRUCTIONS = (
    "memlens reads PyTorch CUDA memory snapshots (torch.cuda.memory._dump_snapshot pickles) and says "
    "where GPU memory went. Start with `triage` on a snapshot path (peak, steps, categories at the peak, "
    "findings such as leaks, activation plateaus, optimizer spikes, fragmentation and OOMs, each with "
    "evidence, stacks and a fix). `group_by` shows what was live at the peak or any moment grouped by "
    "category, annotation, module, file, frame, stack or user rules; `diff` compares two snapshots; "
    "`whatif` replays one with other allocator settings; `budget` estimates what a training step should "
    "need. Paths are on the machine running the server; give them absolute."
)
# Analyses kept for the next call on the same file (an assistant asks triage, then findings, then
# a group-by): two, since one analysis of a million-event file holds a few hundred MB.
KEPT_ANALYSES = 2
KEPT_ANALYSES_BYTES = 1 << 30  # as Analysis.held_bytes estimates them
ERROR_CHARS = 500


# --------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class _Root:
    """A folder the tools may read: held open for the server's life, so replacing the path
    changes nothing; matched by both the spelling given and the resolved one."""

    spellings: tuple[str, ...]
    fd: int


class PathPolicy:
    """Which files the tools may read, and how each is opened (once: what is read is what was
    checked). Without roots: any regular file this user can read (links followed, as a shell
    would). With roots: only files beneath them, opened component by component from the root's
    descriptor following no symbolic link (a link is refused, even one that points inside: the
    server cannot tell where it would lead by the time the file is read). Opening never blocks
    (a FIFO is refused, not waited on), and every file is a regular one of bounded size."""

    def __init__(self, roots: Sequence[_Root] = ()) -> None:
        self._roots = tuple(roots)

    @classmethod
    def for_roots(cls, roots: Sequence[str | os.PathLike[str]]) -> "PathPolicy":
        opened = []
        for root in roots:
            given = os.path.abspath(os.path.expanduser(os.fspath(root)))
            resolved = os.path.realpath(given)
            try:
                fd = os.open(resolved, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                raise MemlensUsageError(f"--root {printable(root)}: no such folder") from None
            opened.append(_Root(tuple(dict.fromkeys((given, resolved))), fd))
        return cls(opened)

    @property
    def roots(self) -> tuple[Path, ...]:
        return tuple(Path(root.spellings[-1]) for root in self._roots)

    def open(self, text: str, what: str = "snapshot", max_bytes: int | None = None) -> OpenedFile:
        """``text`` opened and checked, as an ``OpenedFile`` (the caller closes it), or a
        one-line ``MemlensUsageError``."""
        if not isinstance(text, str) or not text.strip() or "\x00" in text:
            raise MemlensUsageError(f"{what}: give the path of a file")
        name = str(Path(text).expanduser())
        shown = printable(text, 300)
        try:
            if not self._roots:
                return open_regular(name, max_bytes=max_bytes)
            # Lexically normalised: ".." cannot climb through a link, since none is followed below a root.
            path = os.path.abspath(name)
            for root in self._roots:
                for spelling in root.spellings:
                    inside = spelling.rstrip(os.sep) + os.sep
                    if path == spelling or path.startswith(inside):
                        return open_beneath(root.fd, path[len(inside):], name, max_bytes=max_bytes)
        except FileRefused as refused:
            reason = refused.reason
            if reason in ("a folder", "not a regular file"):
                reason += "; give the path of a snapshot file"
            elif reason == "not a file beneath the folder":
                reason = "a folder; give the path of a snapshot file"
            raise MemlensUsageError(f"{what} {shown}: {reason}") from None
        allowed = ", ".join(printable(str(root), 200) for root in self.roots)
        raise MemlensUsageError(f"{what} {shown}: outside the folders this server may read ({allowed})")


class _PreOpened:
    """The files a tool call's parent opened and checked, handed to the child that runs it: the
    child reads those descriptors and opens nothing by name."""

    def __init__(self, files: dict[tuple[str, str], OpenedFile]) -> None:
        self.files = files

    def open(self, text: str, what: str = "snapshot", max_bytes: int | None = None) -> OpenedFile:
        opened = self.files.get((what, text))
        if opened is None:  # a path argument missing from PATH_ARGUMENTS: a bug, said plainly
            raise MemlensUsageError(f"{what} {printable(text, 300)}: not opened for this call")
        return opened


# Each tool argument that names a file, with the word its messages use for it.
PATH_ARGUMENTS = {"snapshot": "snapshot", "before": "before", "after": "after", "rules": "rules", "config": "config"}
CONFIG_MAX_BYTES = 16 << 20  # a config.json is a few kilobytes


# --------------------------------------------------------------------------- analyses, kept

AnalysisKey = tuple[Any, ...]


class _Analyses:
    """Analyses of recently asked files, keyed by the name asked, the opened file's identity (so
    an edited file is read again) and the capacity asked for; safe to use from the SDK's worker
    threads. A tool call runs in a child process: the parent hands it the analyses it keeps for
    the files of the call (``matching``), and keeps the ones the child built (``added``)."""

    def __init__(self, kept: int = KEPT_ANALYSES, known: dict[AnalysisKey, "Analysis"] | None = None) -> None:
        self.kept = kept
        self.entries: OrderedDict[AnalysisKey, Analysis] = OrderedDict(known or {})
        self.added: dict[AnalysisKey, Analysis] = {}
        self.lock = threading.Lock()

    @staticmethod
    def key(opened: OpenedFile, capacity: int | None) -> AnalysisKey:
        return (opened.name, *opened.identity(), capacity)

    def get(self, opened: OpenedFile, capacity: int | None) -> "Analysis":
        from memlens.ops.triage import TriageOptions, analyse

        key = self.key(opened, capacity)
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        # As ``memlens triage`` does: every device analysed, the file's cache used as the CLI uses it.
        analysis = analyse(opened, TriageOptions(capacity=capacity))
        with self.lock:
            self.store({key: analysis})
            self.added[key] = analysis
        return analysis

    def store(self, analyses: dict[AnalysisKey, "Analysis"]) -> None:
        self.entries.update(analyses)
        for key in analyses:
            self.entries.move_to_end(key)
        # By count and by bytes, oldest first; the newest stays (it answers the call that made it).
        while len(self.entries) > 1 and (len(self.entries) > self.kept or sum(
                kept.held_bytes() for kept in self.entries.values()) > KEPT_ANALYSES_BYTES):
            self.entries.popitem(last=False)

    def matching(self, files: Sequence[OpenedFile]) -> dict[AnalysisKey, "Analysis"]:
        """The kept analyses of these files as they are now (any capacity)."""
        wanted = {(f.name, *f.identity()) for f in files}
        with self.lock:
            return {key: analysis for key, analysis in self.entries.items() if key[:-1] in wanted}


def _capacity(text: str | int | None) -> int | None:
    """A device size with its unit (80GiB, 24GB), read as the CLI's --capacity reads it
    (``memlens.units.parse_capacity``): a bare number, a JSON number among them, asks for a unit,
    and 0 B or more than 1 EiB is refused before any engine sees it."""
    return None if text is None else parse_capacity(text, "capacity")


def _whole(value: int | None, name: str, minimum: int | None = 1, maximum: int | None = MAX_WHOLE) -> int | None:
    """A whole-number argument, checked as the CLI's options are (memlens.units.parse_whole): the
    JSON may carry 1e400 (inf), 5,000-digit numbers or 0 where a count divides."""
    return None if value is None else parse_whole(value, name, minimum, maximum)


def _real(value: float | None, name: str, minimum: float | None = None,
          maximum: float | None = None) -> float | None:
    return None if value is None else parse_real(value, name, minimum, maximum)


def _flag(value: bool | None, name: str) -> bool | None:
    """A true/false argument: the CLI's flag is one, so "yes" or 1 from JSON is refused, never
    passed on to an engine that takes only a bool."""
    if value is not None and not isinstance(value, bool):
        raise MemlensUsageError(f"{name} must be true or false, not {printable(repr(value), 60)}")
    return value


def _device(value: int | None) -> int | None:
    return _whole(value, "device", 0, 1023)


# --------------------------------------------------------------------------- what each tool returns


@dataclass(frozen=True)
class Doc:
    """What a tool argument means, for the assistant: each tool's parameters are declared once,
    on ``Tools``, and ``build_server`` hands the SDK this text as the argument's description
    (pydantic's ``Field(description=...)``; this module needs no SDK and no pydantic)."""

    text: str


Snapshot = Annotated[str, Doc("Path of a snapshot file (.pickle or .pickle.gz) on the server's machine; absolute "
                              "is safest")]
Device = Annotated[int | None, Doc("CUDA device index (default: the busiest)")]
Capacity = Annotated[str | int | None, Doc("Device memory with its unit, e.g. 80GiB or 24GB (default: the "
                                           "recorder's sidecar, if any)")]
# The tools, in the order the server lists them: each a method of ``Tools``.
TOOL_NAMES = ("triage", "findings", "group_by", "diff", "whatif", "budget")



@dataclass
class Tools:
    """The payload behind each tool: the dict ``memlens <command> --json`` prints."""

    paths: PathPolicy | _PreOpened = dataclasses.field(default_factory=PathPolicy)
    analyses: _Analyses = dataclasses.field(default_factory=_Analyses)

    def triage(self, snapshot: Snapshot, device: Device = None, capacity: Capacity = None,
               params: Annotated[str | float | None, Doc("Budget: parameter count (7e9, 7B, 350M); default: the "
                                                         "recorder's sidecar")] = None,
               optimizer: Annotated[str | None, Doc("Budget: adamw, sgd, adam-8bit, ...")] = None,
               precision: Annotated[str | None, Doc("Budget: fp32, bf16-mixed, bf16, ...")] = None,
               hidden: int | None = None, layers: int | None = None, heads: int | None = None,
               vocab: int | None = None, batch: int | None = None, seq: int | None = None,
               checkpointing: Annotated[str | None, Doc("Budget: none, full, selective or every:K")] = None,
               ) -> dict[str, Any]:
        """The report `memlens triage SNAPSHOT --json` prints (the budget arguments are its budget
        flags): per device the peak allocated and reserved (event, time, step), steps, bytes by
        category at the peak with top stacks, the findings (leak, activation_plateau,
        optimizer_spike, fragmentation, oom), each with severity, bytes, evidence, stacks, a
        recommendation and the estimated saving, and the budget beside the measurement where the
        arguments or the recorder's sidecar describe the model (per category: theory, measured,
        ratio, verdict)."""
        return self._report(snapshot, device, capacity, params, optimizer, precision, hidden, layers, heads, vocab,
                            batch, seq, checkpointing).to_json()

    def _report(self, snapshot: str, device: int | None = None, capacity: str | int | None = None,
                params: str | float | None = None, optimizer: str | None = None, precision: str | None = None,
                hidden: int | None = None, layers: int | None = None, heads: int | None = None,
                vocab: int | None = None, batch: int | None = None, seq: int | None = None,
                checkpointing: str | None = None) -> "Report":
        """The typed report `memlens triage --json` prints, the budget from the sidecar included."""
        from memlens.ops.budget import BudgetOptions
        from memlens.ops.triage import TriageOptions, triage_analysis
        from memlens.units import parse_count

        budget = BudgetOptions(
            params=parse_count(str(params)) if params is not None else None, optimizer=optimizer, precision=precision,
            hidden=_whole(hidden, "hidden"), layers=_whole(layers, "layers"), heads=_whole(heads, "heads"),
            vocab=_whole(vocab, "vocab"), batch=_whole(batch, "batch"), seq=_whole(seq, "seq"),
            checkpointing=checkpointing)
        options = TriageOptions(capacity=_capacity(capacity), device=_device(device), budget=budget)
        with self.paths.open(snapshot) as opened:
            analysis = self.analyses.get(opened, options.capacity)
        return triage_analysis(analysis, options)

    def findings(self, snapshot: Snapshot, device: Device = None, capacity: Capacity = None,
                 kinds: Annotated[list[str] | None, Doc("Only these kinds: leak, activation_plateau (or activations), "
                                                        "optimizer_spike (or optimizer), fragmentation, oom")] = None,
                 ) -> dict[str, Any]:
        """The findings of `memlens triage --json` (most severe first), as {source, findings}:
        every device's, or one device's with `device`."""
        from memlens.ops.triage import findings
        from memlens.ops.vocab import parse_kinds

        wanted = parse_kinds(kinds or [])
        device = _device(device)
        return findings(self._report(snapshot, device, capacity), device, wanted).to_json()

    def group_by(self, snapshot: Snapshot,
                 group_by: Annotated[str, Doc("category, annotation, compile_context, module, file, frame, stack or "
                                              "rules")] = "category",
                 device: Device = None,
                 at: Annotated[str | None, Doc("The moment: an event index (1234), a time (1234567us, or +1.5s "
                                               "since the first row) or stepN; default: the peak")] = None,
                 window: Annotated[str | None, Doc("The peak within rows A:B (events, times or steps)")] = None,
                 step: Annotated[int | None, Doc("The peak within step N")] = None,
                 rules: Annotated[str | None, Doc("Path of a JSON or TOML rules file (name -> regular expression "
                                                  "over the stack, first match wins), for group_by=rules")] = None,
                 file: Annotated[str | None, Doc("Also bytes by line of this source file (matched on the end of "
                                                 "the path)")] = None) -> dict[str, Any]:
        """What was live at the peak (or a moment, window or step) grouped, as `memlens group
        SNAPSHOT --by G --json` prints it; the groups add up to the allocated bytes then."""
        from memlens.ops.group import (
            GROUP_BYS,
            MAX_RULES_FILE_BYTES,
            GroupOptions,
            LinesOptions,
            group,
            lines,
            rules_from_opened,
        )
        from memlens.ops.moments import moment_from_text

        device, step = _device(device), _whole(step, "step", 0)
        if group_by not in GROUP_BYS:
            raise MemlensUsageError(f"group_by {printable(group_by, 100)}: use one of {', '.join(GROUP_BYS)}")
        moment = moment_from_text(at, window, step, names=("at", "window", "step"))
        loaded_rules: tuple[Rule, ...] = ()
        if rules is not None:
            with self.paths.open(rules, "rules", MAX_RULES_FILE_BYTES) as opened_rules:
                loaded_rules = rules_from_opened(opened_rules)
        if group_by == "rules" and not loaded_rules:
            raise MemlensUsageError("group_by 'rules' needs rules: the path of a JSON or TOML rules file")
        with self.paths.open(snapshot) as opened:
            analysis = self.analyses.get(opened, None)
        # The device ``memlens group`` picks by default (the report's: the highest peak), from the
        # kept analysis: the same lifetimes, categories and steps.
        payload = group(analysis, GroupOptions(by=group_by, moment=moment, rules=loaded_rules,
                                               device=device)).to_json()
        if file:
            payload["file"] = lines(analysis, LinesOptions(path=file, moment=moment, device=device)).to_json()["file"]
        return payload

    def diff(self, before: Annotated[str, Doc("Path of the earlier snapshot")],
             after: Annotated[str, Doc("Path of the later snapshot")],
             device: Device = None,
             top: Annotated[int, Doc("Stacks to list (1-100)")] = 10,
             file: Annotated[str | None, Doc("Also per-line growth of this source file")] = None,
             ) -> dict[str, Any]:
        """What grew between two snapshots, as `memlens diff BEFORE AFTER --json` prints it: the
        peaks, each category at the peak, the stacks that changed most, the findings of each."""
        from memlens.ops.diff import DiffOptions, diff_analyses

        options = DiffOptions(device=_device(device), top=_whole(top, "top", 1, 100) or 10, file=file)
        with self.paths.open(before, "before") as opened:
            analysis_before = self.analyses.get(opened, None)
        with self.paths.open(after, "after") as opened:
            analysis_after = self.analyses.get(opened, None)
        return diff_analyses(analysis_before, analysis_after, options).to_json()

    def whatif(self, snapshot: Snapshot,
               expandable_segments: Annotated[bool | None, Doc("Simulate expandable_segments:True (false: force it "
                                                               "off)")] = None,
               max_split_size_mb: Annotated[int | None, Doc("max_split_size_mb (> 20)")] = None,
               garbage_collection_threshold: Annotated[float | None, Doc("garbage_collection_threshold in (0, 1); "
                                                                         "needs capacity")] = None,
               capacity: Capacity = None, device: Device = None) -> dict[str, Any]:
        """Replay the snapshot through memlens' caching-allocator simulator with other settings,
        as `memlens whatif --json` prints it: recorded and simulated peak reserved, fragmentation,
        cudaMalloc calls and whether (and where) it runs out of memory within capacity."""
        from memlens.ops.whatif import WhatIfOptions, whatif

        options = WhatIfOptions(
            expandable_segments=_flag(expandable_segments, "expandable_segments"),
            max_split_size_mb=_whole(max_split_size_mb, "max_split_size_mb", 0, MAX_SPLIT_SIZE_MB),
            garbage_collection_threshold=_real(garbage_collection_threshold, "garbage_collection_threshold", 0.0, 1.0),
            capacity=_capacity(capacity), device=_device(device))
        with self.paths.open(snapshot) as opened:
            return whatif(opened, options).to_json()

    def budget(self, params: Annotated[str | float | None, Doc("Parameter count: 7e9, 7B, 350M")] = None,
               hidden: int | None = None, layers: int | None = None, heads: int | None = None,
               kv_heads: int | None = None, vocab: int | None = None, ffn: int | None = None,
               tie_embeddings: bool = False,
               config: Annotated[str | None, Doc("Path of a transformers config.json")] = None,
               precision: Annotated[str, Doc("fp32, bf16-mixed, fp16-mixed, bf16, fp16")] = "bf16-mixed",
               optimizer: Annotated[str, Doc("sgd, sgd-momentum, adam, adamw, adam-8bit, adafactor, muon, "
                                             "galore")] = "adamw",
               optim_dtype: str = "fp32", grad_dtype: str | None = None, galore_rank: int | None = None,
               lora_rank: int | None = None, lora_targets: str = "q_proj,v_proj", qlora: bool = False,
               frozen_layers: int = 0, batch: int = 1, seq: int | None = None, grad_accum: int = 1,
               checkpointing: Annotated[str, Doc("none, full, selective or every:K")] = "none",
               flash_attn: bool = True,
               activations: Annotated[str, Doc("megatron, hf-eager or rule-of-thumb")] = "megatron",
               chunked_loss: float | None = None, zero: int = 0, world_size: int = 1,
               offload_optimizer: bool = False, offload_params: bool = False,
               capacity: Annotated[list[str | float] | None, Doc(
                   "Device sizes to check the fit against, each with its unit, e.g. [\"80GB\", \"24GiB\"] (a "
                   "bare number asks for a unit, as --capacity does)")] = None,
               ) -> dict[str, Any]:
        """The theoretical memory of a training step, as `memlens budget --json` prints it (the
        arguments are its flags): weights, gradients, master weights, optimizer state,
        activations and logits in bytes, the totals, and for each capacity whether it fits and the
        largest micro-batch that does."""
        with contextlib.ExitStack() as files:
            opened_config = (files.enter_context(self.paths.open(config, "config", CONFIG_MAX_BYTES))
                             if config is not None else None)
            return self._budget(opened_config, params, hidden, layers, heads, kv_heads, vocab, ffn, tie_embeddings,
                                precision, optimizer, optim_dtype, grad_dtype, galore_rank, lora_rank, lora_targets,
                                qlora, frozen_layers, batch, seq, grad_accum, checkpointing, flash_attn, activations,
                                chunked_loss, zero, world_size, offload_optimizer, offload_params, capacity)

    def _budget(self, config: OpenedFile | None, params: str | float | None, hidden: int | None, layers: int | None,
                heads: int | None, kv_heads: int | None, vocab: int | None, ffn: int | None, tie_embeddings: bool,
                precision: str, optimizer: str, optim_dtype: str, grad_dtype: str | None, galore_rank: int | None,
                lora_rank: int | None, lora_targets: str, qlora: bool, frozen_layers: int, batch: int,
                seq: int | None, grad_accum: int, checkpointing: str, flash_attn: bool, activations: str,
                chunked_loss: float | None, zero: int, world_size: int, offload_optimizer: bool,
                offload_params: bool, capacity: list[str | float] | None) -> dict[str, Any]:
        from memlens.ops.budget import BudgetOptions, estimate_budget
        hidden, layers, heads, kv_heads, vocab, ffn, galore_rank, lora_rank, seq = (
            _whole(value, name) for value, name in (
                (hidden, "hidden"), (layers, "layers"), (heads, "heads"), (kv_heads, "kv_heads"), (vocab, "vocab"),
                (ffn, "ffn"), (galore_rank, "galore_rank"), (lora_rank, "lora_rank"), (seq, "seq")))
        batch, grad_accum, world_size = (_whole(value, name) or 1 for value, name in (
            (batch, "batch"), (grad_accum, "grad_accum"), (world_size, "world_size")))
        frozen_layers, zero = _whole(frozen_layers, "frozen_layers", 0) or 0, _whole(zero, "zero", 0, 3) or 0
        chunked_loss = _real(chunked_loss, "chunked_loss", 1.0)
        result = estimate_budget(BudgetOptions(
            params=str(params) if params is not None else None, hidden=hidden, layers=layers, heads=heads,
            kv_heads=kv_heads, vocab=vocab, ffn=ffn, tie_embeddings=tie_embeddings,
            precision=precision, optimizer=optimizer, optim_dtype=optim_dtype, grad_dtype=grad_dtype,
            galore_rank=galore_rank, lora_rank=lora_rank, lora_targets=lora_targets, qlora=qlora,
            frozen_layers=frozen_layers, batch=batch, seq=seq, grad_accum=grad_accum, checkpointing=checkpointing,
            flash_attn=flash_attn, activation_formula=activations, chunked_loss=chunked_loss, zero_stage=zero,
            world_size=world_size, offload_optimizer=offload_optimizer, offload_params=offload_params),
            config_file=config)
        payload = result.to_json()
        # A JSON number is echoed as the CLI echoes the same text (80, not 80.0).
        labels = [size if isinstance(size, str) else f"{size:g}" for size in capacity or []]
        payload["capacities"] = [result.check(parse_capacity(label, "capacity"), label=label).to_json()
                                 for label in labels]
        return payload


def one_line_error(exc: BaseException) -> str:
    """What a tool error says: the one line of ``memlens.ops.errors`` (the CLI's words), a bug
    asking to be reported."""
    line = describe(exc, ERROR_CHARS)
    return f"{line.text} (please report it)" if line.kind == "bug" else line.text


# --------------------------------------------------------------------------- each call, limited

# The forkserver's children start with these imported (the tool code among them).
_PRELOAD = (*DEFAULT_PRELOAD, "memlens.mcp_server")
# Tool calls run at once (each a child process that may use the whole memory limit); more wait
# for a turn, the wait counting against the call's time limit.
CONCURRENT_CALLS = 2


class _Descriptor:
    """A file descriptor in a child's arguments: duplicated into the child when it is started."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_detached, (DupFd(self.fd),))


def _detached(duplicate: Any) -> int:
    return int(duplicate.detach())


class ToolCalls:
    """How the server runs each tool call, under the limits a dashboard analysis has: its files
    are opened and checked here (the path policy), and the call itself runs in a child process
    (``memlens.ops.runner``: a wall-clock deadline and an address-space cap) that reads those very
    descriptors. The analyses of recent files are kept here and handed to the child that needs
    them, so an assistant's triage-then-findings does not analyse twice."""

    def __init__(self, tools: Tools, limits: Limits, concurrent: int = CONCURRENT_CALLS) -> None:
        self.tools = tools
        self.limits = limits
        self.group = ProcessGroup()
        self.turns = threading.BoundedSemaphore(concurrent)
        self.concurrent = concurrent

    def run(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's text, or a one-line ``ToolError``."""
        from mcp.server.mcpserver.exceptions import ToolError

        wanted = inspect.signature(getattr(Tools, name)).parameters
        arguments = {key: value for key, value in arguments.items() if key in wanted and key != "self"}
        try:
            ok, text = self._run(name, arguments)
        except Exception as exc:  # every failure reaches the caller as one line, never a traceback
            if isinstance(exc, Crashed):
                log.warning("memlens mcp: the %s call failed: %s", name, printable(exc.last_line, 300))
            raise ToolError(one_line_error(exc)) from None
        if not ok:
            raise ToolError(text)
        return text

    def _run(self, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
        from memlens.ops.group import MAX_RULES_FILE_BYTES

        deadline = time.monotonic() + self.limits.timeout_s
        with contextlib.ExitStack() as files:
            opened = []
            for argument, what in PATH_ARGUMENTS.items():
                value = arguments.get(argument)
                if value is not None:
                    limit = {"rules": MAX_RULES_FILE_BYTES, "config": CONFIG_MAX_BYTES}.get(what)
                    opened.append((what, value, files.enter_context(self.tools.paths.open(value, what, limit))))
            known = self.tools.analyses.matching([file for _, _, file in opened])
            sent = [(what, value, file.name, _Descriptor(file.fd),
                     _Descriptor(file.folder_fd) if file.folder_fd is not None else None)
                    for what, value, file in opened]
            if not self.turns.acquire(timeout=self.limits.timeout_s):
                raise MemlensUsageError(f"busy: {self.concurrent} tool calls are running; try again shortly")
            try:
                left = max(0.1, deadline - time.monotonic())
                limits = dataclasses.replace(self.limits, timeout_s=left)
                ok, text, added = run_limited(_call_in_child, (name, arguments, sent, known), limits=limits,
                                              group=self.group, what="tool call", preload=_PRELOAD)
            finally:
                self.turns.release()
        with self.tools.analyses.lock:
            self.tools.analyses.store(added)
        return ok, text


def _call_in_child(name: str, arguments: dict[str, Any], sent: list[tuple[Any, ...]],
                   known: dict[AnalysisKey, "Analysis"]) -> tuple[bool, str, dict[AnalysisKey, "Analysis"]]:
    """Runs in the runner's child: the tool over the descriptors its parent opened; (ok, the
    text or the one-line error, the analyses built here for the parent to keep)."""
    from memlens.ops.runner import caused_by_memory_error
    from memlens.reporters.jsontext import json_text

    files = {(what, value): OpenedFile(fd, file_name, folder_fd) for what, value, file_name, fd, folder_fd in sent}
    tools = Tools(paths=_PreOpened(files), analyses=_Analyses(known=known))
    try:
        return True, json_text(getattr(tools, name)(**arguments)), tools.analyses.added
    except MemoryError:
        raise  # the sandbox says which limit stopped it
    except Exception as exc:
        if caused_by_memory_error(exc):
            raise
        return False, one_line_error(exc), tools.analyses.added


# --------------------------------------------------------------------------- the server


def build_server(roots: Sequence[str | os.PathLike[str]] = (), limits: Limits | None = None) -> Any:
    """An ``mcp`` ``MCPServer`` with the memlens tools (``roots``: the folders it may read; none:
    any path the server's user can read; ``limits``: each call's, by default a dashboard
    analysis's)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations
    from pydantic import Field

    from memlens._version import __version__

    calls = ToolCalls(Tools(paths=PathPolicy.for_roots(roots)), limits if limits is not None else Limits())
    server = MCPServer(SERVER_NAME, instructions=INSTRUCTIONS, version=__version__, log_level="WARNING",
                       middleware=[_one_line_tool_errors])
    read_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                                open_world_hint=False)

    for name in TOOL_NAMES:
        tool = _sdk_tool(calls, name, Field)
        # The docstring, dedented, is what the assistant reads; the text is the CLI's JSON, so no
        # output schema (structured_output=False).
        server.add_tool(tool, name=name, description=inspect.cleandoc(tool.__doc__ or ""), annotations=read_only,
                        structured_output=False)
    return server


def _sdk_tool(calls: ToolCalls, name: str, field: Callable[..., Any]) -> Callable[..., str]:
    """The tool ``name`` as the SDK reads it: ``Tools.<name>``'s own parameters (each ``Doc`` made
    the SDK's ``Field(description=...)``) and docstring, the call run by ``calls``."""
    method = getattr(Tools, name)
    parameters = [parameter.replace(annotation=_for_sdk(parameter.annotation, field))
                  for parameter in inspect.signature(method).parameters.values() if parameter.name != "self"]

    def tool(**arguments: Any) -> str:
        return calls.run(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = method.__doc__
    tool.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    return tool


def _for_sdk(annotation: Any, field: Callable[..., Any]) -> Any:
    """``Annotated[T, Doc(text)]`` as ``Annotated[T, field(description=text)]``; others unchanged."""
    if typing.get_origin(annotation) is not Annotated:
        return annotation
    base, *metadata = typing.get_args(annotation)
    return Annotated[(base, *(field(description=m.text) if isinstance(m, Doc) else m for m in metadata))]


async def _one_line_tool_errors(ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Server middleware: a failed tool call's text on one line. memlens' own errors already are;
    the SDK's report of arguments that fail the input schema (pydantic's) spans several. The
    chain hands middleware the result in its wire form (a dict)."""
    result = await call_next(ctx)
    if getattr(ctx, "method", None) == "tools/call" and isinstance(result, dict) and result.get("isError"):
        result = {**result, "content": [
            {**block, "text": _one_line(block["text"])}
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
            else block
            for block in result.get("content") or []]}
    return result


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not line.startswith("For further information")]
    return printable("; ".join(kept), ERROR_CHARS)


# --------------------------------------------------------------------------- the wire

# A JSON escape of a UTF-16 surrogate: lone ones are legal JSON text but not Unicode, and the
# SDK's parser refuses the whole message, which then goes unanswered.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# After stdin closes, how long calls still running may take to be answered, beyond their limit.
DRAIN_MARGIN_S = 30.0


def _without_lone_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every lone surrogate in its strings replaced by U+FFFD."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(key): _without_lone_surrogates(item) for key, item in value.items()}
    return value


class _Wire:
    """What sits between stdin/stdout and the SDK, so that every request is answered.

    * A line the SDK could not take gets its answer here: text that is not JSON a parse error
      (id null), a message that is not JSON-RPC an invalid-request error with its id. Without
      this the SDK logs it and the client waits for ever.
    * Strings holding a lone surrogate (``"\\ud800"``: valid JSON, invalid Unicode, refused by the
      SDK's parser) have it replaced by U+FFFD, so the request is answered as usual (a path
      with one names no file). A path whose bytes are not UTF-8 cannot be asked for by name.
    * When the client closes stdin, the requests still running are answered before the server
      exits (each within its time limit, the wait bounded by ``drain_s``).
    """

    def __init__(self, lines_in: Any, text_out: Any, drain_s: float) -> None:
        import anyio

        self._in = lines_in
        self._out = text_out
        self._write_lock = anyio.Lock()
        self._drain_s = drain_s
        self.pending: set[str] = set()

    # -- what the SDK reads (stdin)

    def __aiter__(self) -> "_Wire":
        return self

    async def __anext__(self) -> str:
        while True:
            line = await self._in.readline()
            if not line:
                await self._drain()
                raise StopAsyncIteration
            admitted = await self._admit(line)
            if admitted is not None:
                return admitted

    async def _admit(self, line: str) -> str | None:
        import mcp_types

        if not line.strip():
            return None
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            await self._answer_error(None, -32700, "Parse error: not JSON")
            return None
        if _SURROGATE_ESCAPE.search(line):
            message = _without_lone_surrogates(message)
            line = json.dumps(message, ensure_ascii=False) + "\n"
        request_id = message.get("id") if isinstance(message, dict) else None
        try:
            mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except Exception:
            is_request = isinstance(message, dict) and "method" in message
            if request_id is not None or not is_request:  # a notification is never answered
                plain_id = isinstance(request_id, str | int) and not isinstance(request_id, bool)
                valid_id = request_id if plain_id else None
                await self._answer_error(valid_id, -32600, "Invalid Request: not a JSON-RPC 2.0 message")
            return None
        if isinstance(message, dict) and "method" in message and request_id is not None:
            self.pending.add(json.dumps(request_id))
        elif isinstance(message, dict) and message.get("method") == "notifications/cancelled":
            cancelled = (message.get("params") or {}).get("requestId")
            self.pending.discard(json.dumps(cancelled))  # the SDK sends no answer to a cancelled call
        return line

    async def _drain(self) -> None:
        import anyio

        with anyio.move_on_after(self._drain_s):
            while self.pending:
                await anyio.sleep(0.05)

    # -- what the SDK writes (stdout)

    async def write(self, text: str) -> None:
        async with self._write_lock:
            await self._out.write(text)
            await self._out.flush()
        for line in text.splitlines():
            answered = _answered_id(line)
            if answered is not None:
                self.pending.discard(answered)

    async def flush(self) -> None:
        async with self._write_lock:
            await self._out.flush()

    async def _answer_error(self, request_id: Any, code: int, text: str) -> None:
        await self.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": text}})
                         + "\n")


# How the SDK writes an answer's head (its models' field order): read without parsing the rest,
# which may be megabytes of report.
_ANSWER_HEAD = re.compile(r'\{"jsonrpc":"2\.0","id":(-?\d+|"(?:[^"\\]|\\.)*"),"(?:result|error)"')


def _answered_id(line: str) -> str | None:
    """The id (as ``json.dumps`` writes it) of the request ``line`` answers, if it is an answer."""
    head = _ANSWER_HEAD.match(line)
    try:
        if head is not None:
            return json.dumps(json.loads(head.group(1)))
        message = json.loads(line)
    except ValueError:
        return None
    if isinstance(message, dict) and "method" not in message and "id" in message:
        return json.dumps(message["id"])
    return None


async def _serve_stdio(server: Any, wire_in: int, wire_out: int, drain_s: float) -> None:
    import io

    import anyio
    from mcp.server.stdio import stdio_server

    lines_in = anyio.wrap_file(io.TextIOWrapper(os.fdopen(wire_in, "rb", closefd=False), encoding="utf-8",
                                                errors="replace"))
    text_out = anyio.wrap_file(io.TextIOWrapper(os.fdopen(wire_out, "wb", closefd=False), encoding="utf-8"))
    wire = _Wire(lines_in, text_out, drain_s)
    async with stdio_server(stdin=wire, stdout=wire) as (read_stream, write_stream):  # type: ignore[arg-type]
        # MCPServer.run_stdio_async is this with the SDK's own streams, which drop what they cannot parse.
        lowlevel = server._lowlevel_server
        await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


def serve(roots: Sequence[str | os.PathLike[str]] = (), limits: Limits | None = None) -> None:
    """Answer MCP requests on stdin/stdout until the client closes them (and every request it
    sent is answered)."""
    import anyio

    limits = limits if limits is not None else Limits()
    server = build_server(roots, limits)
    # The wire is served from private duplicates; meanwhile fd 0 reads the null device and fd 1
    # writes to stderr, so nothing a call prints (or a child inherits) can tear a message.
    wire_in, wire_out = os.dup(0), os.dup(1)
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
        anyio.run(_serve_stdio, server, wire_in, wire_out, limits.timeout_s + DRAIN_MARGIN_S)
    finally:
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        for fd in (null, saved_in, saved_out, wire_in, wire_out):
            with contextlib.suppress(OSError):
                os.close(fd)
