"""Rules: the user's own group names, as ordered name/pattern pairs over the stack's frames.

A rules file (JSON or TOML) lists ``name``/``pattern`` pairs; a stack any of whose frames
(``name (file:line)``) matches a pattern belongs to that rule's name, the first matching rule
winning, and the rest is ``other`` (``labels.UNMATCHED_RULE``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from memlens.analysis.lenses.inputs import I32
from memlens.errors import MemlensUsageError
from memlens.files import FileRefused, OpenedFile, open_regular

# Rules are a stranger's input too (``--rules``, the MCP server's ``rules`` argument): they are
# matched with RE2, whose time is linear in the text (``(a+)+$`` cannot backtrack), all rules
# at once through an ``re2.Set``, so 5,000 rules cost one pass over each distinct frame. What
# RE2 cannot do (backreferences, lookaround) is refused, never handed to Python's ``re``.
MAX_RULES_FILE_BYTES = 1 << 20
MAX_RULES = 10_000
MAX_PATTERN_CHARS = 10_000
# RE2's memory for one compiled pattern and for the set of all of them (its default is 8 MiB).
_RE2_PATTERN_MEMORY = 8 << 20
_RE2_SET_MEMORY = 256 << 20


class RulePattern(Protocol):
    def search(self, text: str | bytes) -> Any: ...


@dataclass(frozen=True)
class Rule:
    """A user rule: a stack any of whose frames (``name (file:line)``) matches ``pattern`` is ``name``."""

    name: str
    pattern: RulePattern  # an RE2 pattern (``re2.compile``)
    source: str = ""  # the pattern's text, as the rules file wrote it


def _re2() -> Any:
    try:
        import re2
    except ImportError:  # pragma: no cover - google-re2 is a dependency; a broken install lands here
        raise MemlensUsageError("rules need the google-re2 package (pip install google-re2): memlens matches "
                                "rules with RE2 so that no pattern can take exponential time") from None
    return re2


def _re2_options(memory: int) -> Any:
    options = _re2().Options()
    options.log_errors = False  # RE2 would print its own line to stderr for every bad pattern
    options.max_mem = memory
    return options


# A counted repetition (not after a backslash). RE2 refuses counts over 1,000 but reads one too
# large for an int (``a{4294967295}``) as literal text, where Python's re would mean a count.
_REPETITION = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_MAX_REPEAT = 1000


def _compile_rule(pattern: str, source: str, position: int, name: str) -> RulePattern:
    re2 = _re2()
    where = f"{source}: rule {position} ({name[:80]})"
    if len(pattern) > MAX_PATTERN_CHARS:
        raise MemlensUsageError(f"{where}: the pattern is {len(pattern):,} characters (at most "
                                f"{MAX_PATTERN_CHARS:,})")
    for repeat in _REPETITION.finditer(pattern):
        if any((count and len(count) > 4) or (count and int(count) > _MAX_REPEAT) for count in repeat.groups()):
            raise MemlensUsageError(f"{where}: bad regular expression {shorten_pattern(pattern)}: the "
                                    f"repetition {repeat.group()[:40]} counts over {_MAX_REPEAT:,} (RE2's limit)")
    try:
        compiled: RulePattern = re2.compile(pattern, _re2_options(_RE2_PATTERN_MEMORY))
        return compiled
    except (re2.error, ValueError, OverflowError, TypeError) as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise MemlensUsageError(f"{where}: bad regular expression {shorten_pattern(pattern)}: {reason} "
                                "(rules are RE2 syntax: no backreferences or lookaround)") from None


def shorten_pattern(pattern: str, limit: int = 120) -> str:
    shown = repr(pattern)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def parse_rules(data: Any, source: str = "rules") -> list[Rule]:
    """Rules from parsed JSON or TOML, in file order (at most ``MAX_RULES``, each an RE2 pattern).

    Accepted shapes: ``{"rules": [{"name": ..., "pattern": ...}, ...]}`` (TOML: ``[[rules]]``
    tables), a bare JSON list of such objects, or ``{"rules": {"name": "pattern", ...}}``.
    """
    entries: Any = data.get("rules") if isinstance(data, dict) else data
    if isinstance(entries, dict):
        entries = [{"name": k, "pattern": v} for k, v in entries.items()]
    if not isinstance(entries, list) or not entries:
        raise MemlensUsageError(f"{source}: expected a non-empty list of rules under 'rules', "
                                "each with a 'name' and a 'pattern'")
    if len(entries) > MAX_RULES:
        raise MemlensUsageError(f"{source}: {len(entries):,} rules (at most {MAX_RULES:,})")
    rules = []
    for position, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("pattern"), str) or not entry["name"].strip():
            raise MemlensUsageError(f"{source}: rule {position} needs a 'name' and a 'pattern', both text")
        name = entry["name"].strip()
        rules.append(Rule(name, _compile_rule(entry["pattern"], source, position, name), entry["pattern"]))
    return rules


def _read_rules_file(path: Path) -> str:
    """The text of a rules file: a regular file of at most MAX_RULES_FILE_BYTES, opened once
    without blocking (a FIFO would wait for a writer forever) and checked on the descriptor."""
    try:
        with open_regular(path, max_bytes=MAX_RULES_FILE_BYTES) as opened:
            return rules_text(opened)
    except FileRefused as refused:
        raise MemlensUsageError(f"{path}: cannot read the rules file: {refused.reason}") from None


def rules_text(opened: OpenedFile) -> str:
    """The text of a rules file already opened and checked (the CLI's path, or ``memlens mcp``'s
    file beneath its root)."""
    try:
        return opened.read_bytes(MAX_RULES_FILE_BYTES).decode("utf-8")
    except FileRefused as refused:  # it grew past the limit after it was opened
        raise MemlensUsageError(f"{opened.name}: cannot read the rules file: {refused.reason}") from None
    except UnicodeDecodeError as exc:
        raise MemlensUsageError(f"{opened.name}: cannot read the rules file: not UTF-8 ({exc.reason})") from None


def load_rules(path: str | Path) -> list[Rule]:
    """Rules from a ``.json`` or ``.toml`` file (by suffix; anything else is tried as JSON, then TOML)."""
    path = Path(path)
    return rules_from_text(_read_rules_file(path), str(path))


def rules_from_text(text: str, name: str) -> list[Rule]:
    """Rules from the text of a rules file called ``name`` (JSON or TOML by its suffix; anything
    else is tried as JSON, then TOML): for a file already read, such as one ``memlens mcp``
    opened beneath its root."""
    path = Path(name)
    parsers = {".json": ("json",), ".toml": ("toml",)}.get(path.suffix.lower(), ("json", "toml"))
    errors = []
    for kind in parsers:
        try:
            data = json.loads(text) if kind == "json" else _toml_loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            errors.append(f"not {kind.upper()} ({str(exc)[:200]})")
            continue
        return parse_rules(data, str(path))
    raise MemlensUsageError(f"{path}: {'; '.join(errors)}")


def _toml_loads(text: str) -> Any:
    import importlib

    # tomllib is Python 3.11+; on 3.10 tomli (the same parser) serves, when installed.
    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name).loads(text)
        except ImportError:
            continue
    raise MemlensUsageError("TOML rules files need Python 3.11 or the tomli package; write the rules as JSON")


def first_rule_per_frame(rules: Sequence[Rule], texts: Sequence[str]) -> I32:
    """For each text, the index of the first rule whose pattern it matches (``len(rules)``: none).

    One ``re2.Set`` holds every pattern: each text is scanned once, whatever the number of rules.
    The set's last pattern is empty, so it matches every text: a text it does not report was not
    matched (RE2's DFA ran out of memory and said nothing), and is searched rule by rule instead,
    each still in linear time."""
    re2 = _re2()
    patterns = re2.Set.SearchSet(_re2_options(_RE2_SET_MEMORY))
    for rule in rules:
        patterns.Add(rule.source)
    always = patterns.Add("")
    try:
        patterns.Compile()
    except re2.error:
        raise MemlensUsageError(f"the {len(rules):,} rules together are too large for RE2 to match at once "
                                "(fewer or simpler patterns)") from None
    none = len(rules)
    out = np.full(len(texts), none, dtype=np.int32)
    match = patterns.Match
    for k, text in enumerate(texts):
        # A pickle's str may hold a lone surrogate, which UTF-8 cannot: it is matched as its bytes.
        encoded = text.encode("utf-8", "surrogatepass")
        hits = match(encoded) or ()
        if always not in hits:  # the set failed on this text: one rule at a time, in order
            out[k] = next((i for i, rule in enumerate(rules) if rule.pattern.search(encoded)), none)
            continue
        out[k] = min(hits)  # ``always`` is len(rules): "none" when it is the only hit
    return out

