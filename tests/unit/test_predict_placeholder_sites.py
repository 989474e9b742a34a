"""``--placeholder-values`` counts the values that stood in per line of the script and names each
line on a line of its own (issue 36), where it named only the first."""

from __future__ import annotations

import torch

from memlens.predict import predict
from memlens.reporters.predict import MAX_PLACEHOLDER_SITES, render


def test_each_line_whose_values_stood_in_is_counted_and_named() -> None:
    def step() -> None:
        x = torch.ones(3, device="cuda")
        for _ in range(3):
            x.sum().item()
        bool((x > 0).all())

    result = predict(step, placeholder_values=True)
    assert result.completed and result.placeholder_values == 4
    first_line = step.__code__.co_firstlineno
    assert result.placeholder_sites == {f"{__file__}:{first_line + 3}": 3, f"{__file__}:{first_line + 4}": 1}
    assert result.to_json()["placeholder_sites"] == result.placeholder_sites
    text = render(result).splitlines()
    head = next(index for index, line in enumerate(text) if line.startswith("  placeholders: 4 value(s)"))
    loop, check = f"{__file__}:{first_line + 3}", f"{__file__}:{first_line + 4}"
    assert text[head + 1:head + 3] == [f"    3x at {loop}", f"    1x at {check}"]


def test_many_lines_are_cut_with_what_is_left_said() -> None:
    lines = [f"x{i} = x.item()" for i in range(MAX_PLACEHOLDER_SITES + 2)]
    source = "def step():\n    x = torch.ones(1, device='cuda')\n" + "".join(f"    {line}\n" for line in lines)
    namespace: dict[str, object] = {"torch": torch}
    exec(compile(source, "many.py", "exec"), namespace)
    result = predict(namespace["step"], placeholder_values=True)  # type: ignore[arg-type]
    assert len(result.placeholder_sites) == MAX_PLACEHOLDER_SITES + 2
    text = render(result)
    assert text.count("    1x at many.py:") == MAX_PLACEHOLDER_SITES
    assert "    and 2 more at 2 other line(s) (--json lists all)" in text
