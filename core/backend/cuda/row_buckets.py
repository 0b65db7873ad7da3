"""Row counts an eager cuBLAS GEMM is padded to (no CuPy here, so CPU CI checks it).

cuBLAS loads a kernel on its first use, and the load waits for the whole device: a GEMM whose
row count M picks a kernel not used before blocks the host for as long as the work already
queued takes (H200: 50 ms behind 50 ms of queued work; 0.1 ms once loaded). An eager mixed step
gives the LM head a new M (the rows to sample) nearly every step, so at 256 streams the engine
thread sat ~2.5 s of a 5.7 s burst in that call and the device idled between steps. Padding M
up to a CUDA-graph bucket size reuses a kernel graph capture already loaded.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def padded_rows(rows: int, row_buckets: Sequence[int]) -> int:
    """The smallest of ``row_buckets`` (sorted ascending) holding ``rows``; ``rows`` itself past
    the largest bucket or with no buckets."""
    index = bisect.bisect_left(row_buckets, rows)
    return row_buckets[index] if index < len(row_buckets) else rows
