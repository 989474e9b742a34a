"""memlens for assistants: an MCP server over stdio (``memlens mcp``).

An assistant that holds a snapshot path can ask what the CLI answers: ``triage`` (the report),
``findings``, ``group_by`` (what was live at a moment, grouped), ``diff``, ``whatif`` and
``budget``. Each tool returns, as its text, the very JSON the matching ``memlens ... --json``
command prints, built by the same functions; the tests compare them.

Paths are checked before anything is read: a regular file that exists and is readable (a folder,
a FIFO or a device is refused: reading ``/dev/zero`` would never end), inside the ``--root``
folders when the server was started with any. Files go through the same safe loader as the CLI
(a pickle naming any global is refused before anything runs). Every failure is an MCP tool error
of one line (``is_error``), the CLI's error text, never a traceback.

The payload functions (``triage_payload`` and the rest) need no MCP SDK; ``build_server`` imports
it (``pip install 'memlens[mcp]'``).

No ``from __future__ import annotations`` here: the SDK reads each tool's parameter types from
its annotations, which must be objects, not strings naming ``build_server``'s local aliases.
"""

import dataclasses
import inspect
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from memlens.errors import MemlensError, MemlensUsageError
from memlens.printable import printable
from memlens.units import MAX_WHOLE, parse_real, parse_whole

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis

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
ERROR_CHARS = 500


# --------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PathPolicy:
    """Which files the tools may read: existing, readable regular files, inside ``roots`` if any."""

    roots: tuple[Path, ...] = ()

    @classmethod
    def for_roots(cls, roots: Sequence[str | os.PathLike[str]]) -> "PathPolicy":
        resolved = []
        for root in roots:
            path = Path(root).expanduser().resolve()
            if not path.is_dir():
                raise MemlensUsageError(f"--root {printable(root)}: no such folder")
            resolved.append(path)
        return cls(tuple(resolved))

    def check(self, text: str, what: str = "snapshot") -> str:
        """``text`` as the path to open (``~`` expanded), or a one-line ``MemlensUsageError``."""
        if not isinstance(text, str) or not text.strip() or "\x00" in text:
            raise MemlensUsageError(f"{what}: give the path of a file")
        path = Path(text).expanduser()
        resolved = path.resolve()
        shown = printable(text, 300)
        if self.roots and not any(resolved.is_relative_to(root) for root in self.roots):
            allowed = ", ".join(printable(str(root), 200) for root in self.roots)
            raise MemlensUsageError(f"{what} {shown}: outside the folders this server may read ({allowed})")
        try:
            st = os.stat(resolved)
        except FileNotFoundError:
            raise MemlensUsageError(f"{what} {shown}: no such file") from None
        except OSError as exc:
            raise MemlensUsageError(f"{what} {shown}: cannot be read ({exc.strerror or type(exc).__name__})") from None
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise MemlensUsageError(f"{what} {shown}: {kind}; give the path of a snapshot file")
        if not os.access(resolved, os.R_OK):
            raise MemlensUsageError(f"{what} {shown}: not readable by this server")
        return str(path)


# --------------------------------------------------------------------------- analyses, kept


class _Analyses:
    """Analyses of recently asked files, keyed by the file's identity (so an edited file is read
    again) and the capacity asked for; safe to use from the SDK's worker threads."""

    def __init__(self, kept: int = KEPT_ANALYSES) -> None:
        self.kept = kept
        self.entries: OrderedDict[tuple[Any, ...], Analysis] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, path: str, capacity: int | None) -> "Analysis":
        from memlens.analysis import analyze_snapshot
        from memlens.cli.common import load_with_progress

        st = os.stat(path)
        key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, capacity)
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        # As ``memlens triage`` does: every device analysed, the file's cache used as the CLI uses it.
        analysis = analyze_snapshot(load_with_progress(path, progress=False), capacity=capacity)
        with self.lock:
            self.entries[key] = analysis
            while len(self.entries) > self.kept:
                self.entries.popitem(last=False)
        return analysis


def _capacity(text: str | int | None) -> int | None:
    """A device size (80GiB, 24GB, 1.5e9), as the CLI's --capacity reads it."""
    if text is None:
        return None
    from memlens.cli.common import CAPACITY

    try:
        return CAPACITY.convert(text, None, None)
    except Exception as exc:  # click.BadParameter: its message is the CLI's
        raise MemlensUsageError(f"capacity {printable(text, 100)}: {getattr(exc, 'message', exc)}") from None


