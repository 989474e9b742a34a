"""memlens.recorder.holders: from tensors a loop left alive to the name that holds them and the
line that stored them. Blocks are keyed by the storage's data pointer here (the recorder uses its
own storage table on the CPU and the same pointer on CUDA)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from memlens.recorder.holders import HolderLimits, find_holders, gc_tensors, old_live_blocks

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


class Blocks:
    """A fake block table: tensors registered as "allocated in an earlier step"."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}

    def add(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self.sizes[storage.data_ptr()] = storage.nbytes()

    def address_of(self, tensor: Any) -> int | None:
        pointer = tensor.untyped_storage().data_ptr()
        return pointer if pointer in self.sizes else None

    def search(self, **limits: Any) -> dict[str, Any]:
        return find_holders(gc_tensors(), self.address_of, dict(self.sizes), limits=HolderLimits(**limits))


def load_module(tmp_path: Path, name: str, source: str) -> types.ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def holder(result: dict[str, Any], text: str) -> dict[str, Any]:
    matches = [h for h in result.holders if h.holder == text]
    assert matches, [h.holder for h in result.holders]
    return matches[0]


@pytest.fixture
def module_cleanup() -> Any:
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.mark.usefixtures("module_cleanup")
def test_a_global_list_is_named_with_the_line_that_appends(tmp_path: Path) -> None:
    module = load_module(tmp_path, "loop_global", """
        import torch

        kept = []


        def step(i):
            out = torch.full((4, 8), float(i))
            kept.append(out)  # line 9
            return out.sum().item()
    """)
    for i in range(3):
        module.step(i)
    blocks = Blocks()
    blocks.add(*module.kept)
    result = blocks.search()
    found = holder(result, "list `kept` (global in loop_global.py)")
    assert found.kind == "global" and found.container == "list"
    assert found.count == 3 and found.bytes == 3 * 4 * 8 * 4
    assert found.line == "loop_global.py:9"
    assert found.lines[0].code == "kept.append(out)" and found.lines[0].how == "append"
    assert sorted(address for address, _ in found.blocks) == sorted(blocks.sizes)
    assert found.example == "kept[0]"
    assert result.complete is True


@pytest.mark.usefixtures("module_cleanup")
def test_a_module_attribute_names_the_module_class_and_its_append(tmp_path: Path) -> None:
    module = load_module(tmp_path, "cache_model", """
        import torch


        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 8)
                self.cache = []

            def forward(self, x):
                y = self.linear(x)
                self.cache.append(y.detach())  # line 13
                return y
    """)
    model = module.Model()
    for _ in range(3):
        model(torch.randn(2, 8))
    blocks = Blocks()
    blocks.add(*model.cache)
    found = holder(blocks.search(), "list `self.cache` of module `Model`")
    assert found.kind == "attribute" and found.count == 3
    assert found.line == "cache_model.py:13"
    assert found.lines[0].code == "self.cache.append(y.detach())"


@pytest.mark.usefixtures("module_cleanup")
def test_a_dict_gives_its_keys_and_the_item_assignment(tmp_path: Path) -> None:
    module = load_module(tmp_path, "dict_cache", """
        import torch

        outputs = {}


        def step(i):
            outputs[f"step{i}"] = torch.ones(16) * i  # line 8
    """)
    for i in range(2):
        module.step(i)
    blocks = Blocks()
    blocks.add(*module.outputs.values())
    found = holder(blocks.search(), "dict `outputs` (global in dict_cache.py)")
    assert found.keys == ("['step0']", "['step1']")
    assert found.line == "dict_cache.py:8" and found.lines[0].how == "item assignment"
    assert found.example == "outputs['step0']"


@pytest.mark.usefixtures("module_cleanup")
def test_a_cycle_ends_at_the_name_and_an_unnamed_cycle_names_nothing(tmp_path: Path) -> None:
    module = load_module(tmp_path, "cycles", """
        import torch

        named = []


        def build():
            inner = [torch.zeros(32)]
            named.append(inner)
            inner.append(named)  # named -> inner -> named
            a, b = [torch.ones(64)], []
            a.append(b)
            b.append(a)  # a <-> b, referred to by nothing else
            return named[0][0], a[0]
    """)
    kept_in_named, kept_in_cycle = module.build()
    blocks = Blocks()
    blocks.add(kept_in_named, kept_in_cycle)
    del kept_in_named, kept_in_cycle
    result = blocks.search()
    found = holder(result, "list `named` (global in cycles.py)")
    assert found.example == "named[0][0]" and found.bytes == 32 * 4
    # the a <-> b cycle holds a tensor but nothing names it: no holder is invented for it
    assert all(h.bytes != 64 * 4 for h in result.holders)
    assert result.complete is True


def test_a_tensor_only_a_frame_local_holds_is_that_local() -> None:
    def leaky_function() -> dict[str, Any]:
        only_here = torch.arange(100, dtype=torch.float32)
        blocks = Blocks()
        blocks.add(only_here)
        return blocks.search()

    result = leaky_function()
    found = holder(result, f"tensor `only_here` (local in leaky_function(), {Path(__file__).name})")
    assert found.kind == "local" and found.bytes == 400
    assert found.lines[0].code == "only_here = torch.arange(100, dtype=torch.float32)"
    assert found.lines[0].how == "assignment"


@pytest.mark.usefixtures("module_cleanup")
def test_a_kept_loss_holds_its_graph_through_autograd(tmp_path: Path) -> None:
    module = load_module(tmp_path, "kept_loss", """
        import torch

        losses = []
        weight = torch.nn.Parameter(torch.randn(16, 16))


        def step():
            hidden = torch.tanh(torch.randn(8, 16) @ weight)
            loss = (hidden @ weight).square().mean()
            losses.append(loss)
            return hidden
    """)
    hidden = module.step()
    blocks = Blocks()
    blocks.add(module.losses[0], hidden)  # tanh's output is saved for backward
    del hidden
    found = holder(blocks.search(), "list `losses` (global in kept_loss.py)")
    assert found.blocks_direct == 1 and found.blocks_through_graph == 1
    assert found.bytes == 4 + 8 * 16 * 4


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("module_cleanup")
def test_the_search_is_bounded_on_a_heap_of_100k_objects(tmp_path: Path) -> None:
    module = load_module(tmp_path, "big_heap", """
        import torch

        kept = []
        # 100k unrelated objects the walk has to look through
        clutter = [{"index": i, "values": [i, i + 1]} for i in range(50_000)]
        more = [[i] for i in range(50_000)]


        def step():
            kept.append(torch.zeros(8))
    """)
    module.step()
    blocks = Blocks()
    blocks.add(*module.kept)
    found = holder(blocks.search(), "list `kept` (global in big_heap.py)")
    assert found.line == "big_heap.py:11"
    # With no time at all, the search stops and says so instead of running on.
    stopped = blocks.search(max_seconds=0.0)
    assert stopped.complete is False and stopped.stopped_by == "time"
    # A depth of one level cannot reach a name two levels up (list -> module globals).
    shallow = blocks.search(max_depth=1)
    assert "list `kept` (global in big_heap.py)" not in [h.holder for h in shallow.holders]


def test_old_live_blocks_are_the_ones_allocated_in_finished_steps_and_not_freed() -> None:
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 0x1000, "size": 512, "time_us": 5},  # before the steps
        {"action": "alloc", "addr": 0x2000, "size": 1024, "time_us": 15},
        {"action": "alloc", "addr": 0x3000, "size": 2048, "time_us": 16},
        {"action": "free_completed", "addr": 0x3000, "size": 2048, "time_us": 17},
        {"action": "alloc", "addr": 0x4000, "size": 4096, "time_us": 35},  # after the last step ended
    ]]}
    assert old_live_blocks(snapshot, (10, 30)) == {0x2000: 1024}


