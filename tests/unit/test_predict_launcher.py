"""A torchrun command line read as the script it launches and its world size (issue 36)."""

from __future__ import annotations

import pytest

from memlens.errors import MemlensUsageError
from memlens.predict.launcher import LaunchedCommand, read_launcher


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["torchrun", "--nproc-per-node", "4", "fsdp2.py", "--lr", "3"],
         LaunchedCommand(("python", "fsdp2.py", "--lr", "3"), 4, "torchrun")),
        (["/opt/venv/bin/torchrun", "--standalone", "--nproc_per_node=8", "train.py"],
         LaunchedCommand(("python", "train.py"), 8, "torchrun")),
        (["python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4", "-m", "pkg.train", "x"],
         LaunchedCommand(("python", "-m", "pkg.train", "x"), 8, "torchrun")),
        # Elastic: the fewest nodes, where each rank's share of a sharded model is largest.
        (["torchrun", "--nnodes=2:4", "--nproc-per-node=2", "train.py"],
         LaunchedCommand(("python", "train.py"), 4, "torchrun")),
        (["torchrun", "train.py"], LaunchedCommand(("python", "train.py"), 1, "torchrun")),
        # The script's own options are its own, even where they look like torchrun's.
        (["torchrun", "--nproc-per-node", "2", "train.py", "--nproc-per-node", "9"],
         LaunchedCommand(("python", "train.py", "--nproc-per-node", "9"), 2, "torchrun")),
        (["python", "train.py", "--nproc-per-node", "4"],
         LaunchedCommand(("python", "train.py", "--nproc-per-node", "4"))),
        (["-m", "pkg.train"], LaunchedCommand(("-m", "pkg.train"))),
    ],
)  # fmt: skip
def test_a_launch_is_read_as_torchrun_reads_it(command: list[str], expected: LaunchedCommand) -> None:
    assert read_launcher(command) == expected


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["torchrun"], "torchrun: the following arguments are required: training_script"),
        (["torchrun", "--nproc-per-node", "gpu", "t.py"], "torchrun --nproc-per-node gpu: give the number"),
        (["torchrun", "--nproc-per-node", "0", "t.py"], "torchrun --nproc-per-node 0: must be 1 or more"),
        (["torchrun", "--nnodes", "3:1", "t.py"], "torchrun --nnodes 3:1: needs 0 < MIN <= MAX"),
        (["torchrun", "--nnodes", "a", "t.py"], "torchrun --nnodes a: give N or MIN:MAX"),
        (["torchrun", "--no-python", "t.sh"], "torchrun --no-python: memlens runs Python scripts"),
        (["torchrun", "-h"], "torchrun -h is torchrun's help"),
    ],
)
def test_what_torchrun_would_refuse_is_one_line(
    command: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(MemlensUsageError) as raised:
        read_launcher(command)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)
    printed = capsys.readouterr()
    assert printed.out == printed.err == ""  # argparse's usage text is not printed over memlens' line
