"""``memlens mcp`` driven as an assistant's client drives it: raw JSON-RPC over the server's stdin
and stdout. Each tool's text must be the JSON the matching CLI command prints; every failure one
line, flagged ``isError``, and the server still answering after it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.errors import MemlensFormatError, MemlensUsageError
from memlens.mcp_server import PathPolicy, Tools, one_line_error
from tests.conftest import REPO_ROOT, SAMPLE_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

pytest.importorskip("mcp")

TOOLS = {"triage", "findings", "group_by", "diff", "whatif", "budget"}
LEAK = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"
REPLY_SECONDS = 120  # a cold start imports the SDK, pydantic and numpy on a busy 2-core runner


class StdioClient:
    """A minimal MCP client: newline-delimited JSON-RPC messages to and from a subprocess."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "memlens", "mcp", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(json.loads(line))  # anything but JSON-RPC on stdout fails here
        self.replies.put(None)

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        self._send({"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})})

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self.next_id += 1
        self._send({"jsonrpc": "2.0", "id": self.next_id, "method": method, **({"params": params} if params else {})})
        reply = self.replies.get(timeout=REPLY_SECONDS)
        assert reply is not None, f"the server closed stdout: {self.stderr()}"
        assert reply.get("id") == self.next_id, reply
        return reply

    def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        reply = self.request("tools/call", {"name": tool, "arguments": arguments})
        assert "result" in reply, reply
        return reply["result"]

    def _send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def stderr(self) -> str:
        """Close the server's stdin (it exits) and return what it wrote on stderr."""
        assert self.process.stdin is not None and self.process.stderr is not None
        self.process.stdin.close()
        try:
            errors = self.process.stderr.read()
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.process.stderr.close()
            self.reader.join(timeout=30)
            assert self.process.stdout is not None
            self.process.stdout.close()
        return errors


@pytest.fixture(scope="module")
def client() -> Iterator[StdioClient]:
    client = StdioClient()
    reply = client.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                          "clientInfo": {"name": "memlens-tests", "version": "0"}})
    assert reply["result"]["serverInfo"]["name"] == "memlens"
    assert reply["result"]["capabilities"]["tools"] is not None
    client.notify("notifications/initialized")
    yield client
    errors = client.stderr()
    assert client.process.returncode == 0, errors
    assert "Traceback" not in errors


def cli_json(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout.rstrip("\n")


def text_of(result: dict[str, Any]) -> str:
    assert not result.get("isError"), result
    (block,) = result["content"]
    assert block["type"] == "text"
    return block["text"]


def error_of(result: dict[str, Any]) -> str:
    assert result.get("isError") is True, result
    (block,) = result["content"]
    assert "\n" not in block["text"] and "Traceback" not in block["text"]
    return block["text"]


@pytest.mark.timeout(300)
def test_lists_the_tools_with_their_arguments(client: StdioClient) -> None:
    tools = {t["name"]: t for t in client.request("tools/list")["result"]["tools"]}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool["description"] and tool["annotations"]["readOnlyHint"] is True
    assert tools["triage"]["inputSchema"]["required"] == ["snapshot"]
    assert {"before", "after"} <= set(tools["diff"]["inputSchema"]["properties"])


@pytest.mark.timeout(300)
def test_triage_is_the_cli_json_on_a_sample(client: StdioClient) -> None:
    text = text_of(client.call("triage", snapshot=str(LEAK)))
    assert text == cli_json("triage", str(LEAK), "--json")
    assert [f["kind"] for f in json.loads(text)["findings"]] == ["leak"]


@needs_real_snapshots
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["MAGMA27__assignment2-systems__memory_snapshot.pickle",
                                  "Yiyi-philosophy__LLM-inference__oom_snapshot.pickle"])