class FakeTracker:
    """The CPU recorder's storage table: id(storage) -> simulated address."""

    def __init__(self) -> None:
        self._live: dict[int, int] = {}


class FakeBackend:
    def __init__(self) -> None:
        self.tracker = FakeTracker()


def _alloc(trace: list[dict[str, Any]], backend: FakeBackend, tensor: torch.Tensor, time_us: int) -> None:
    address = 0x10000 * (len(trace) + 1)
    backend.tracker._live[id(tensor.untyped_storage())] = address
    trace.append({"action": "alloc", "addr": address, "size": tensor.untyped_storage().nbytes(), "time_us": time_us})


@pytest.mark.usefixtures("module_cleanup")
def test_the_dump_searches_from_blocks_that_outlived_a_whole_step(tmp_path: Path) -> None:
    from memlens.recorder.holders import leak_holders

    module = load_module(tmp_path, "two_steps", """
        import torch

        kept = []
        previous = None
    """)
    backend = FakeBackend()
    trace: list[dict[str, Any]] = []
    steps = [{"index": 0, "start_us": 100, "end_us": 199}, {"index": 1, "start_us": 200, "end_us": 299}]
    # a hand-over made in the last step (prev = out) outlived no step: nothing to search from
    module.previous = previous = torch.zeros(64)  # type: ignore[attr-defined]
    _alloc(trace, backend, previous, 250)
    del previous
    quiet = leak_holders({"device_traces": [trace]}, steps, backend)
    assert quiet.holders == [] and quiet.old_blocks == 0
    # a tensor kept from step 0 outlived step 1: the list is found, and counts the last step's too
    module.kept.extend([torch.ones(32), torch.ones(16)])
    _alloc(trace, backend, module.kept[0], 150)
    _alloc(trace, backend, module.kept[1], 260)
    found = leak_holders({"device_traces": [trace]}, steps, backend)
    kept = holder(found, "list `kept` (global in two_steps.py)")
    assert kept.count == 2 and kept.bytes == 32 * 4 + 16 * 4
    assert [h.holder for h in found.holders] == ["list `kept` (global in two_steps.py)"]
    # a single finished step cannot show anything kept across steps
    assert leak_holders({"device_traces": [trace]}, steps[:1], backend).holders == []