def _whole(value: int | None, name: str, minimum: int | None = 1, maximum: int | None = MAX_WHOLE) -> int | None:
    """A whole-number argument, checked as the CLI's options are (memlens.units.parse_whole): the
    JSON may carry 1e400 (inf), 5,000-digit numbers or 0 where a count divides."""
    return None if value is None else parse_whole(value, name, minimum, maximum)


def _real(value: float | None, name: str, minimum: float | None = None,
          maximum: float | None = None) -> float | None:
    return None if value is None else parse_real(value, name, minimum, maximum)


def _device(value: int | None) -> int | None:
    return _whole(value, "device", 0, 1023)


# --------------------------------------------------------------------------- what each tool returns


@dataclass
class Tools:
    """The payload behind each tool: the dict ``memlens <command> --json`` prints."""

    paths: PathPolicy = dataclasses.field(default_factory=PathPolicy)
    analyses: _Analyses = dataclasses.field(default_factory=_Analyses)

    def triage(self, snapshot: str, device: int | None = None, capacity: str | int | None = None) -> dict[str, Any]:
        device = _device(device)
        analysis = self.analyses.get(self.paths.check(snapshot), _capacity(capacity))
        analysis.report.device(device)  # an unknown device: one line naming the ones there are
        return analysis.report.to_json()

    def findings(self, snapshot: str, device: int | None = None, capacity: str | int | None = None,
                 kinds: list[str] | None = None) -> dict[str, Any]:
        from memlens.analysis.datatypes import FINDING_KINDS
        from memlens.cli.triage import KIND_ALIASES

        wanted = [KIND_ALIASES.get(k.strip().lower(), k.strip().lower()) for k in kinds or []]
        unknown = [k for k in wanted if k not in FINDING_KINDS]
        if unknown:
            raise MemlensUsageError(f"unknown finding kind {', '.join(map(printable, unknown))} "
                                    f"(use {', '.join(FINDING_KINDS)})")
        report = self.triage(snapshot, device, capacity)
        found = report["findings"] if device is None else report["devices"][str(device)]["findings"]
        return {"source": report["source"],
                "findings": [f for f in found if not wanted or f["kind"] in wanted]}

    def group_by(self, snapshot: str, group_by: str = "category", device: int | None = None,
                 at: str | None = None, window: str | None = None, step: int | None = None,
                 rules: str | None = None, file: str | None = None) -> dict[str, Any]:
        from memlens.analysis.lenses import GROUP_BYS, lens_inputs_of, load_rules
        from memlens.cli.lenses import lens_payload

        device, step = _device(device), _whole(step, "step", 0)
        if group_by not in GROUP_BYS:
            raise MemlensUsageError(f"group_by {printable(group_by, 100)}: use one of {', '.join(GROUP_BYS)}")
        loaded_rules = load_rules(self.paths.check(rules, "rules")) if rules is not None else []
        if group_by == "rules" and not loaded_rules:
            raise MemlensUsageError("group_by 'rules' needs rules: the path of a JSON or TOML rules file")
        path = self.paths.check(snapshot)
        analysis = self.analyses.get(path, None)
        # The device ``memlens triage --group-by`` picks by default (the report's: the highest
        # peak), read from the kept analysis: the same lifetimes, categories and steps.
        lens = {"at": at, "window": window, "step": step, "file_path": file}
        return lens_payload(lens_inputs_of(analysis, device), path, group_by, loaded_rules, lens).to_json()

    def diff(self, before: str, after: str, device: int | None = None, top: int = 10,
             file: str | None = None) -> dict[str, Any]:
        from memlens.compare import diff_reports

        device, top = _device(device), _whole(top, "top", 1, 100) or 10
        analysis_before = self.analyses.get(self.paths.check(before, "before"), None)
        analysis_after = self.analyses.get(self.paths.check(after, "after"), None)
        payload = diff_reports(analysis_before, analysis_after, device, device, top=top).to_json()
        if file:
            from memlens.analysis.lenses import diff_file_lines, lens_inputs_of

            payload["file"] = diff_file_lines(lens_inputs_of(analysis_before, device),
                                              lens_inputs_of(analysis_after, device), file).to_json()
        return payload

    def whatif(self, snapshot: str, expandable_segments: bool | None = None, max_split_size_mb: int | None = None,
               garbage_collection_threshold: float | None = None, capacity: str | int | None = None,
               device: int | None = None) -> dict[str, Any]:
        from memlens.allocator import AllocatorSettings
        from memlens.allocator import whatif as run_whatif
        from memlens.snapshot.reader import load

        capacity_bytes = _capacity(capacity)
        device, max_split_size_mb = _device(device), _whole(max_split_size_mb, "max_split_size_mb", 0)
        garbage_collection_threshold = _real(garbage_collection_threshold, "garbage_collection_threshold", 0.0, 1.0)
        loaded = load(self.paths.check(snapshot))
        settings = AllocatorSettings.from_snapshot_dict(loaded.allocator_settings).with_changes(
            expandable_segments=expandable_segments, max_split_size_mb=max_split_size_mb,
            garbage_collection_threshold=garbage_collection_threshold)
        return run_whatif(loaded, settings=settings, capacity=capacity_bytes, device=device).to_json()

    def budget(self, params: str | float | None = None, hidden: int | None = None, layers: int | None = None,
               heads: int | None = None, kv_heads: int | None = None, vocab: int | None = None,
               ffn: int | None = None, tie_embeddings: bool = False, config: str | None = None,
               precision: str = "bf16-mixed", optimizer: str = "adamw", optim_dtype: str = "fp32",
               grad_dtype: str | None = None, galore_rank: int | None = None, lora_rank: int | None = None,
               lora_targets: str = "q_proj,v_proj", qlora: bool = False, frozen_layers: int = 0, batch: int = 1,
               seq: int | None = None, grad_accum: int = 1, checkpointing: str = "none", flash_attn: bool = True,
               activations: str = "megatron", chunked_loss: float | None = None, zero: int = 0,
               world_size: int = 1, offload_optimizer: bool = False, offload_params: bool = False,
               capacity: list[str | float] | None = None) -> dict[str, Any]:
        from memlens.cli.budget import budget_from_flags, parse_capacity

        hidden, layers, heads, kv_heads, vocab, ffn, galore_rank, lora_rank, seq = (
            _whole(value, name) for value, name in (
                (hidden, "hidden"), (layers, "layers"), (heads, "heads"), (kv_heads, "kv_heads"), (vocab, "vocab"),
                (ffn, "ffn"), (galore_rank, "galore_rank"), (lora_rank, "lora_rank"), (seq, "seq")))
        batch, grad_accum, world_size = (_whole(value, name) or 1 for value, name in (
            (batch, "batch"), (grad_accum, "grad_accum"), (world_size, "world_size")))
        frozen_layers, zero = _whole(frozen_layers, "frozen_layers", 0) or 0, _whole(zero, "zero", 0, 3) or 0
        chunked_loss = _real(chunked_loss, "chunked_loss", 1.0)
        result = budget_from_flags(
            params=str(params) if params is not None else None, hidden=hidden, layers=layers, heads=heads,
            kv_heads=kv_heads, vocab=vocab, ffn=ffn, tie_embeddings=tie_embeddings,
            config_path=str(self.paths.check(config, "config")) if config is not None else None,
            precision=precision, optimizer=optimizer, optim_dtype=optim_dtype, grad_dtype=grad_dtype,
            galore_rank=galore_rank, lora_rank=lora_rank, lora_targets=lora_targets, qlora=qlora,
            frozen_layers=frozen_layers, batch=batch, seq=seq, grad_accum=grad_accum, checkpointing=checkpointing,
            flash_attn=flash_attn, activation_formula=activations, chunked_loss=chunked_loss, zero_stage=zero,
            world_size=world_size, offload_optimizer=offload_optimizer, offload_params=offload_params)
        payload = result.to_json()
        payload["capacities"] = [result.check(parse_capacity(str(size))).to_json() for size in capacity or []]
        return payload