def test_triage_and_findings_match_the_cli_on_real_snapshots(client: StdioClient, name: str) -> None:
    path = str(real_snapshot(name))
    expected = json.loads(cli_json("triage", path, "--json"))
    assert json.loads(text_of(client.call("triage", snapshot=path))) == expected
    findings = json.loads(text_of(client.call("findings", snapshot=path)))
    assert findings == {"source": path, "findings": expected["findings"]}


@needs_real_snapshots
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group_by", ["category", "stack", "file"])
def test_group_by_matches_the_cli_on_a_real_snapshot(client: StdioClient, group_by: str) -> None:
    path = str(real_snapshot("MAGMA27__assignment2-systems__memory_snapshot.pickle"))
    assert text_of(client.call("group_by", snapshot=path, group_by=group_by)) == cli_json(
        "group", path, "--by", group_by, "--json")


@pytest.mark.timeout(300)
def test_findings_filter_by_kind(client: StdioClient) -> None:
    leaks = json.loads(text_of(client.call("findings", snapshot=str(LEAK), kinds=["leak"])))
    assert [f["kind"] for f in leaks["findings"]] == ["leak"]
    assert json.loads(text_of(client.call("findings", snapshot=str(LEAK), kinds=["oom"])))["findings"] == []
    assert "unknown finding kind" in error_of(client.call("findings", snapshot=str(LEAK), kinds=["leek"]))


@pytest.mark.timeout(300)
def test_group_by_diff_whatif_and_budget_are_the_cli_json(client: StdioClient) -> None:
    assert text_of(client.call("group_by", snapshot=str(LEAK), group_by="file", at="step2")) == cli_json(
        "group", str(LEAK), "--by", "file", "--at", "step2", "--json")
    rank0, rank1 = (str(SAMPLE_SNAPSHOTS_DIR / f"ddp_rank{r}.pickle") for r in (0, 1))
    assert text_of(client.call("diff", before=rank0, after=rank1, top=5)) == cli_json(
        "diff", rank0, rank1, "--top", "5", "--json")
    assert text_of(client.call("whatif", snapshot=str(LEAK), expandable_segments=True, capacity="24MiB")) == cli_json(
        "whatif", str(LEAK), "--expandable-segments", "--capacity", "24MiB", "--json")
    assert text_of(client.call("budget", params="7e9", seq=2048, hidden=4096, layers=32, heads=32,
                               capacity=["80GB", "24GiB"])) == cli_json(
        "budget", "--params", "7e9", "--seq", "2048", "--hidden", "4096", "--layers", "32", "--heads", "32",
        "--capacity", "80GB", "--capacity", "24GiB", "--json")
    # Numbers where the CLI takes text: an assistant writes 7e9 as a JSON number; a capacity
    # without its unit is refused by both, in the same words.
    assert text_of(client.call("budget", params=7e9, capacity=["80GiB"])) == cli_json(
        "budget", "--params", "7e9", "--capacity", "80GiB", "--json")
    assert "give a unit, e.g. 80GiB or 80GB" in error_of(client.call("budget", params=7e9, capacity=[80]))


@pytest.mark.timeout(300)
def test_mistakes_and_hostile_files_are_one_line_tool_errors(client: StdioClient, tmp_path: Path) -> None:
    assert "no such file" in error_of(client.call("triage", snapshot=str(tmp_path / "missing.pickle")))
    assert "a folder" in error_of(client.call("triage", snapshot=str(tmp_path)))
    fifo = tmp_path / "pipe.pickle"
    os.mkfifo(fifo)  # reading it would block the server for ever
    assert "not a regular file" in error_of(client.call("triage", snapshot=str(fifo)))
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(os.system, protocol=4))  # a pickle naming a global: refused unread
    assert "refused to load" in error_of(client.call("triage", snapshot=str(evil)))
    not_pickle = tmp_path / "notes.pickle"
    not_pickle.write_text("\x1b[2J not a pickle\n")
    assert error_of(client.call("whatif", snapshot=str(not_pickle))).startswith("Error executing tool whatif: ")
    assert "no device 7" in error_of(client.call("triage", snapshot=str(LEAK), device=7))
    assert "device" in error_of(client.call("triage", snapshot=str(LEAK), device="seven"))  # the SDK's check
    assert "capacity" in error_of(client.call("triage", snapshot=str(LEAK), capacity="lots"))
    assert "group_by" in error_of(client.call("group_by", snapshot=str(LEAK), group_by="colour"))
    # ... and the server still answers.
    assert json.loads(text_of(client.call("triage", snapshot=str(LEAK))))["source"] == str(LEAK)