def test_on_cuda_a_storage_is_found_by_its_data_pointer() -> None:
    from memlens.recorder.holders import storage_address_function

    class Storage:
        def data_ptr(self) -> int:
            return 0x7F00_0000_0200

    class CudaTensor:
        device = torch.device("cuda", 0)

        def untyped_storage(self) -> Storage:
            return Storage()

    address_of = storage_address_function(object())  # a backend without a CPU storage table
    assert address_of(CudaTensor()) == 0x7F00_0000_0200
    assert address_of(torch.zeros(4)) is None  # a CPU tensor is not on the recorded device


def test_reading_a_loops_locals_does_not_keep_them_alive() -> None:
    import weakref

    def loop() -> bool:
        loss = torch.ones(8)
        blocks = Blocks()
        blocks.add(loss)
        blocks.search()  # reads this frame's locals
        dead = weakref.ref(loss)
        loss = torch.zeros(8)  # the loop rebinds its loss: the old one must go
        return dead() is None

    assert loop()


@pytest.mark.usefixtures("module_cleanup")
def test_a_container_filled_elsewhere_shows_where_its_name_is_bound(tmp_path: Path) -> None:
    module = load_module(tmp_path, "filled_elsewhere", """
        import torch


        def train():
            return [torch.ones(4) for _ in range(2)]


        kept = train()  # line 9
    """)
    blocks = Blocks()
    blocks.add(*module.kept)
    found = holder(blocks.search(), "list `kept` (global in filled_elsewhere.py)")
    assert [{key: getattr(line, key) for key in ("file", "line", "how", "code")} for line in found.lines] == [
        {"file": "filled_elsewhere.py", "line": 9, "how": "assignment", "code": "kept = train()"}]


