"""Small training loops with a known leak (on the CPU unless told), for the leak recall tests.

Run as a script (recorded by ``memlens record -- python leaky_loop.py PATTERN STEPS [DEVICE]``: a step
ends at every ``optimizer.step()``) or imported (``train(PATTERN, STEPS, step_scope)``, with
``rec.step`` of ``memlens.record`` as the scope). Each pattern keeps something from every step;
``leak_line`` names the line that allocates what is kept, and ``expected_bytes_per_step`` what
a caching allocator holds for it (its 512-byte rounding included).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

BATCH, FEATURES, HIDDEN, CLASSES = 8, 32, 64, 10
# Tens of KiB and hundreds of KiB kept per step (float32 elements).
TENS_OF_KIB_ELEMENTS = 6_000  # 24,000 bytes
HUNDREDS_OF_KIB_ELEMENTS = 75_000  # 300,000 bytes
# Exactly 1 MiB a step: the size the old slope threshold caught or missed by rounding.
ONE_MIB_ELEMENTS = 262_144
# "healthy" keeps floats; "handover" keeps only the latest step's logits (prev = logits): no leak.
PATTERNS = ("healthy", "handover", "loss", "tens_kib", "hundreds_kib", "one_mib", "logits")
# The caching allocator rounds every block up to a multiple of 512 bytes.
ROUNDING = 512


def _rounded(nbytes: int) -> int:
    return max(ROUNDING, -(-nbytes // ROUNDING) * ROUNDING)


def expected_bytes_per_step(pattern: str) -> int:
    """Bytes a leak of ``pattern`` keeps per step, as the allocator holds them."""
    return {
        "healthy": 0,
        "handover": 0,
        "loss": _rounded(4),  # a 0-d float32 loss: one 512-byte block (its graph is freed by backward)
        "tens_kib": _rounded(4 * TENS_OF_KIB_ELEMENTS),
        "hundreds_kib": _rounded(4 * HUNDREDS_OF_KIB_ELEMENTS),
        "one_mib": _rounded(4 * ONE_MIB_ELEMENTS),
        "logits": _rounded(4 * BATCH * CLASSES),
    }[pattern]


def train(
    pattern: str,
    steps: int,
    step_scope: Callable[[], AbstractContextManager[Any]] | None = None,
    device: str = "cpu",
) -> list[Any]:
    """``steps`` steps of a two-layer MLP with AdamW on ``device``; returns what the loop kept."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}: one of {PATTERNS}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(BATCH, FEATURES, device=device)
    targets = torch.randint(0, CLASSES, (BATCH,), device=device)
    kept: list[Any] = []
    scope = step_scope or contextlib.nullcontext
    for _ in range(steps):
        with scope():
            optimizer.zero_grad()
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits, targets)  # leak line: loss
            loss.backward()
            optimizer.step()
            if pattern == "loss":
                kept.append(loss)  # the recipe's mistake: loss, not loss.item()
            elif pattern == "tens_kib":
                kept.append(torch.zeros(TENS_OF_KIB_ELEMENTS, device=device))  # leak line: tens_kib
            elif pattern == "hundreds_kib":
                kept.append(torch.zeros(HUNDREDS_OF_KIB_ELEMENTS, device=device))  # leak line: hundreds_kib
            elif pattern == "one_mib":
                kept.append(torch.zeros(ONE_MIB_ELEMENTS, device=device))  # leak line: one_mib
            elif pattern == "logits":
                kept.append(logits.detach())
            elif pattern == "handover":
                kept[:] = [logits.detach()]
            else:
                kept.append(loss.item())
    return kept


def leak_line(pattern: str) -> int:
    """Line number of the statement that allocates what ``pattern`` keeps."""
    marker = {"loss": "leak line: loss", "logits": "logits = model(inputs)"}.get(pattern, f"leak line: {pattern}")
    with open(__file__, encoding="utf-8") as source:
        for number, text in enumerate(source, start=1):
            if marker in text and "marker" not in text:
                return number
    raise LookupError(marker)


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), device=sys.argv[3] if len(sys.argv) > 3 else "cpu")