def test_paths_outside_the_roots_are_refused(tmp_path: Path) -> None:
    inside = tmp_path / "runs"
    inside.mkdir()
    (inside / "a.pickle").write_bytes(b"x")
    policy = PathPolicy.for_roots([inside])
    with policy.open(str(inside / "a.pickle")) as opened:
        assert opened.name == str(inside / "a.pickle") and opened.size == 1
    with pytest.raises(MemlensUsageError, match="outside the folders"):
        policy.open(str(LEAK))
    with pytest.raises(MemlensUsageError, match="outside the folders"):
        policy.open(str(inside / ".." / ".." / LEAK))
    (inside / "escape.pickle").symlink_to(LEAK)  # no link below a root is followed, wherever it points
    with pytest.raises(MemlensUsageError, match="symbolic link"):
        policy.open(str(inside / "escape.pickle"))
    (inside / "sub").mkdir()
    (inside / "sub" / "b.pickle").write_bytes(b"y")
    (inside / "link").symlink_to(inside / "sub")  # nor a link to a folder inside it
    with pytest.raises(MemlensUsageError, match="symbolic link"):
        policy.open(str(inside / "link" / "b.pickle"))
    with policy.open(str(inside / "sub" / ".." / "sub" / "b.pickle")) as opened:
        assert opened.size == 1
    with pytest.raises(MemlensUsageError, match="no such folder"):
        PathPolicy.for_roots([tmp_path / "nowhere"])


def test_error_lines_name_the_problem() -> None:
    assert one_line_error(MemlensFormatError("a.pickle", "truncated\nfile")) == "a.pickle: truncated\\nfile"
    assert one_line_error(MemoryError()) == "ran out of memory on this input (MemoryError)"
    assert one_line_error(KeyError("x")).startswith("internal error: KeyError: ")


@pytest.mark.timeout(300)
def test_the_sdks_own_client_lists_and_calls_the_tools() -> None:
    """Beside the raw messages above: the reference client (what assistants embed) talks to it."""
    import asyncio

    from mcp import ClientSession, StdioServerParameters, stdio_client

    async def session() -> tuple[list[str], str, str]:
        server = StdioServerParameters(command=sys.executable, args=["-m", "memlens", "mcp"], cwd=str(REPO_ROOT))
        async with stdio_client(server) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            names = [tool.name for tool in (await client.list_tools()).tools]
            found = await client.call_tool("findings", {"snapshot": str(LEAK)})
            missing = await client.call_tool("triage", {"snapshot": "/no/such.pickle"})
            assert not found.is_error and missing.is_error
            return names, found.content[0].text, missing.content[0].text  # type: ignore[union-attr]

    names, found, missing = asyncio.run(session())
    assert set(names) == TOOLS
    assert json.loads(found)["findings"] == json.loads(cli_json("triage", str(LEAK), "--json"))["findings"]
    assert missing == "Error executing tool triage: snapshot /no/such.pickle: no such file"