def one_line_error(exc: BaseException) -> str:
    """What a tool error says: the CLI's one line for a mistake, a named internal error otherwise."""
    if isinstance(exc, MemlensError) and not _is_simulated_oom(exc):
        return printable(exc, ERROR_CHARS)
    if isinstance(exc, MemoryError | RecursionError):
        what = "memory" if isinstance(exc, MemoryError) else "stack depth"
        return f"ran out of {what} on this input ({type(exc).__name__})"
    return f"internal error: {type(exc).__name__}: {printable(exc, 300)} (please report it)"


def _is_simulated_oom(exc: BaseException) -> bool:
    from memlens.errors import MemlensOutOfMemory

    return isinstance(exc, MemlensOutOfMemory)


def run_tool(payload: Callable[[], dict[str, Any]]) -> str:
    """The payload as the CLI prints it (``json.dumps(..., indent=2)``); any failure becomes a
    ``ToolError`` of one line (``ToolError`` is imported here: only a running server needs it)."""
    from mcp.server.mcpserver.exceptions import ToolError

    from memlens.cli.common import json_text

    try:
        return json_text(payload())
    except Exception as exc:  # every failure reaches the caller as one line, never a traceback
        raise ToolError(one_line_error(exc)) from None


# --------------------------------------------------------------------------- the server


