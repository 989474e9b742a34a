"""A fleet's files analysed on a Dask cluster (``memlens fleet --dask ADDRESS``).

The files go in chunks, about ``CHUNKS_PER_WORKER`` per worker thread: one round trip per chunk
rather than per file, still balanced. A chunk whose worker died (``KilledWorker`` and the like) is
sent again file by file, so the one file that killed it is named in its row, and every other file
still gets its own. What each file's task is (the one per-file analysis and its row) is the
caller's: ``task`` must be picklable by name, as the workers import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memlens.errors import MemlensUsageError
from memlens.fleet.rows import RankResult
from memlens.printable import printable

# Files per worker thread's chunk (see above).
CHUNKS_PER_WORKER = 4

Task = Callable[[str], RankResult]
Progress = Callable[[int, int], None]


def chunks_of(count: int, workers: int) -> list[list[int]]:
    """Indices 0..count-1 in consecutive chunks, about ``CHUNKS_PER_WORKER`` per worker."""
    size = max(1, -(-count // (workers * CHUNKS_PER_WORKER)))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def _task_chunk(task: Task, paths: Sequence[str]) -> list[RankResult]:
    return [task(path) for path in paths]


def run_on_dask(paths: Sequence[str], address: str, task: Task,
                failed: Callable[[str, BaseException], RankResult],
                progress: Progress | None = None) -> list[RankResult]:
    """``task`` for each path on the Dask cluster at ``address``; results in input order, a task
    that failed even on its own as ``failed(path, exception)``.

    The workers read the files themselves, so the paths must name the same files on the workers:
    a shared filesystem, as a cluster's job output usually is.
    """
    try:
        from distributed import Client
    except ImportError:
        raise MemlensUsageError("--dask needs Dask's distributed scheduler: pip install 'memlens[dask]'") from None
    try:
        client = Client(address, timeout="30s")
    except (OSError, TimeoutError, ValueError) as exc:
        raise MemlensUsageError(f"cannot reach the Dask scheduler at {address!r}: {printable(exc, 200)}") from None
    try:
        threads = max(1, sum(client.nthreads().values()))
        chunks = chunks_of(len(paths), threads)
        # pure=False: two files with equal paths are still two tasks, and a rerun reanalyses.
        futures = [client.submit(_task_chunk, task, [paths[i] for i in chunk], pure=False) for chunk in chunks]
        results: list[RankResult] = []
        for chunk, future in zip(chunks, futures, strict=True):
            try:
                results.extend(future.result())
            except Exception:  # KilledWorker and the like: the chunk's files one by one, to name the culprit
                for index in chunk:
                    one = client.submit(task, paths[index], pure=False)
                    try:
                        results.append(one.result())
                    except Exception as exc:
                        results.append(failed(paths[index], exc))
            if progress:
                progress(len(results), len(paths))
        return results
    finally:
        client.close()  # ours to close; the cluster is not ours to stop


__all__ = ["CHUNKS_PER_WORKER", "chunks_of", "run_on_dask"]