@pytest.mark.usefixtures("module_cleanup")
def test_a_hook_closure_that_keeps_outputs_is_named_by_its_free_variable(tmp_path: Path) -> None:
    module = load_module(tmp_path, "hooks", """
        import torch


        def attach(model):
            outputs = []

            def keep(module, args, output):
                outputs.append(output)  # line 9

            return model.register_forward_hook(keep)
    """)
    model = torch.nn.Linear(4, 4)
    handle = module.attach(model)
    with torch.no_grad():
        kept = [model(torch.randn(2, 4)) for _ in range(2)]
    blocks = Blocks()
    blocks.add(*kept)
    del kept
    found = holder(blocks.search(), "list `outputs` (closure variable of attach.<locals>.keep())")
    assert found.kind == "closure" and found.count == 2
    assert found.line == "hooks.py:9"
    handle.remove()


@pytest.mark.usefixtures("module_cleanup")
def test_class_and_function_attributes_are_named_as_such(tmp_path: Path) -> None:
    module = load_module(tmp_path, "attributes", """
        import torch


        class Registry:
            items = []


        def log(value):
            log.seen.append(value)  # line 10


        log.seen = []


        def step():
            Registry.items.append(torch.ones(3))  # line 17
            log(torch.ones(5))
    """)
    module.step()
    blocks = Blocks()
    blocks.add(*module.Registry.items, *module.log.seen)
    result = blocks.search()
    in_class = holder(result, "list `items` of class `Registry`")
    assert in_class.kind == "class attribute" and in_class.line == "attributes.py:17"
    on_function = holder(result, "list `seen` of function log()")
    assert on_function.kind == "function attribute" and on_function.line == "attributes.py:10"


@pytest.mark.usefixtures("module_cleanup")
def test_a_local_of_the_same_name_elsewhere_is_not_the_globals_line(tmp_path: Path) -> None:
    module = load_module(tmp_path, "shadowed", """
        import torch

        kept = []


        def unrelated():
            kept = []
            kept.append(1)  # line 9: a local that only shares the name
            return kept


        def step():
            kept.append(torch.ones(2))  # line 14
    """)
    module.step()
    blocks = Blocks()
    blocks.add(*module.kept)
    found = holder(blocks.search(), "list `kept` (global in shadowed.py)")
    assert [line.line for line in found.lines] == [14]


@pytest.mark.usefixtures("module_cleanup")
def test_each_line_says_where_the_value_it_stores_can_have_been_allocated(tmp_path: Path) -> None:
    module = load_module(tmp_path, "branches", """
        import torch

        history = []


        def step(i, mode):
            global history
            logits = torch.full((4, 8), float(i))  # line 9
            loss = logits.sum()  # line 10
            if mode == 0:
                history.append(loss)  # line 12
            elif mode == 1:
                history.append(logits.detach())  # line 14
            else:
                history.append(logits * 2)  # line 16
            history.extend([loss, logits])  # line 17
            history += [torch.cat([logits, logits])]  # line 18
    """)
    for i in range(2):
        module.step(i, 1)
    blocks = Blocks()
    blocks.add(*[t for t in module.history if t.dim() == 2 and t.shape[0] == 4])
    found = holder(blocks.search(), "list `history` (global in branches.py)")
    values = {line.line: line.values_from for line in found.lines}
    # a name stored: where it was assigned (and the line itself); a value made on the line: the line
    assert values == {12: (10, 12), 14: (9, 14), 16: (16,), 17: (9, 10, 17), 18: (18,)}
    assert {line.function for line in found.lines} == {"step"}
    assert all(line.first_line == 7 and line.last_line == 18 for line in found.lines)


def test_a_parameter_made_from_a_fake_tensor_is_the_model_not_a_leak_candidate() -> None:
    """memlens predict's parameters are FakeTensors marked ``_is_param`` (not instances of the
    Parameter class): they are the model, as a real one is, and never a holder's tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = torch.nn.Linear(4, 4)
        kept = torch.empty(4, 4)
    found = {id(tensor) for tensor in gc_tensors()}
    assert id(kept) in found
    assert id(layer.weight) not in found and id(layer.bias) not in found
