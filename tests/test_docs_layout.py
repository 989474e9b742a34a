"""The architecture page's "Layout" section (docs/architecture.md) matches the tree: a newcomer's map that cannot drift.

Each folder of the repository, each subpackage of ``memlens/`` and ``app/``, and each module in
them is named in the section's block (a module by its name without ``.py``, inside its folder's
entry); each folder the section names exists.
"""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO_ROOT

ENTRY = re.compile(r"^( {0,4})([A-Za-z0-9_.]+/)")  # a name at the left; deeper lines continue an entry


def layout_block() -> list[str]:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].splitlines()[1:]


def entries(lines: list[str]) -> dict[str, str]:
    """``{"memlens/analysis/": "the text of that entry", ...}``: an entry runs from its name to
    the next name at the same or a shallower indentation."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    current: list[str] = []
    for line in lines:
        match = ENTRY.match(line)
        if match:
            indent, name = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = "".join(n for _, n in stack) + name
            stack.append((indent, name))
            current = [line[match.end():]]
            found[path] = ""
        elif stack:
            current.append(line)
        if stack:
            found["".join(n for _, n in stack)] = " ".join(current)
    return found


def tracked_dirs() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return {f.split("/", 1)[0] + "/" for f in files if "/" in f and not f.startswith(".")}


def test_every_folder_package_and_module_is_on_the_map() -> None:
    block = entries(layout_block())
    assert "memlens/" in block and "app/" in block  # the parser found the map
    missing = sorted(d for d in tracked_dirs() if d not in block)
    assert not missing, f"docs/architecture.md Layout lacks {missing}"
    for top in ("memlens", "app"):
        for folder in sorted(p for p in (REPO_ROOT / top).rglob("*") if (p / "__init__.py").is_file()):
            key = folder.relative_to(REPO_ROOT).as_posix() + "/"
            if folder == REPO_ROOT / top:
                # The package's own modules are listed among its folders' entries.
                text = " ".join(v for k, v in block.items() if k.startswith(f"{top}/"))
            else:
                assert key in block, f"docs/architecture.md Layout lacks {key}"
                text = block[key]
            for module in sorted(folder.glob("*.py")):
                if module.stem in ("__init__", "__main__"):
                    continue
                assert re.search(rf"\b{re.escape(module.stem)}\b", text), (
                    f"README Layout: {key} does not mention {module.stem}")


def test_every_folder_on_the_map_exists() -> None:
    for key in entries(layout_block()):
        assert (REPO_ROOT / key).is_dir(), f"README Layout names {key}, which does not exist"