@pytest.mark.timeout(300)
def test_hostile_rules_neither_freeze_the_server_nor_escape_as_tracebacks(client: StdioClient, tmp_path: Path) -> None:
    """``(a+)+$`` against a frame of 5,000 a's backtracked for ever in Python's re, holding the
    GIL: every other call waited too. RE2 answers at once; a FIFO and a count RE2 refuses are
    one-line errors."""
    from tests.hostile_files import dumps, entry, snapshot

    frames = [{"filename": "model.py", "line": 1, "name": "a" * 5000}]
    path = tmp_path / "as.pickle"
    path.write_bytes(dumps(snapshot(device_traces=[[entry("alloc", 0x1000, 512, frames=frames)]])))
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps({"rules": {"evil": "(a+)+$", "runs": "a{3}"}}))
    groups = json.loads(text_of(client.call("group_by", snapshot=str(path), group_by="rules", rules=str(evil))))
    assert {g["name"] for g in groups["groups"]["groups"]} >= {"runs"}
    fifo = tmp_path / "rules.json"
    os.mkfifo(fifo)
    assert "not a regular file" in error_of(client.call("group_by", snapshot=str(path), group_by="rules",
                                                        rules=str(fifo)))
    count = tmp_path / "count.json"
    count.write_text(json.dumps({"rules": {"x": "a{4294967295}"}}))
    assert "counts over 1,000" in error_of(client.call("group_by", snapshot=str(path), group_by="rules",
                                                       rules=str(count)))
    assert json.loads(text_of(client.call("triage", snapshot=str(LEAK))))["source"] == str(LEAK)


# --------------------------------------------------------------------------- paths: open what was checked


def flip(stop: threading.Event, target: Path, states: list[Callable[[Path], None]]) -> None:
    """Swap what ``target`` names, round and round, until ``stop``: each state puts something
    at a temporary name and renames it over ``target`` (atomic, as an attacker would)."""
    spare = target.with_name(".spare")
    for state in itertools.cycle(states):
        if stop.is_set():
            return
        with contextlib.suppress(FileNotFoundError):
            spare.unlink()
        state(spare)
        os.replace(spare, target)


def hard_link_to(source: Path) -> Callable[[Path], None]:
    return lambda spare: os.link(source, spare)


def symlink_to(source: Path) -> Callable[[Path], None]:
    return lambda spare: spare.symlink_to(source)


def a_fifo(spare: Path) -> None:
    os.mkfifo(spare)


def in_process_tools(root: Path) -> Tools:
    return Tools(paths=PathPolicy.for_roots([root]))


@pytest.mark.timeout(600)
def test_a_symlink_flipped_during_calls_never_reaches_a_file_outside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    inside_file = root / "real.pickle"
    shutil.copy(LEAK, inside_file)
    secret = outside / "secret.pickle"
    shutil.copy(SAMPLE_SNAPSHOTS_DIR / "ddp_rank1.pickle", secret)
    target = root / "run.pickle"
    os.link(inside_file, target)
    tools = in_process_tools(root)
    inside_answer = tools.triage(str(target))
    outside_answer = Tools().triage(str(secret))
    outside_answer["source"] = inside_answer["source"]  # the same name: only the content may differ
    assert inside_answer != outside_answer

    stop = threading.Event()
    flipper = threading.Thread(target=flip, args=(stop, target, [hard_link_to(inside_file), symlink_to(secret)]))
    flipper.start()
    answered = refused = 0
    try:
        for _ in range(2000):
            try:
                answer = tools.triage(str(target))
            except MemlensUsageError as exc:
                assert "symbolic link" in str(exc) or "no such file" in str(exc), exc
                refused += 1
                continue
            assert answer == inside_answer  # never the secret's numbers
            answered += 1
    finally:
        stop.set()
        flipper.join()
    assert answered and refused  # both states were seen: the race was run, not avoided


