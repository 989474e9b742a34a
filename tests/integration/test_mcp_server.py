"""``memlens mcp`` driven as an assistant's client drives it: raw JSON-RPC over the server's stdin
and stdout. Each tool's text must be the JSON the matching CLI command prints; every failure one
line, flagged ``isError``, and the server still answering after it."""

from __future__ import annotations

import json
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.errors import MemlensFormatError, MemlensUsageError
from memlens.mcp_server import PathPolicy, one_line_error
from tests.conftest import REPO_ROOT, SAMPLE_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot

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
        "triage", path, "--group-by", group_by, "--json")


@pytest.mark.timeout(300)
def test_findings_filter_by_kind(client: StdioClient) -> None:
    leaks = json.loads(text_of(client.call("findings", snapshot=str(LEAK), kinds=["leak"])))
    assert [f["kind"] for f in leaks["findings"]] == ["leak"]
    assert json.loads(text_of(client.call("findings", snapshot=str(LEAK), kinds=["oom"])))["findings"] == []
    assert "unknown finding kind" in error_of(client.call("findings", snapshot=str(LEAK), kinds=["leek"]))


@pytest.mark.timeout(300)
def test_group_by_diff_whatif_and_budget_are_the_cli_json(client: StdioClient) -> None:
    assert text_of(client.call("group_by", snapshot=str(LEAK), group_by="file", at="step2")) == cli_json(
        "triage", str(LEAK), "--group-by", "file", "--at", "step2", "--json")
    rank0, rank1 = (str(SAMPLE_SNAPSHOTS_DIR / f"ddp_rank{r}.pickle") for r in (0, 1))
    assert text_of(client.call("diff", before=rank0, after=rank1, top=5)) == cli_json(
        "diff", rank0, rank1, "--top", "5", "--json")
    assert text_of(client.call("whatif", snapshot=str(LEAK), expandable_segments=True, capacity="24MiB")) == cli_json(
        "whatif", str(LEAK), "--expandable-segments", "--capacity", "24MiB", "--json")
    assert text_of(client.call("budget", params="7e9", seq=2048, hidden=4096, layers=32, heads=32,
                               capacity=["80GB", "24GiB"])) == cli_json(
        "budget", "--params", "7e9", "--seq", "2048", "--hidden", "4096", "--layers", "32", "--heads", "32",
        "--capacity", "80GB", "--capacity", "24GiB", "--json")
    # Numbers where the CLI takes text: an assistant writes 7e9 and 80 as JSON numbers.
    assert text_of(client.call("budget", params=7e9, capacity=[80])) == cli_json(
        "budget", "--params", "7e9", "--capacity", "80", "--json")


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
    assert policy.check(str(inside / "a.pickle")) == str(inside / "a.pickle")
    with pytest.raises(MemlensUsageError, match="outside the folders"):
        policy.check(str(LEAK))
    with pytest.raises(MemlensUsageError, match="outside the folders"):
        policy.check(str(inside / ".." / ".." / LEAK))
    (inside / "escape.pickle").symlink_to(LEAK)  # a link out of the root is judged by its target
    with pytest.raises(MemlensUsageError, match="outside the folders"):
        policy.check(str(inside / "escape.pickle"))
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
