"""The reading limits the Python path and the native scanner (``memlens._scan``) both hold to.

Declared here once: CMake writes them into the scanner's C++ header
(``src/native/generate_constants.py``), ``memlens._scan.DECLARED`` gives back the values the
extension was built with, and ``tests/test_layers.py`` holds the two equal. Plain integers only:
the generator runs this file as it is, without importing memlens.
"""

# Items a tuple of the pickle may hold (PyTorch's widest is a frame's few fields).
MAX_TUPLE_ITEMS = 8
# Integers beyond +-2**61 a file may hold: PyTorch writes none, and a dict keyed by ints that
# are equal modulo 2**61 - 1 (equal hashes) takes time quadratic in their number to build.
MAX_LARGE_INTS = 10_000
# Tuples of more than MAX_TUPLE_ITEMS items of the kinds a dict key could hash alike, so crafted
# keys cost seconds, not hours.
MAX_WIDE_TUPLES = 10_000
# Device ordinals (one process sees at most a few dozen GPUs).
MAX_DEVICES = 1024
# One size, or bytes live at once on a device: 16 TiB (GPUs hold < 2**38).
PLAUSIBLE_BYTES = 1 << 44
# The native scanner's reads of a file: a megabyte at a time into a window it refills (the file is
# never held whole); memlens.snapshot.ahead passes it, and it is memlens._scan.scan_file's default.
SCAN_CHUNK = 1 << 20
