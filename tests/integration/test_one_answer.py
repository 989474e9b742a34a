"""One answer wherever you look: for a run recorded with ``memlens.record`` (with its sidecar) and
for a foreign snapshot PyTorch wrote, ``memlens triage --json``, the terminal screen, the MCP
``triage`` tool (driven by the MCP SDK's own client) and the dashboard give the same peaks,
findings, categories and budget ratios (the recorder's sidecar's budget, or the one a user states
for a foreign file): all four render the one ``memlens.ops`` answer.

The dashboard is read without a browser: the file analysed by its worker (the child process every
upload is analysed in), then the panel functions its callbacks hand that analysis to (the cards,
the live breakdown at the peak, the finding cards, the budget table), their Dash components walked
for the text the page shows."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.reporters.terminal import KIND_LABEL
from memlens.units import format_bytes
from tests.conftest import REPO_ROOT, real_snapshot_paths

pytest.importorskip("mcp")
torch = pytest.importorskip("torch")

WIDTH = "400"  # wide enough that no row of the screen wraps
FINDING_HEAD = re.compile(r"^\s+\d+\. (?P<label>[A-Z ]+?) (?P<severity>high|medium|low) · (?P<bytes>[^·]+?) ·")
CATEGORY_ROW = re.compile(r"^  (?P<name>[a-z_]+)\s+(?P<bytes>\d[\d.,]* [KMGTP]?i?B)\s+\d+%")
BUDGET_ROW = re.compile(r"^(?P<name>[a-z_]+)\s+(?P<theory>n/a|\d[\d.,]* [KMGTP]?i?B)\s+"
                        r"(?P<measured>-|\d[\d.,]* [KMGTP]?i?B)(?:\s+(?P<ratio>\d+\.\d\dx))?")


def recorded_run(folder: Path) -> Path:
    """A tiny language model trained four steps on the CPU under ``memlens.record``, keeping each
    step's logits (a leak): a snapshot and its sidecar."""
    from memlens.recorder import record
    from tests.examples import load_train_tiny

    tiny = load_train_tiny()
    torch.manual_seed(0)
    model = tiny.TinyLM(d_model=32, n_layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_out, kept = torch.randint(0, 256, (4, 33)), []
    clock = itertools.count(1_700_000_000_000_000).__next__
    with record(folder, model=model, optimizer=optimizer, clock=clock) as rec:
        for _ in range(4):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (4, 33)))
                kept.append(model(held_out[:, :-1]).logsumexp(-1).mean())
    return Path(rec.paths[-1])


def foreign_snapshot() -> Path:
    """The smallest snapshot of the real-snapshot folder (whichever folder the tests run over)."""
    paths = real_snapshot_paths()
    if not paths:
        pytest.skip("no real snapshots to run over")
    return min(paths, key=lambda p: (p.stat().st_size, p.name))


