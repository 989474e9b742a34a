"""Who holds a leak: from the blocks a training loop left alive to the name that keeps them.

When the recorder dumps, the blocks allocated in an earlier step and still alive are the leak's
candidates. This module finds the Python object that keeps each of them alive and the line that
put it there, and the sidecar carries the answer (``leak_holders``) to ``memlens.analysis.leak``,
which matches it to the leak's surviving blocks by address.

How a block is traced to a name
-------------------------------
1. **Tensors to blocks.** Every tensor the garbage collector tracks is mapped to the address of
   its storage (on the CPU the recorder's own storage table, on CUDA ``data_ptr()``, which is the
   caching allocator's block address). A tensor whose storage is one of the old blocks holds it
   directly. Such a tensor may also carry an autograd graph (``kept.append(loss)`` keeps the whole
   forward of that loss): its ``grad_fn`` nodes are walked and the tensors they saved for backward
   (the ``_saved_*`` attributes PyTorch exposes) hold blocks too. The graph is invisible to the
   garbage collector (it lives in C++), so this walk is the only way to see it.
2. **Tensors to names.** From those tensors, ``gc.get_referrers`` is asked, one level at a time for
   the whole frontier (one scan of the heap per level, not per object), which objects refer to
   them, until a level names them: a module's globals (``kept`` in train.py), an object's
   attribute (``self.cache`` of a ``Model``), a class attribute, a closure variable, a local of a
   frame. Frames still executing do not show their locals to the collector, so the locals of every
   thread's stack are read once up front. The walk skips memlens' own frames and objects, the
   lists it builds itself and gc's bookkeeping, and is bounded by depth, objects visited and time.
3. **Name to line.** Python cannot say which instruction stored an object, so the line is found
   in the code that can mutate that name: for a global, the module's source is compiled and every
   code object searched; for a local, the frame's code; for an attribute, the methods of the
   object's class. A line counts when it loads the name and then calls a method that inserts
   (``append``, ``extend``, ``insert``, ``add``, ``update``, ``setdefault`` ...) or stores an item
   (``kept[k] = ...``); for a tensor held directly by the name, the lines that assign it. This is
   cheap (no tracing while training) and exact about which lines can have stored into the holder;
   when several lines can, all are listed.
4. **Which line ran.** Each listed line carries what the analysis needs to tell, from a leaked
   block's own allocation stack, whether that line stored it: the function it is in
   (``function``, ``first_line``, ``last_line``) and ``values_from``, the lines of that function
   where the value it stores can have been allocated (the line itself, for ``kept.append(x * 2)``
   or ``.clone()``, and the lines that assign each name it stores, ``logits = model(x)`` for
   ``kept.append(logits)``). A block whose stack passes through that function at one of those
   lines was stored there (``memlens.analysis.leak``).

Everything here is bounded by ``HolderLimits``; ``complete`` in the result says whether the
search finished within them. The result is a ``memlens.sidecar.leak_holders.LeakHolders``, the
struct the analysis reads back.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import gc
import inspect
import io
import linecache
import os
import sys
import time
import tokenize
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from memlens.sidecar.leak_holders import Holder, HolderSearchLimits, LeakHolders, StoreLine

_MEMLENS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Methods that put something into the container they are called on.
MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "add", "update", "setdefault", "appendleft", "extendleft",
    "put", "put_nowait", "__setitem__", "__iadd__",
})
# How each kind of name is loaded and stored in bytecode: a global's lines are never a local's
# of the same name in another function, nor a closure's.
_NAME_OPS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "global": (frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"}),
               frozenset({"STORE_GLOBAL", "STORE_NAME"})),
    "local": (frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_DEREF", "LOAD_NAME"}),
              frozenset({"STORE_FAST", "STORE_DEREF", "STORE_NAME"})),
    "closure": (frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"}), frozenset({"STORE_DEREF"})),
}
_METHOD_OPS = frozenset({"LOAD_METHOD", "LOAD_ATTR"})
_CONTAINER_TYPES = (list, tuple, dict, set, frozenset, deque)
# Lines listed per holder: enough that the one that ran is among them (the analysis picks it).
MAX_LINES = 20
MAX_CODE_TEXT = 200
MAX_KEYS = 5
MAX_NAMES_PER_TENSOR = 4
# Items looked at inside one named container for the blocks it holds.
MAX_CONTENTS = 100_000
# Types whose objects never hold a tensor or a container on a user's behalf: the heap scan
# skips them (after `import torch` they are a third of the heap).
_CANNOT_HOLD = frozenset({
    types.BuiltinFunctionType, types.MethodDescriptorType, types.GetSetDescriptorType,
    types.WrapperDescriptorType, types.MemberDescriptorType, types.MethodWrapperType,
    types.GenericAlias, types.UnionType, types.CodeType, weakref.ReferenceType, property,
})
# References to a tensor while ``_tensors_holding`` looks at it that are ours: the list of
# tensors, the loop variable and getrefcount's own argument.
_OUR_REFERENCES = 3
# Up to this many objects per level, gc.get_referrers itself is the faster search.
FEW_REFERRER_TARGETS = 8


@dataclass(frozen=True)
class HolderLimits:
    """Bounds on one search (defaults keep a dump of a large program within a few seconds)."""

    max_depth: int = 8  # referrer levels above a tensor
    max_objects: int = 20_000  # objects visited by the referrer walk
    max_graph_nodes: int = 100_000  # autograd nodes visited, all graphs together
    max_seconds: float = 5.0
    max_holders: int = 20
    max_blocks_per_holder: int = 2_000


@dataclass
class _Named:
    """How an object on a path is named: the terminal of a walk up from a tensor."""

    kind: str  # global | local | attribute | class attribute | closure
    name: str
    where: str  # human text: "global in train.py", "of module `Model`", ...
    code: list[types.CodeType] = field(default_factory=list)  # code to search for the line
    source_file: str | None = None  # a module's file: its source is compiled and searched
    is_attribute: bool = False


@dataclass
class _Search:
    limits: HolderLimits
    deadline: float
    own: set[int]  # ids of the containers this search built (they refer to everything)
    stopped: str = ""

    def out_of_time(self) -> bool:
        if not self.stopped and time.perf_counter() > self.deadline:
            self.stopped = "time"
        return bool(self.stopped)


# ------------------------------------------------------------------------------ entry points
def leak_holders(snapshot: Mapping[str, Any], steps: list[dict[str, Any]], backend: Any,
                 limits: HolderLimits | None = None, objects: Iterable[Any] | None = None) -> LeakHolders:
    """The sidecar's ``leak_holders`` for a snapshot the recorder is about to write.

    ``steps`` are the recorder's ``{index, start_us, end_us}``. The search starts from the blocks
    that outlived a whole later step (allocated before the last finished step began, alive now):
    a leak's pile always has some, a gradient or a hand-over (``prev = out``) has none, so a run
    without a leak costs almost nothing. A holder found from them then counts every block made
    in the steps that it holds (the last step's kept tensor too). ``objects``: where the tensors
    are looked for (``gc_tensors``).
    """
    limits = limits or HolderLimits()
    started = time.perf_counter()
    ended = sorted((s for s in steps if s.get("end_us") is not None and s.get("start_us") is not None),
                   key=lambda s: int(s["start_us"]))
    if len(ended) < 2:
        return LeakHolders(note="fewer than two finished steps")
    first_start, last_start, last_end = int(ended[0]["start_us"]), int(ended[-1]["start_us"]), int(ended[-1]["end_us"])
    live = live_allocations(snapshot)
    blocks = {address: size for address, (size, when) in live.items() if first_start <= when <= last_end}
    seeds = {address: size for address, (size, when) in live.items() if first_start <= when < last_start}
    if not seeds:
        return LeakHolders(seconds=round(time.perf_counter() - started, 3))
    address_of = storage_address_function(backend)
    filename_map = _filename_map_of(backend)
    result = find_holders(gc_tensors(objects), address_of, blocks, seeds=seeds, limits=limits,
                          filename_map=filename_map)
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def live_allocations(snapshot: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    """{address: (size, time_us of its alloc)} of the blocks the traces leave alive. Blocks
    allocated before the history began (parameters, or entries a ring buffer dropped) have no
    alloc entry and are not there."""
    live: dict[int, tuple[int, int]] = {}
    for trace in snapshot.get("device_traces") or []:
        for entry in trace or []:
            action = entry.get("action")
            address = entry.get("addr")
            if not isinstance(address, int):
                continue
            if action == "alloc":
                live[address] = (int(entry.get("size") or 0), int(entry.get("time_us") or 0))
            elif action in ("free_requested", "free_completed"):
                live.pop(address, None)
    return live


def old_live_blocks(snapshot: Mapping[str, Any], window: tuple[int, int]) -> dict[int, int]:
    """{address: size} of the blocks alive at the end of the traces allocated in ``window``
    (microseconds, inclusive)."""
    start, end = window
    return {address: size for address, (size, when) in live_allocations(snapshot).items() if start <= when <= end}


def gc_tensors(objects: Iterable[Any] | None = None) -> list[Any]:
    """Every tensor the garbage collector tracks (parameters excluded: they are the model), among
    ``objects`` when given (``memlens.recorder.roles.tracked_tensors_and_optimizers``: the
    tensors and optimizers of one walk a dump shares)."""
    import torch

    tensor_type, parameter_type, optimizer_type = torch.Tensor, torch.nn.Parameter, torch.optim.Optimizer
    tensors: list[Any] = []
    optimizers: list[Any] = []
    # type() rather than isinstance(): isinstance reads __class__, which some module attributes
    # answer with a deprecation warning.
    for obj in gc.get_objects() if objects is None else objects:
        kind = type(obj)
        if issubclass(kind, tensor_type):
            # isinstance, once it is a tensor: a parameter made from a fake tensor (memlens
            # predict) is a FakeTensor marked ``_is_param``, which only isinstance looks at.
            if not isinstance(obj, parameter_type):
                tensors.append(obj)
        elif issubclass(kind, optimizer_type):
            optimizers.append(obj)
    # Optimizer state is bounded by the parameters, never a leak (the analysis never counts it):
    # leaving it out spares the walk a dict per parameter.
    state_ids = {id(value) for optimizer in optimizers for per_parameter in _state_values(optimizer)
                 for value in per_parameter.values()}
    return [tensor for tensor in tensors if id(tensor) not in state_ids]


def _state_values(optimizer: Any) -> list[dict[str, Any]]:
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return []
    return [value for value in state.values() if isinstance(value, dict)]


def storage_address_function(backend: Any) -> Callable[[Any], int | None]:
    """tensor -> the snapshot address of its storage, for the recorder's backend."""
    tracker = getattr(backend, "tracker", None)
    live = getattr(tracker, "_live", None)  # CPU: id(storage) -> simulated address
    if isinstance(live, dict):
        def simulated(tensor: Any) -> int | None:
            try:
                return live.get(id(tensor.untyped_storage()))
            except (RuntimeError, NotImplementedError, TypeError):
                return None
        return simulated

    def device_pointer(tensor: Any) -> int | None:
        try:
            if tensor.device.type != "cuda":
                return None
            pointer = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        return int(pointer) or None

    return device_pointer


def _filename_map_of(backend: Any) -> Callable[[str], str] | None:
    stacks = getattr(getattr(backend, "tracker", None), "stacks", None)
    mapping = getattr(stacks, "_filename_map", None)
    return mapping if callable(mapping) else None


# ------------------------------------------------------------------------------ the search
def find_holders(
    tensors: list[Any],
    address_of: Callable[[Any], int | None],
    blocks: Mapping[int, int],
    *,
    seeds: Mapping[int, int] | None = None,
    limits: HolderLimits | None = None,
    filename_map: Callable[[str], str] | None = None,
) -> LeakHolders:
    """Who holds the ``blocks`` ({address: size}) among ``tensors`` (which the caller must not
    keep in any other container while this runs: it would show up as a referrer).

    With ``seeds`` (a part of ``blocks``), only tensors on those are traced up to a name; each
    holder found then counts every block of ``blocks`` it holds."""
    limits = limits or HolderLimits()
    search = _Search(limits, time.perf_counter() + limits.max_seconds, {id(tensors)})
    roots, direct = _tensors_holding(tensors, address_of, blocks if seeds is None else seeds, search)
    del tensors
    search.own.update({id(roots), id(direct)})
    locals_by_id: dict[int, list[tuple[str, types.FrameType]]] = {}
    paths: dict[int, list[_Path]] = {}
    try:
        locals_by_id = _frame_locals(search)
        paths = _walk_up(roots, locals_by_id, search)
        held_by_root = _held_through_graphs(roots, paths, direct, address_of, blocks, search)
        holders = _group(roots, held_by_root, paths, blocks, search, filename_map, address_of)
        return LeakHolders(
            holders=holders[: limits.max_holders],
            holders_total=len(holders),
            complete=not search.stopped,
            stopped_by=search.stopped or None,
            old_blocks=len(blocks),
            tensors_examined=len(roots),
            tensors_named=len(paths),
            limits=HolderSearchLimits(**asdict(limits)),
        )
    finally:
        # Nothing of the program may outlive the search through us: a dump must not keep
        # tensors (or frames) alive a moment longer than the program does.
        roots.clear()
        paths.clear()
        locals_by_id.clear()


def _tensors_holding(
    tensors: list[Any], address_of: Callable[[Any], int | None], blocks: Mapping[int, int], search: _Search
) -> tuple[list[Any], dict[int, int]]:
    """The tensors whose storage is one of the old blocks, and (by id) that block's address."""
    roots: list[Any] = []
    held: dict[int, int] = {}
    # No enumerate(): its result tuple would hold one more reference to the tensor.
    index = 0
    for tensor in tensors:
        index += 1
        if index % 1024 == 0 and search.out_of_time():
            break
        address = address_of(tensor)
        if address is None or address not in blocks:
            continue
        if sys.getrefcount(tensor) <= _OUR_REFERENCES:
            continue  # nothing else refers to it: no name can hold it
        roots.append(tensor)
        held[id(tensor)] = address
    return roots, held


def _held_through_graphs(roots: list[Any], paths: dict[int, list[_Path]], direct: dict[int, int],
                         address_of: Callable[[Any], int | None], blocks: Mapping[int, int],
                         search: _Search) -> dict[int, tuple[set[int], set[int]]]:
    """(direct, through-graph) addresses of each named root. Graphs are walked only for tensors
    a name holds: autograd keeps the Python objects of the tensors it saved alive from C++, and
    those, held by nothing in Python, are reached through the graph of the tensor a name holds."""
    budget = [search.limits.max_graph_nodes]
    held: dict[int, tuple[set[int], set[int]]] = {}
    for root in roots:
        address = direct[id(root)]
        through: set[int] = set()
        if id(root) in paths and not search.out_of_time():
            through = _graph_blocks(root, address_of, blocks, budget, search) - {address}
        held[id(root)] = ({address}, through)
    if budget[0] <= 0 and not search.stopped:
        search.stopped = "graph nodes"
    return held


_SAVED_ATTRIBUTES: dict[type, tuple[str, ...]] = {}


def _graph_blocks(tensor: Any, address_of: Callable[[Any], int | None], blocks: Mapping[int, int],
                  budget: list[int], search: _Search) -> set[int]:
    """Old blocks saved for backward anywhere in ``tensor``'s autograd graph."""
    node = getattr(tensor, "grad_fn", None)
    found: set[int] = set()
    if node is None:
        return found
    seen: set[int] = set()
    pending = [node]
    while pending and budget[0] > 0:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        budget[0] -= 1
        if budget[0] % 4096 == 0 and search.out_of_time():
            break
        names = _SAVED_ATTRIBUTES.get(type(node))
        if names is None:
            names = tuple(n for n in dir(node) if n.startswith("_saved_") and not n.endswith(("_sizes", "_strides")))
            _SAVED_ATTRIBUTES[type(node)] = names
        for name in names:
            try:
                value = getattr(node, name)
            except (RuntimeError, AttributeError):  # freed by an earlier backward
                continue
            for saved in value if isinstance(value, tuple | list) else (value,):
                if hasattr(saved, "untyped_storage"):
                    address = address_of(saved)
                    if address is not None and address in blocks:
                        found.add(address)
        try:
            pending.extend(next_node for next_node, _ in node.next_functions)
        except (RuntimeError, AttributeError):
            continue
    return found


def _frame_locals(search: _Search) -> dict[int, list[tuple[str, types.FrameType]]]:
    """id(value) -> [(local name, frame)] for every thread's running frames outside memlens.

    A module's top-level frame is left out: its locals are its globals, named as such.

    Before Python 3.13, reading ``frame.f_locals`` of a function copies its locals into a dict
    the frame keeps until it returns or is read again: a training loop's ``loss`` would stay
    alive after the loop rebinds it. That copy is emptied once read (the function's own locals
    are not in it; only ``locals()`` shares it, which a training loop does not keep)."""
    found: dict[int, list[tuple[str, types.FrameType]]] = {}
    snapshots: list[dict[str, Any]] = []
    for frame in sys._current_frames().values():
        current: types.FrameType | None = frame
        while current is not None:
            if not _is_memlens_code(current.f_code) and current.f_locals is not current.f_globals:
                frame_locals = current.f_locals
                search.own.add(id(frame_locals))  # a copy of the locals, not a holder
                for name, value in frame_locals.items():
                    found.setdefault(id(value), []).append((name, current))
                if _copies_locals(current, frame_locals):
                    snapshots.append(frame_locals)
            current = current.f_back
    for snapshot in snapshots:
        snapshot.clear()
    search.own.add(id(found))
    return found


def _copies_locals(frame: types.FrameType, frame_locals: Any) -> bool:
    """Whether ``frame.f_locals`` was a copy (a function's fast locals before Python 3.13)
    rather than the namespace itself (a class body, ``exec``) or 3.13's write-through proxy."""
    return (sys.version_info < (3, 13) and type(frame_locals) is dict
            and bool(frame.f_code.co_flags & inspect.CO_OPTIMIZED))


def _is_memlens_code(code: types.CodeType) -> bool:
    return os.path.abspath(code.co_filename).startswith(_MEMLENS_DIR + os.sep)


@dataclass
class _Path:
    """From a root tensor up to the object a name holds: ``steps`` are (object, label) pairs,
    the tensor's container first; the last object is the named one."""

    steps: list[tuple[Any, str]]
    named: _Named


def _walk_up(roots: list[Any], locals_by_id: dict[int, list[tuple[str, types.FrameType]]],
             search: _Search) -> dict[int, list[_Path]]:
    """For each root (by id), the shortest path up to a name: breadth first, one
    ``gc.get_referrers`` call per level for the whole frontier."""
    limits = search.limits
    objects: dict[int, Any] = {id(root): root for root in roots}
    # child id -> [(parent id, label)]; naming: object id -> how it is named (a terminal)
    parents: dict[int, list[tuple[int, str]]] = {}
    naming: dict[int, _Named] = {}
    frontier: list[Any] = list(roots)
    search.own.update({id(objects), id(parents), id(naming)})
    module_dicts = {id(module.__dict__): module for module in list(sys.modules.values())
                    if isinstance(module, types.ModuleType)}
    search.own.add(id(module_dicts))
    for _depth in range(limits.max_depth):
        if not frontier or search.out_of_time():
            break
        search.own.add(id(frontier))
        for obj in frontier:
            for name, frame in locals_by_id.get(id(obj), ()):
                if id(obj) not in naming:
                    naming[id(obj)] = _Named(
                        "local", name, f"local in {frame.f_code.co_name}(), {{file:{frame.f_code.co_filename}}}",
                        code=[frame.f_code])
        # A local is one name for an object; other names may hold it too, so it is still asked.
        asking = frontier
        frontier = []
        if not asking:
            break
        search.own.add(id(asking))
        wanted = {id(obj) for obj in asking}
        search.own.add(id(wanted))
        referrers = _referrers(asking, wanted, search)
        search.own.add(id(referrers))
        for referrer in referrers:
            if id(referrer) in search.own or _skip_referrer(referrer):
                continue
            for child_id, label in _edges(referrer, wanted, module_dicts):
                parents.setdefault(child_id, []).append((id(referrer), label))
            named = _name_of_referrer(referrer, module_dicts)
            keep = named is not None or isinstance(referrer, (*_CONTAINER_TYPES, types.CellType))
            if keep and id(referrer) not in objects:
                if len(objects) >= limits.max_objects:
                    search.stopped = search.stopped or "objects"
                    break
                objects[id(referrer)] = referrer
                if named is None:
                    frontier.append(referrer)
        # The heap scan can return frames of this search (the ones sys._current_frames gave
        # objects): emptied now, the list cannot keep them, and what they hold, in a cycle.
        referrers.clear()
        del referrers, asking, wanted
    paths = _shortest_paths(roots, objects, parents, naming, module_dicts)
    objects.clear()
    return paths


def _referrers(asking: list[Any], wanted: set[int], search: _Search) -> list[Any]:
    """Objects that refer to any of ``asking``.

    ``gc.get_referrers`` compares every reference in the heap with each object asked about, so
    it is fast for a few objects and slow for hundreds, and cannot be interrupted. Past a few,
    one scan of the heap tests each reference against a set instead, checking the clock as it
    goes."""
    if len(asking) <= FEW_REFERRER_TARGETS:
        return gc.get_referrers(*asking)
    found: list[Any] = []
    get_referents = gc.get_referents
    heap = gc.get_objects()
    skip = _CANNOT_HOLD
    for index, obj in enumerate(heap):
        if index % 8192 == 0 and search.out_of_time():
            break
        if type(obj) not in skip and not wanted.isdisjoint(map(id, get_referents(obj))):
            found.append(obj)
    return found


def _skip_referrer(referrer: Any) -> bool:
    """memlens' own frames and objects, and the collector's own list of garbage."""
    if isinstance(referrer, types.FrameType):
        return _is_memlens_code(referrer.f_code)
    if referrer is gc.garbage:
        return True
    module = getattr(type(referrer), "__module__", "") or ""
    return module == "memlens" or module.startswith("memlens.")


def _is_instance_dict_candidate(referrer: Any) -> bool:
    """Objects whose attributes can hold things: instances with a ``__dict__`` or ``__slots__``.

    Read from the type, so no ``__getattr__`` of the object runs."""
    klass = type(referrer)
    return bool(getattr(klass, "__dictoffset__", 0)) or any("__slots__" in k.__dict__ for k in klass.__mro__[:-1])


def _edges(referrer: Any, wanted: set[int], module_dicts: Mapping[int, Any]) -> Iterator[tuple[int, str]]:
    """(child id, label) for each wanted object ``referrer`` refers to, with how."""
    if isinstance(referrer, list | tuple | deque):
        for index, item in enumerate(referrer):
            if id(item) in wanted:
                yield id(item), f"[{index}]"
    elif isinstance(referrer, dict):
        for key, value in list(referrer.items()):
            if id(value) in wanted:
                yield id(value), f"[{_short_repr(key)}]"
            if id(key) in wanted:
                yield id(key), "(a key)"
    elif isinstance(referrer, set | frozenset):
        for item in referrer:
            if id(item) in wanted:
                yield id(item), "(a member)"
    elif isinstance(referrer, types.CellType):
        try:
            contents = referrer.cell_contents
        except ValueError:
            return
        if id(contents) in wanted:
            yield id(contents), ".cell_contents"
    elif isinstance(referrer, types.FrameType):
        for name, value in referrer.f_locals.items():
            if id(value) in wanted:
                yield id(value), name
    else:
        closure = getattr(referrer, "__closure__", None) if isinstance(referrer, types.FunctionType) else None
        if closure is not None and id(closure) in wanted:
            yield id(closure), ".__closure__"
        attributes = _attributes(referrer)
        for name, value in attributes.items():
            if id(value) in wanted:
                yield id(value), f".{name}"
        instance_dict = getattr(referrer, "__dict__", None)
        if isinstance(instance_dict, dict) and id(instance_dict) in wanted:
            yield id(instance_dict), ".__dict__"
        elif isinstance(referrer, type):
            # a class shows its dict as a read-only proxy; the dict itself is among its referents
            for referent in gc.get_referents(referrer):
                if isinstance(referent, dict) and id(referent) in wanted:
                    yield id(referent), ".__dict__"


def _attributes(obj: Any) -> dict[str, Any]:
    """An object's attributes: its ``__dict__`` and its ``__slots__`` that are set."""
    found: dict[str, Any] = {}
    try:
        instance_dict = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        instance_dict = None
    if isinstance(instance_dict, dict | types.MappingProxyType):
        found.update((k, v) for k, v in instance_dict.items() if isinstance(k, str))
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                with contextlib.suppress(AttributeError, TypeError):  # an unset slot
                    found[slot] = object.__getattribute__(obj, slot)
    return found


def _name_of_referrer(referrer: Any, module_dicts: Mapping[int, Any]) -> _Named | None:
    """How a referrer names what it holds, when it does (a terminal of the walk); the name itself
    is the label of the edge, filled in when the path is built."""
    if isinstance(referrer, dict):
        module = module_dicts.get(id(referrer))
        filename = getattr(module, "__file__", None) if module is not None else referrer.get("__file__")
        if module is not None or ("__builtins__" in referrer and "__name__" in referrer):
            where = f"global in {{file:{filename}}}" if isinstance(filename, str) else \
                f"global in module {referrer.get('__name__')}"
            return _Named("global", "", where, source_file=filename if isinstance(filename, str) else None)
        return None
    if isinstance(referrer, types.FrameType):
        code = referrer.f_code
        return _Named("local", "", f"local in {code.co_name}(), {{file:{code.co_filename}}}", code=[code])
    if isinstance(referrer, types.FunctionType):
        return _Named("closure", "", f"closure variable of {referrer.__qualname__}()",
                      code=list(_nested_code(referrer.__code__)))
    if isinstance(referrer, type):
        # ``Registry.items.append(x)`` may be anywhere in the class's module, not only in its methods
        return _Named("class attribute", "", f"of class `{referrer.__qualname__}`",
                      code=_class_code(referrer), is_attribute=True, source_file=_module_file(referrer))
    if isinstance(referrer, (*_CONTAINER_TYPES, types.CellType, types.ModuleType)):
        return None
    if _is_instance_dict_candidate(referrer):
        return _Named("attribute", "", _owner_text(referrer), code=_class_code(type(referrer)), is_attribute=True)
    return None


def _module_file(obj: Any) -> str | None:
    """The source file of the module that defines ``obj`` (a class or a function)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    filename = getattr(module, "__file__", None)
    return filename if isinstance(filename, str) and filename.endswith(".py") else None


def _owner_text(obj: Any) -> str:
    klass = type(obj)
    try:
        import torch

        if isinstance(obj, torch.nn.Module):
            return f"of module `{klass.__qualname__}`"
        if isinstance(obj, torch.optim.Optimizer):
            return f"of optimizer `{klass.__qualname__}`"
    except ImportError:  # pragma: no cover - torch is there whenever the recorder runs
        pass
    return f"of `{klass.__qualname__}`"


def _shortest_paths(roots: list[Any], objects: dict[int, Any], parents: dict[int, list[tuple[int, str]]],
                    naming: dict[int, _Named], module_dicts: Mapping[int, Any]) -> dict[int, list[_Path]]:
    """For each root, breadth first over the recorded parent links to every name that holds it
    (each by its shortest path): a tensor two names hold stays alive until both let go."""
    paths: dict[int, list[_Path]] = {}
    for root in roots:
        found = _names_of_root(root, objects, parents, naming, module_dicts)
        if found:
            paths[id(root)] = found
    return paths


def _names_of_root(root: Any, objects: dict[int, Any], parents: dict[int, list[tuple[int, str]]],
                   naming: dict[int, _Named], module_dicts: Mapping[int, Any]) -> list[_Path]:
    found: list[_Path] = []
    named_seen: set[tuple[int, str]] = set()

    def add(path: _Path) -> None:
        key = (id(path.steps[-1][0]), path.named.name)
        if key not in named_seen and len(found) < MAX_NAMES_PER_TENSOR:
            named_seen.add(key)
            found.append(path)

    queue: deque[tuple[int, list[tuple[int, str]]]] = deque([(id(root), [])])
    visited = {id(root)}
    while queue and len(found) < MAX_NAMES_PER_TENSOR:
        node_id, trail = queue.popleft()
        local = naming.get(node_id)
        if local is not None:
            add(_build_path(root, objects, trail, node_id, local, None))
        for parent_id, label in parents.get(node_id, ()):
            parent = objects.get(parent_id)
            if parent is None:
                continue
            named = _name_of_referrer(parent, module_dicts)
            if named is not None and isinstance(parent, types.FunctionType) and label != ".__closure__":
                # an attribute set on a function object (``log.seen = []``)
                named.kind, named.is_attribute = "function attribute", True
                named.where = f"of function {parent.__qualname__}()"
                named.source_file = _module_file(parent)
            if named is not None and label == ".__dict__":
                # reached through the instance's dict: the dict's key is the attribute
                through = _through_instance_dict(root, objects, node_id, trail, named)
                if through is not None:
                    add(through)
            elif named is not None and label == ".__closure__":
                # function -> __closure__ tuple -> cell -> the object: named by the free variable
                through_cell = _through_closure(root, objects, parent, trail, named)
                if through_cell is not None:
                    add(through_cell)
            elif named is not None:
                add(_build_path(root, objects, trail, node_id, named, label))
            elif parent_id not in visited:
                visited.add(parent_id)
                queue.append((parent_id, [*trail, (node_id, label)]))
    return found


def _through_instance_dict(root: Any, objects: dict[int, Any], dict_id: int, trail: list[tuple[int, str]],
                           named: _Named) -> _Path | None:
    """``owner.__dict__[key]`` is the attribute ``key`` of ``owner``."""
    if not trail or not isinstance(objects.get(dict_id), dict):
        return None
    child_id, key_label = trail[-1]
    return _build_path(root, objects, trail[:-1], child_id, named, f".{_label_key(key_label)}")


def _through_closure(root: Any, objects: dict[int, Any], function: Any, trail: list[tuple[int, str]],
                     named: _Named) -> _Path | None:
    """``trail`` ends ..., (the object, ".cell_contents"), (the cell, "[i]"): the object is the
    free variable ``i`` of ``function``."""
    if len(trail) < 2 or trail[-2][1] != ".cell_contents":
        return None
    index = _label_key(trail[-1][1])
    freevars = function.__code__.co_freevars
    if not (index.startswith("[") and index[1:-1].isdigit() and int(index[1:-1]) < len(freevars)):
        return None
    return _build_path(root, objects, trail[:-2], trail[-2][0], named, f".{freevars[int(index[1:-1])]}")


def _label_key(label: str) -> str:
    """``['kept']`` -> ``kept``: the name in a dict edge's label."""
    if label.startswith("[") and label.endswith("]"):
        with contextlib.suppress(ValueError, SyntaxError):
            key = ast.literal_eval(label[1:-1])
            if isinstance(key, str):
                return key
    return label


def _build_path(root: Any, objects: dict[int, Any], trail: list[tuple[int, str]], named_id: int,
                named: _Named, label: str | None) -> _Path:
    if label is not None:
        named.name = label[1:] if label.startswith(".") else _label_key(label)
    steps = [(objects[node_id], node_label) for node_id, node_label in trail]
    steps.append((objects.get(named_id, root), ""))
    return _Path(steps, named)


def _short_repr(value: Any) -> str:
    plain = isinstance(value, str | int | float | bool | type(None) | tuple)
    text = repr(value) if plain else f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------ results
def _group(
    roots: list[Any], held_by_root: dict[int, tuple[set[int], set[int]]], paths: dict[int, list[_Path]],
    blocks: Mapping[int, int], search: _Search, filename_map: Callable[[str], str] | None,
    address_of: Callable[[Any], int | None],
) -> list[Holder]:
    """One record per named holder, biggest first."""
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for root in roots:
        for path in paths.get(id(root), ()):
            _add_to_group(groups, path, held_by_root[id(root)])
    budget = [search.limits.max_graph_nodes]
    for group in groups.values():
        if not search.out_of_time():
            for tensor in _tensors_inside(group["object"]):
                address = address_of(tensor)
                if address is not None and address in blocks and address not in group["direct"]:
                    group["direct"].add(address)
                    group["graph"] |= _graph_blocks(tensor, address_of, blocks, budget, search) - {address}
                    group["tensors"] += 1
    records = []
    for group in groups.values():
        addresses = sorted(group["direct"] | group["graph"])
        named = group["named"]
        obj = group["object"]
        kind_of_object = type(obj).__name__ if not _is_tensor(obj) else "tensor"
        expression = f"self.{named.name}" if named.is_attribute and named.kind == "attribute" else named.name
        where = _fill_files(named.where, filename_map)
        if named.kind in ("attribute", "class attribute", "function attribute"):
            holder = f"{kind_of_object} `{expression}` {where}"
        else:
            holder = f"{kind_of_object} `{expression}` ({where})"
        lines = _mutation_lines(named, _is_tensor(obj), filename_map) if not search.out_of_time() else []
        records.append(Holder(
            holder=holder,
            kind=named.kind,
            name=expression,
            container=kind_of_object,
            lines=tuple(lines),
            line=lines[0].where if lines else None,
            bytes=sum(int(blocks[a]) for a in addresses),
            count=group["tensors"],
            blocks_direct=len(group["direct"]),
            blocks_through_graph=len(group["graph"] - group["direct"]),
            example=group["example"],
            blocks=tuple((a, int(blocks[a])) for a in addresses[: search.limits.max_blocks_per_holder]),
            blocks_total=len(addresses),
            keys=tuple(group["keys"]),
        ))
    records.sort(key=lambda r: (-r.bytes, r.holder))
    return records


def _tensors_inside(obj: Any, max_items: int = MAX_CONTENTS) -> Iterator[Any]:
    """Tensors in a named container (lists, tuples, dicts, sets, deques nested up to three deep),
    the container itself when it is a tensor: what a holder found from some blocks also holds."""
    pending: list[tuple[Any, int]] = [(obj, 0)]
    seen: set[int] = set()
    visited = 0
    while pending and visited < max_items:
        current, depth = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        visited += 1
        if _is_tensor(current):
            yield current
        elif depth < 3 and isinstance(current, _CONTAINER_TYPES):
            items = current.values() if isinstance(current, dict) else current
            pending.extend((item, depth + 1) for item in list(items))


def _add_to_group(groups: dict[tuple[int, str], dict[str, Any]], path: _Path,
                  held: tuple[set[int], set[int]]) -> None:
    named_object = path.steps[-1][0]
    key = (id(named_object), path.named.name)
    group = groups.get(key)
    if group is None:
        group = groups[key] = {"named": path.named, "object": named_object, "direct": set(), "graph": set(),
                               "tensors": 0, "example": _expression(path), "keys": []}
    direct, through_graph = held
    group["direct"] |= direct
    group["graph"] |= through_graph
    group["tensors"] += 1
    # steps[0] is the tensor with the label its container gives it; steps[1] that container
    if len(path.steps) > 1 and isinstance(path.steps[1][0], dict):
        label = path.steps[0][1]
        if label and len(group["keys"]) < MAX_KEYS and label not in group["keys"]:
            group["keys"].append(label)


def _expression(path: _Path) -> str:
    """The expression that reaches the tensor from the name, e.g. ``kept[3]`` or ``cache['a'][0]``."""
    named = path.named
    text = f"self.{named.name}" if named.kind == "attribute" else named.name
    for _, label in reversed(path.steps[:-1]):
        if label == ".cell_contents" or label == ".__closure__":
            continue
        text += label if label.startswith(("[", ".")) else f" {label}"
    return text


def _is_tensor(obj: Any) -> bool:
    return hasattr(obj, "untyped_storage") and hasattr(obj, "grad_fn")


def _fill_files(text: str, filename_map: Callable[[str], str] | None) -> str:
    """Replace ``{file:PATH}`` with the file's display name."""
    while "{file:" in text:
        start = text.index("{file:")
        end = text.index("}", start)
        text = text[:start] + _display(text[start + 6 : end], filename_map) + text[end + 1 :]
    return text


def _display(filename: str, filename_map: Callable[[str], str] | None) -> str:
    if filename_map is not None:
        return filename_map(filename)
    return os.path.basename(filename) if os.path.isabs(filename) else filename


# ------------------------------------------------------------------------------ lines
def _mutation_lines(named: _Named, holds_tensor_directly: bool,
                    filename_map: Callable[[str], str] | None) -> list[StoreLine]:
    """The lines that can have stored into the holder (see the module docstring)."""
    codes = list(named.code)
    if named.source_file is not None:
        codes.extend(_module_code(named.source_file))
    if not codes or not named.name:
        return []
    name = named.name.split("[")[0].split(".")[0]
    found: dict[tuple[str, int], _Store] = {}
    for code in codes:
        for store in _scan(code, name, named.kind, named.is_attribute, holds_tensor_directly):
            found.setdefault((store.filename, store.line), store)
    if not found and not holds_tensor_directly:
        # Nothing here stores into the container (``kept = train()`` got it filled elsewhere):
        # where the name is bound is the next best thing to show, and says so ("assignment").
        for code in codes:
            for store in _scan(code, name, named.kind, named.is_attribute, True):
                if store.how == "assignment":
                    found.setdefault((store.filename, store.line), store)
    lines = []
    for (filename, line), store in sorted(found.items(), key=lambda item: (item[0][0], item[0][1])):
        text = _without_comment(linecache.getline(filename, line).strip())[:MAX_CODE_TEXT]
        first_line, last_line = _line_range(store.code)
        lines.append(StoreLine(file=_display(filename, filename_map), line=line, how=store.how, code=text,
                               function=store.code.co_name, first_line=first_line, last_line=last_line,
                               values_from=tuple(_values_from(store, name))))
    return lines[:MAX_LINES]


@dataclass(frozen=True)
class _Store:
    """An instruction that stores into the holder: ``instructions[position]`` loads (or, for an
    assignment, stores) the holder's name on ``line`` of ``code``."""

    filename: str
    line: int
    how: str
    code: types.CodeType
    instructions: tuple[dis.Instruction, ...]
    position: int


# Instructions that read or bind a variable, and the names they do it with (3.13's
# superinstructions carry two names in a tuple).
_LOAD_VARIABLE = frozenset({
    "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
    "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF",
    "LOAD_FROM_DICT_OR_GLOBALS",
})
_STORE_VARIABLE = frozenset({"STORE_FAST", "STORE_FAST_STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})
# Instructions of a call's argument span looked at, at most.
_MAX_ARGUMENT_INSTRUCTIONS = 400


def _names(instruction: dis.Instruction) -> tuple[str, ...]:
    value = instruction.argval
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple):
        return tuple(v for v in value if isinstance(v, str))
    return ()


def _stored_names(instruction: dis.Instruction) -> tuple[str, ...]:
    if instruction.opname == "STORE_FAST_LOAD_FAST":
        return _names(instruction)[:1]
    return _names(instruction) if instruction.opname in _STORE_VARIABLE else ()


def _loaded_names(instruction: dis.Instruction) -> tuple[str, ...]:
    if instruction.opname == "STORE_FAST_LOAD_FAST":
        return _names(instruction)[1:]
    return _names(instruction) if instruction.opname in _LOAD_VARIABLE else ()


def _line_range(code: types.CodeType) -> tuple[int, int]:
    """The first and last line of ``code`` itself (its nested functions are code of their own)."""
    lines = [line for _, _, line in code.co_lines() if line is not None]
    first = code.co_firstlineno
    return first, max([first, *lines])


def _values_from(store: _Store, holder_name: str) -> list[int]:
    """Lines of the store's function where the value it stores can have been allocated: its own
    line, and the lines that assign the names the stored expression reads."""
    instructions, position = store.instructions, store.position
    if store.how in MUTATING_METHODS:
        span = _argument_span(instructions, position + 2)
    else:
        # ``outputs[k] = v`` and ``x = v``: the value is computed on the statement's line before
        # the holder is loaded (or stored).
        start = position
        while start > 0 and _line_of(instructions[start - 1]) == store.line:
            start -= 1
        # ``kept += [x]``: the in-place operator before the store is not part of the value.
        end = position - 1 if store.how == "assignment" and _augmented(instructions, position) else position
        span = instructions[start:end]
    lines = {store.line}
    if any(_computes(instruction) for instruction in span):
        # ``kept.append(x * 2)``, ``kept.append(torch.cat([a, b]))``: what is stored is made on
        # this line, not where ``x`` or ``a`` were.
        return sorted(lines)
    read = {name for instruction in span for name in _loaded_names(instruction)} - {holder_name}
    for instruction in instructions:
        line = _line_of(instruction)
        if line is not None and read.intersection(_stored_names(instruction)):
            lines.add(line)
    return sorted(lines)


def _computes(instruction: dis.Instruction) -> bool:
    """Whether an instruction of a stored expression makes a new value from what it reads (an
    operator, a call with arguments), rather than passing a name on (``x``, ``x.detach()``,
    ``x[0]``, ``(x, y)``: the stored tensor may be the one ``x`` was assigned)."""
    name = instruction.opname
    if name.startswith(("BINARY_OP", "UNARY_", "COMPARE_OP")) or name in ("CALL_FUNCTION_EX", "CALL_KW"):
        return True
    return name in ("CALL", "PRECALL") and bool(instruction.arg)


def _argument_span(instructions: tuple[dis.Instruction, ...], start: int) -> tuple[dis.Instruction, ...]:
    """The instructions that compute a method call's arguments, from ``start`` (right after the
    method is loaded) to the call that consumes the method: the first instruction that takes the
    stack below where it was."""
    depth = 0
    end = min(len(instructions), start + _MAX_ARGUMENT_INSTRUCTIONS)
    for index in range(start, end):
        instruction = instructions[index]
        try:
            effect = dis.stack_effect(instruction.opcode, instruction.arg if instruction.opcode >= dis.HAVE_ARGUMENT
                                      else None, jump=False)
        except ValueError:
            break
        depth += effect
        if depth < 0:
            # Python 3.11 readies the call with a PRECALL right before it: not an argument.
            last = index - 1 if index > start and instructions[index - 1].opname == "PRECALL" else index
            return instructions[start:last]
    # Not found within bounds: the arguments are on the call's own line.
    line = _line_of(instructions[start - 1]) if start > 0 else None
    return tuple(i for i in instructions[start:end] if _line_of(i) == line)


def _without_comment(line: str) -> str:
    """A source line without its trailing ``# comment`` (a ``#`` inside a string stays)."""
    if "#" not in line:
        return line
    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return line


def _scan(code: types.CodeType, name: str, kind: str, attribute: bool, direct: bool) -> Iterator[_Store]:
    """Each line of ``code`` (nested code included) storing into ``name``, a ``kind`` of name
    (global, local, closure) or an attribute."""
    load_ops, store_ops = _NAME_OPS.get(kind, _NAME_OPS["global"])
    for inner in _nested_code(code):
        instructions = tuple(i for i in dis.get_instructions(inner) if i.opname != "CACHE")
        for position, instruction in enumerate(instructions):
            line = _line_of(instruction)
            if line is None:
                continue
            loads_name = instruction.argval == name and (
                instruction.opname in _METHOD_OPS if attribute else instruction.opname in load_ops)
            if loads_name and position + 1 < len(instructions):
                following = instructions[position + 1]
                if following.opname in _METHOD_OPS and following.argval in MUTATING_METHODS:
                    yield _Store(inner.co_filename, line, str(following.argval), inner, instructions, position)
                    continue
                for later in instructions[position + 1 : position + 12]:
                    if _line_of(later) != line:
                        break
                    if later.opname == "STORE_SUBSCR":
                        yield _Store(inner.co_filename, line, "item assignment", inner, instructions, position)
                        break
            stores_name = instruction.argval == name and (
                instruction.opname == "STORE_ATTR" if attribute else instruction.opname in store_ops)
            if stores_name and (direct or _augmented(instructions, position)):
                yield _Store(inner.co_filename, line, "assignment", inner, instructions, position)


def _augmented(instructions: tuple[dis.Instruction, ...], position: int) -> bool:
    """``kept += [x]``: an in-place operator right before the store."""
    return position > 0 and instructions[position - 1].opname in ("BINARY_OP", "INPLACE_ADD") \
        and "=" in (instructions[position - 1].argrepr or "=")


def _line_of(instruction: dis.Instruction) -> int | None:
    positions = getattr(instruction, "positions", None)
    line = getattr(positions, "lineno", None) if positions is not None else None
    if line is None:
        line = instruction.starts_line if isinstance(instruction.starts_line, int) else None
    return line


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    pending = [code]
    while pending:
        current = pending.pop()
        yield current
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))


