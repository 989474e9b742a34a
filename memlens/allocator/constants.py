"""The allocator model's own numbers, declared once for both engines.

CMake writes them into a C++ header for ``src/native/caching_allocator.hpp`` and the replay
loop (``src/native/generate_constants.py``); ``memlens._native.DECLARED`` gives back the values
the extension was built with, and ``tests/test_layers.py`` holds them equal. The rules PyTorch
fixes (block and segment sizes, rounding) are the snapshot's too: ``memlens.snapshot.block_rules``.
The generator runs this file as it is: plain integers, no imports.
"""

# Where simulated cudaMalloc hands out addresses: a user-space GPU VA like real ones, aligned
# to the 2 MiB granularity cudaMalloc uses for large allocations.
DEFAULT_BASE_ADDRESS = 0x7F0000000000
SEGMENT_ALIGNMENT = 2 << 20
# Expandable segments reserve 1 1/8 of the GPU's memory in address space; with no capacity
# given, at least an 80 GiB device (an A100/H100), and one large enough for the request that
# makes the reservation: an unknown device never runs short, so a 100 GiB tensor of the trace
# must fit in the address space too.
DEFAULT_DEVICE_MEMORY = 80 << 30
# time_us of the first trace entry when no clock is given: deterministic, epoch-like.
DEFAULT_START_TIME_US = 1_700_000_000_000_000
# How far ahead in the recorded segment_alloc list a replayed cudaMalloc may look for a
# segment of its size: a small window keeps the hint in step with the recorded order.
ADDRESS_HINT_LOOKAHEAD = 8