def mcp_triage(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``triage`` tool's answer to each call's arguments, through the MCP SDK's client over stdio."""
    from mcp import ClientSession, StdioServerParameters, stdio_client

    async def session() -> list[str]:
        server = StdioServerParameters(command=sys.executable, args=["-m", "memlens", "mcp"], cwd=str(REPO_ROOT))
        async with stdio_client(server) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            texts = []
            for arguments in calls:
                answer = await client.call_tool("triage", arguments)
                assert not answer.is_error, answer
                texts.append(answer.content[0].text)  # type: ignore[union-attr]
            return texts

    return [json.loads(text) for text in asyncio.run(session())]


def cli_output(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


# The budget a user states for a file with no sidecar: as flags, and as the MCP tool's arguments.
BUDGET_FLAGS = ["--params", "1.5e9", "--optimizer", "adamw", "--precision", "bf16-mixed"]
BUDGET_ARGUMENTS = {"params": "1.5e9", "optimizer": "adamw", "precision": "bf16-mixed"}


Case = tuple[Path, list[str], dict[str, Any]]  # the file, the budget flags, the MCP tool's budget arguments


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    recorded, foreign = recorded_run(tmp_path_factory.mktemp("run")), foreign_snapshot()
    assert recorded.with_name("snapshot.memlens.json").is_file()  # the recorder's sidecar
    return {"recorded": (recorded, [], {}), "foreign": (foreign, [], {}),
            "foreign with a budget": (foreign, BUDGET_FLAGS, BUDGET_ARGUMENTS)}


@pytest.fixture(scope="module")
def answers(cases: dict[str, Case]) -> dict[str, tuple[dict[str, Any], str, dict[str, Any]]]:
    """case -> (triage --json, the terminal screen, the MCP triage tool's answer)."""
    tools = mcp_triage([{"snapshot": str(path), **arguments} for path, _, arguments in cases.values()])
    return {name: (json.loads(cli_output("triage", str(path), "--json", "--no-cache", *flags)),
                   cli_output("triage", str(path), "--width", WIDTH, "--no-color", "--no-cache", "--top", "1000",
                              *flags),
                   tool)
            for (name, (path, flags, _)), tool in zip(cases.items(), tools, strict=True)}


def screen(text: str) -> dict[str, Any]:
    """What the terminal screen says: the device detailed, the peaks, the findings (kind,
    severity, bytes), the categories at the peak and the budget's rows (ratio)."""
    lines = text.splitlines()
    device = int(re.search(r"· device (\d+) ·", text).group(1))  # type: ignore[union-attr]
    peaks = {what: re.search(rf"peak {what}\s+(\S+ \S+)", text).group(1)  # type: ignore[union-attr]
             for what in ("allocated", "reserved")}
    labels = {label: kind for kind, label in KIND_LABEL.items()}
    findings = [(labels[m["label"]], m["severity"], m["bytes"]) for m in map(FINDING_HEAD.match, lines) if m]

    def section(heading: str) -> list[str]:
        start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
        if start is None:
            return []
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
        return lines[start + 1:end]

    categories = {m["name"]: m["bytes"] for m in map(CATEGORY_ROW.match, section("Live at the peak")) if m}
    budget_lines = section("Budget")
    budget = {m["name"]: (m["theory"], m["measured"], m["ratio"] or "")
              for m in map(BUDGET_ROW.match, budget_lines[1:]) if m}  # [0] is the header row
    return {"device": device, "peaks": peaks, "findings": findings, "categories": categories,
            "budget": budget if budget_lines else None}


def expected_screen(report: dict[str, Any], device: int) -> dict[str, Any]:
    """What the screen should say of ``device``, from the JSON report."""
    shown = report["devices"][str(device)]
    budget = shown["budget"]
    return {
        "device": device,
        "peaks": {what: format_bytes(shown[f"peak_{what}_bytes"]) for what in ("allocated", "reserved")},
        "findings": [(f["kind"], f["severity"], format_bytes(f["bytes"])) for f in shown["findings"]],
        "categories": {name: format_bytes(value) for name, value in shown["categories_at_peak"].items() if value > 0},
        "budget": None if budget is None else {
            row["category"]: ("n/a" if row["theory_bytes"] is None else format_bytes(row["theory_bytes"]),
                              "-" if row["measured_bytes"] is None else format_bytes(row["measured_bytes"]),
                              "" if row["ratio"] is None else f"{row['ratio']:.2f}x")
            for row in budget["rows"]},
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["recorded", "foreign", "foreign with a budget"])
def test_json_screen_and_mcp_give_one_answer(answers: dict[str, Any], name: str) -> None:
    report, text, tool = answers[name]
    assert tool == report  # the MCP tool's answer is triage --json's, every field
    said = screen(text)
    assert said == expected_screen(report, said["device"])
    if name == "recorded":  # the sidecar sets the budget beside the measurement, on every face
        budget = report["devices"][str(said["device"])]["budget"]
        assert budget is not None and budget["rows"][0]["category"] == "parameters"
        assert budget["rows"][0]["ratio"] is not None and budget["rows"][0]["verdict"] == "within"
        assert [f["kind"] for f in report["findings"]][:1] == ["leak"]
    if name == "foreign with a budget":  # no sidecar: the budget the user stated, on every face
        assert report["devices"][str(said["device"])]["budget"] is not None


# --------------------------------------------------------------------------- the dashboard


def components(root: Any) -> Any:
    """``root`` (a component, a string or a list of them) and every one below it, depth first."""
    if isinstance(root, list | tuple):
        for item in root:
            yield from components(item)
        return
    yield root
    children = getattr(root, "children", None)
    if children is not None:
        yield from components(children)


def text_of(component: Any) -> str:
    return "".join(part for part in components(component) if isinstance(part, str))


def with_class(root: Any, name: str) -> list[Any]:
    return [c for c in components(root) if name in (getattr(c, "className", None) or "").split()]


def dashboard_screen(path: Path, device: int, budget: dict[str, Any]) -> dict[str, Any]:
    """What the dashboard shows of ``device`` of ``path``, as ``screen`` reads the terminal's:
    ``budget`` holds the form's fields the user typed (none: as the page filled it)."""
    from memlens.figures import finding_title
    from memlens_app.panels.budget import SIDECAR_FIELDS, BudgetForm, budget_panel, budget_prefill
    from memlens_app.panels.live import live_panel
    from memlens_app.panels.overview import overview
    from memlens_app.panels.timeline import findings_panel
    from memlens_app.worker import AnalysisLimits, WorkerGroup, analyse_in_worker

    analysis = analyse_in_worker(str(path), uploaded=False, limits=AnalysisLimits(timeout_s=300),
                                 workers=WorkerGroup())
    report = analysis.report
    cards = overview(report, device).cards
    live = live_panel(analysis, device)  # the "At the peak" tab, grouped by category
    assert live.live.is_peak and live.heading.endswith(format_bytes(live.live.total_bytes))
    titles = {finding_title(kind): kind for kind in KIND_LABEL}
    findings = [(titles[text_of(with_class(card, "finding-kind")[0])], text_of(with_class(card, "badge")[0]),
                 text_of(with_class(card, "finding-bytes")[0]))
                for card in with_class(findings_panel(report.device(device)), "finding")]
    prefill = budget_prefill(report.sidecar, report.device(device).categories_at_peak.get("parameters", 0))
    form = BudgetForm(**{**{field: prefill.value(field) for field in SIDECAR_FIELDS}, **budget},
                      prefill=prefill.store())
    rows = with_class(budget_panel(report, device, form).summary, "budget-row")
    cells = [[text_of(with_class(row, f"budget-{column}")[0]) for column in ("category", "theory", "measured", "ratio")]
             for row in rows]
    return {"device": device, "peaks": {"allocated": text_of(cards[0][0]), "reserved": text_of(cards[1][0])},
            "findings": findings, "live": live.live.total_bytes, "categories": live.live.categories,
            "budget": {category: (theory, measured, ratio) for category, theory, measured, ratio in cells} or None}


# The budget the user types into the dashboard's form for a file with no sidecar.
BUDGET_FORM = {"params": "1.5e9", "optimizer": "adamw", "precision": "bf16-mixed"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["recorded", "foreign", "foreign with a budget"])
def test_the_dashboard_gives_the_same_answer(cases: dict[str, Case], answers: dict[str, Any], name: str) -> None:
    report, text, _ = answers[name]
    path, flags, _ = cases[name]
    device = screen(text)["device"]  # the device the terminal details: the busiest
    said = dashboard_screen(path, device, BUDGET_FORM if flags else {})
    expected = expected_screen(report, device)
    shown = report["devices"][str(device)]
    assert said["peaks"] == expected["peaks"]
    assert said["findings"] == expected["findings"]  # kind, severity and bytes, most severe first
    assert said["live"] == shown["peak_allocated_bytes"]  # the live breakdown at the peak adds up to the peak
    assert said["categories"] == shown["categories_at_peak"]  # to the byte, every category
    assert said["budget"] == expected["budget"]