def _class_code(klass: type) -> list[types.CodeType]:
    """Code of the methods of ``klass`` and its bases outside the standard library and torch."""
    codes: list[types.CodeType] = []
    for base in klass.__mro__:
        module = getattr(base, "__module__", "") or ""
        if module in ("builtins",) or module.startswith(("torch.", "typing")):
            continue
        for value in list(base.__dict__.values()):
            for function in _functions_of(value):
                codes.append(function.__code__)
    return codes


def _functions_of(value: Any) -> Iterable[types.FunctionType]:
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType)]
    return [value] if isinstance(value, types.FunctionType) else []


_MODULE_CODE: dict[tuple[str, float], list[types.CodeType]] = {}


def _module_code(filename: str) -> list[types.CodeType]:
    """A module's top-level code, compiled from its source (the module's own code object is
    not kept after import). Cached per file and modification time."""
    try:
        stamp = os.path.getmtime(filename)
    except OSError:
        return []
    cached = _MODULE_CODE.get((filename, stamp))
    if cached is not None:
        return cached
    source = "".join(linecache.getlines(filename))
    try:
        compiled = [compile(source, filename, "exec", dont_inherit=True)] if source else []
    except (SyntaxError, ValueError):
        compiled = []
    _MODULE_CODE[(filename, stamp)] = compiled
    return compiled


__all__ = ["HolderLimits", "find_holders", "gc_tensors", "leak_holders", "live_allocations", "old_live_blocks",
           "storage_address_function"]