def build_server(roots: Sequence[str | os.PathLike[str]] = ()) -> Any:
    """An ``mcp`` ``MCPServer`` with the memlens tools (``roots``: the folders it may read; none:
    any path the server's user can read)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations
    from pydantic import Field

    from memlens._version import __version__

    tools = Tools(paths=PathPolicy.for_roots(roots))
    server = MCPServer(SERVER_NAME, instructions=INSTRUCTIONS, version=__version__, log_level="WARNING",
                       middleware=[_one_line_tool_errors])
    read_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                                open_world_hint=False)

    Snapshot = Annotated[str, Field(description="Path of a snapshot file (.pickle or .pickle.gz) on the "
                                                "server's machine; absolute is safest")]
    Device = Annotated[int | None, Field(description="CUDA device index (default: the busiest)")]
    Capacity = Annotated[str | int | None, Field(description="Device memory, e.g. 80GiB or 24GB, or bytes "
                                                             "(default: the recorder's sidecar, if any)")]

    def triage(snapshot: Snapshot, device: Device = None, capacity: Capacity = None) -> str:
        """The report `memlens triage SNAPSHOT --json` prints: per device the peak allocated and
        reserved (event, time, step), steps, bytes by category at the peak with top stacks, and the
        findings (leak, activation_plateau, optimizer_spike, fragmentation, oom), each with
        severity, bytes, evidence, stacks, a recommendation and the estimated saving."""
        return run_tool(lambda: tools.triage(snapshot, device, capacity))

    def findings(snapshot: Snapshot, device: Device = None, capacity: Capacity = None,
                 kinds: Annotated[list[str] | None, Field(
                     description="Only these kinds: leak, activation_plateau (or activations), "
                                 "optimizer_spike (or optimizer), fragmentation, oom")] = None) -> str:
        """The findings of `memlens triage --json` (most severe first), as {source, findings}:
        every device's, or one device's with `device`."""
        return run_tool(lambda: tools.findings(snapshot, device, capacity, kinds))

    def group_by(snapshot: Snapshot,
                 group_by: Annotated[str, Field(description="category, annotation, compile_context, module, "
                                                            "file, frame, stack or rules")] = "category",
                 device: Device = None,
                 at: Annotated[str | None, Field(description="The moment: an event index (1234), a time "
                                                             "(1234567us, or +1.5s since the first row) or "
                                                             "stepN; default: the peak")] = None,
                 window: Annotated[str | None, Field(description="The peak within rows A:B (events, times "
                                                                 "or steps)")] = None,
                 step: Annotated[int | None, Field(description="The peak within step N")] = None,
                 rules: Annotated[str | None, Field(description="Path of a JSON or TOML rules file (name -> "
                                                                "regular expression over the stack, first "
                                                                "match wins), for group_by=rules")] = None,
                 file: Annotated[str | None, Field(description="Also bytes by line of this source file "
                                                               "(matched on the end of the path)")] = None) -> str:
        """What was live at the peak (or a moment, window or step) grouped, as `memlens triage
        SNAPSHOT --group-by G --json` prints it; the groups add up to the allocated bytes then."""
        return run_tool(lambda: tools.group_by(snapshot, group_by, device, at, window, step, rules, file))

    def diff(before: Annotated[str, Field(description="Path of the earlier snapshot")],
             after: Annotated[str, Field(description="Path of the later snapshot")],
             device: Device = None,
             top: Annotated[int, Field(description="Stacks to list (1-100)")] = 10,
             file: Annotated[str | None, Field(description="Also per-line growth of this source file")] = None,
             ) -> str:
        """What grew between two snapshots, as `memlens diff BEFORE AFTER --json` prints it: the
        peaks, each category at the peak, the stacks that changed most, the findings of each."""
        return run_tool(lambda: tools.diff(before, after, device, top, file))

    def whatif(snapshot: Snapshot,
               expandable_segments: Annotated[bool | None, Field(
                   description="Simulate expandable_segments:True (false: force it off)")] = None,
               max_split_size_mb: Annotated[int | None, Field(description="max_split_size_mb (> 20)")] = None,
               garbage_collection_threshold: Annotated[float | None, Field(
                   description="garbage_collection_threshold in (0, 1); needs capacity")] = None,
               capacity: Capacity = None, device: Device = None) -> str:
        """Replay the snapshot through memlens' caching-allocator simulator with other settings,
        as `memlens whatif --json` prints it: recorded and simulated peak reserved, fragmentation,
        cudaMalloc calls and whether (and where) it runs out of memory within capacity."""
        return run_tool(lambda: tools.whatif(snapshot, expandable_segments, max_split_size_mb,
                                             garbage_collection_threshold, capacity, device))

    def budget(params: Annotated[str | float | None, Field(description="Parameter count: 7e9, 7B, 350M")] = None,
               hidden: int | None = None, layers: int | None = None, heads: int | None = None,
               kv_heads: int | None = None, vocab: int | None = None, ffn: int | None = None,
               tie_embeddings: bool = False,
               config: Annotated[str | None, Field(description="Path of a transformers config.json")] = None,
               precision: Annotated[str, Field(description="fp32, bf16-mixed, fp16-mixed, bf16, fp16")] = "bf16-mixed",
               optimizer: Annotated[str, Field(description="sgd, sgd-momentum, adam, adamw, adam-8bit, adafactor, "
                                                           "muon, galore")] = "adamw",
               optim_dtype: str = "fp32", grad_dtype: str | None = None, galore_rank: int | None = None,
               lora_rank: int | None = None, lora_targets: str = "q_proj,v_proj", qlora: bool = False,
               frozen_layers: int = 0, batch: int = 1, seq: int | None = None, grad_accum: int = 1,
               checkpointing: Annotated[str, Field(description="none, full, selective or every:K")] = "none",
               flash_attn: bool = True,
               activations: Annotated[str, Field(description="megatron or rule-of-thumb")] = "megatron",
               chunked_loss: float | None = None, zero: int = 0, world_size: int = 1,
               offload_optimizer: bool = False, offload_params: bool = False,
               capacity: Annotated[list[str | float] | None, Field(
                   description="Device sizes to check the fit against, e.g. [\"80GB\", \"24GiB\"]; a bare "
                               "number is GB")] = None,
               ) -> str:
        """The theoretical memory of a training step, as `memlens budget --json` prints it (the
        arguments are its flags): weights, gradients, master weights, optimizer state,
        activations and logits in bytes, the totals, and for each capacity whether it fits and the
        largest micro-batch that does."""
        return run_tool(lambda: tools.budget(
            params, hidden, layers, heads, kv_heads, vocab, ffn, tie_embeddings, config, precision, optimizer,
            optim_dtype, grad_dtype, galore_rank, lora_rank, lora_targets, qlora, frozen_layers, batch, seq,
            grad_accum, checkpointing, flash_attn, activations, chunked_loss, zero, world_size,
            offload_optimizer, offload_params, capacity))

    for tool in (triage, findings, group_by, diff, whatif, budget):
        # The docstring, dedented, is what the assistant reads; the text is the CLI's JSON, so no
        # output schema (structured_output=False).
        server.add_tool(tool, description=inspect.cleandoc(tool.__doc__ or ""), annotations=read_only,
                        structured_output=False)
    return server


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


def serve(roots: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Answer MCP requests on stdin/stdout until the client closes them."""
    build_server(roots).run("stdio")