@pytest.mark.timeout(300)
def test_a_fifo_swapped_in_during_calls_never_blocks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    inside_file = root / "real.pickle"
    shutil.copy(LEAK, inside_file)
    target = root / "run.pickle"
    os.link(inside_file, target)
    tools = in_process_tools(root)
    expected = tools.triage(str(target))
    stop = threading.Event()
    flipper = threading.Thread(target=flip, args=(stop, target, [hard_link_to(inside_file), a_fifo]))
    flipper.start()
    outcomes: set[str] = set()
    try:
        for _ in range(2000):  # a call that opened the FIFO to read would wait for a writer for ever
            try:
                assert tools.triage(str(target)) == expected
                outcomes.add("answered")
            except MemlensUsageError as exc:
                assert "not a regular file" in str(exc) or "no such file" in str(exc), exc
                outcomes.add("refused")
    finally:
        stop.set()
        flipper.join()
    assert outcomes == {"answered", "refused"}


@pytest.mark.timeout(300)
def test_the_sidecar_beside_a_snapshot_obeys_the_root(tmp_path: Path) -> None:
    """A ``NAME.memlens.json`` link to a file outside the root is not read into the answer (the
    real server, whose tool calls run in a child over the descriptors it opened)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copy(LEAK, root / "linked.pickle")
    shutil.copy(LEAK, root / "plain.pickle")
    secret = outside / "secrets.json"
    secret.write_text(json.dumps({"reason": "TOP-SECRET-TOKEN"}))  # a field the sidecar's reader keeps
    (root / "linked.memlens.json").symlink_to(secret)
    (root / "plain.memlens.json").write_text(json.dumps({"reason": "an-honest-model"}))
    client = StdioClient("--root", str(root))
    try:
        client.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                      "clientInfo": {"name": "memlens-tests", "version": "0"}})
        client.notify("notifications/initialized")
        linked = text_of(client.call("triage", snapshot=str(root / "linked.pickle")))
        plain = text_of(client.call("triage", snapshot=str(root / "plain.pickle")))
    finally:
        client.stderr()
    assert "TOP-SECRET-TOKEN" not in linked
    assert "an-honest-model" in plain  # a sidecar that is a file in the root is still read
    in_process = json.dumps(in_process_tools(root).triage(str(root / "linked.pickle")))
    assert "TOP-SECRET-TOKEN" not in in_process


def test_rules_and_configs_obey_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copy(LEAK, root / "run.pickle")
    (outside / "rules.json").write_text(json.dumps({"everything": "."}))
    (root / "rules.json").symlink_to(outside / "rules.json")
    (outside / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (root / "config.json").symlink_to(outside / "config.json")
    tools = in_process_tools(root)
    with pytest.raises(MemlensUsageError, match=r"rules .*symbolic link"):
        tools.group_by(str(root / "run.pickle"), "rules", rules=str(root / "rules.json"))
    with pytest.raises(MemlensUsageError, match="outside the folders"):
        tools.group_by(str(root / "run.pickle"), "rules", rules=str(outside / "rules.json"))
    with pytest.raises(MemlensUsageError, match=r"config .*symbolic link"):
        tools.budget(config=str(root / "config.json"))
    os.mkfifo(root / "fifo.json")
    with pytest.raises(MemlensUsageError, match="not a regular file"):
        tools.group_by(str(root / "run.pickle"), "rules", rules=str(root / "fifo.json"))


# --------------------------------------------------------------------------- every request answered


def raw_server(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "memlens", "mcp", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)


INITIALIZE = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
INITIALIZED = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})


def answers_to(lines: list[str], *args: str) -> tuple[list[dict[str, Any]], str]:
    """Write ``lines`` (raw JSON-RPC text) after the handshake, close stdin at once, and read
    every answer until the server exits (bounded: a request left unanswered fails here)."""
    server = raw_server(*args)
    try:
        out, errors = server.communicate("\n".join([INITIALIZE, INITIALIZED, *lines, ""]).encode(),
                                         timeout=REPLY_SECONDS * 2)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, errors
    return [json.loads(line) for line in out.decode().splitlines()], errors.decode()


@pytest.mark.timeout(600)
def test_every_request_gets_an_answer_even_with_lone_surrogates_or_garbage() -> None:
    call = '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"triage","arguments":{"snapshot":%s}}}'
    lines = [
        call % ("1", '"\\ud800"'),  # a lone surrogate in an argument: the SDK's parser refuses the line
        call % ("2", '"/no/such/\\udcff.pickle"'),
        '{"jsonrpc":"2.0","id":"\\udfff","method":"tools/list"}',  # ... or in the id itself
        '{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"\\ud83d","arguments":{}}}',
        "this is not JSON",
        '{"jsonrpc":"2.0","id":6,"method":7}',  # JSON, but not JSON-RPC
        call % ("7", json.dumps(str(LEAK))),  # still running when stdin closes: answered before exit
    ]
    answers, errors = answers_to(lines)
    by_id = {json.dumps(a.get("id")): a for a in answers}
    assert by_id["0"]["result"]["serverInfo"]["name"] == "memlens"
    for request_id in ("1", "2"):
        assert "no such file" in error_of(by_id[request_id]["result"])
    assert any("tools" in a.get("result", {}) for a in answers)  # the id came back as U+FFFD
    assert "error" in by_id["4"] or by_id["4"]["result"]["isError"]
    assert by_id["null"]["error"]["code"] == -32700
    assert by_id["6"]["error"]["code"] == -32600
    assert json.loads(text_of(by_id["7"]["result"]))["source"] == str(LEAK)
    assert len(answers) == 1 + len(lines)
    assert "Traceback" not in errors


@pytest.mark.timeout(600)
def test_a_tool_call_runs_under_the_analysis_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memlens.synthetic import synthetic_snapshot

    # A first open on the Python engine takes seconds over these 300,000 events (the native core,
    # or a copy cached by an earlier run, well under the half second): the call must outlast its
    # limit however fast the machine.
    monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
    monkeypatch.setenv("MEMLENS_CACHE_DIR", str(tmp_path / "cache"))
    big = tmp_path / "big.pickle"
    big.write_bytes(pickle.dumps(synthetic_snapshot(300_000, seed=3), protocol=4))
    call = '{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"triage","arguments":{"snapshot":%s}}}'
    (answer,) = answers_to([call % (1, json.dumps(str(big)))], "--analysis-timeout", "0.5")[0][1:]
    assert "tool call stopped: took over" in error_of(answer["result"])
    (answer,) = answers_to([call % (1, json.dumps(str(LEAK)))], "--analysis-memory", "64MiB")[0][1:]
    assert "tool call stopped: needed over 64" in error_of(answer["result"])


@pytest.mark.timeout(300)
def test_the_sdks_client_under_a_root_gets_one_line_refusals_and_no_outside_bytes(tmp_path: Path) -> None:
    import asyncio

    from mcp import ClientSession, StdioServerParameters, stdio_client

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copy(LEAK, root / "run.pickle")
    (outside / "secrets.json").write_text(json.dumps({"model": {"name": "TOP-SECRET-TOKEN"}}))
    (root / "run.memlens.json").symlink_to(outside / "secrets.json")
    (root / "link.pickle").symlink_to(root / "run.pickle")
    os.mkfifo(root / "pipe.pickle")

    async def session() -> list[tuple[bool, str]]:
        server = StdioServerParameters(command=sys.executable, args=["-m", "memlens", "mcp", "--root", str(root)],
                                       cwd=str(REPO_ROOT))
        async with stdio_client(server) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            answers = []
            for name in ("run.pickle", "link.pickle", "pipe.pickle"):
                result = await client.call_tool("triage", {"snapshot": str(root / name)})
                answers.append((result.is_error, result.content[0].text))  # type: ignore[union-attr]
            return answers

    (report_error, report), (link_error, link_text), (pipe_error, pipe_text) = asyncio.run(session())
    assert not report_error and "TOP-SECRET-TOKEN" not in report
    assert json.loads(report)["source"] == str(root / "run.pickle")
    assert link_error and "symbolic link" in link_text
    assert pipe_error and "not a regular file" in pipe_text
