"""How many threads NumPy's BLAS uses, switched per GEMM by the NumPy backend.

A decode step is a chain of skinny GEMMs (``[batch, in] @ [in, out]``) that take well under a
millisecond each. Split across threads they gain nothing (they are bound by memory bandwidth)
and lose a great deal whenever the cores are shared: every call waits for all its threads to be
scheduled. On a 2-core machine with other work running, a ``[1, 576] @ [576, 3072]`` product
measured 8 ms with OpenBLAS's 2 threads and 0.5 ms with one. So the backend runs GEMMs with
few rows on one thread and leaves large (prefill) GEMMs at the BLAS default, which
``OPENBLAS_NUM_THREADS`` still controls.

Only OpenBLAS (what NumPy's wheels ship) is switched; with any other BLAS this is a no-op.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

_SET_SYMBOLS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                "scipy_openblas_set_num_threads", "openblas_set_num_threads64_")
_GET_SYMBOLS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
                "scipy_openblas_get_num_threads", "openblas_get_num_threads64_")


def _loaded_openblas() -> ctypes.CDLL | None:
    """The OpenBLAS library NumPy loaded into this process (Linux: from /proc/self/maps)."""
    import numpy  # noqa: F401  (make sure NumPy's BLAS is loaded)

    maps = Path("/proc/self/maps")
    if not sys.platform.startswith("linux") or not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if "openblas" in Path(path).name.lower() and ".so" in path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


def _symbol(lib: ctypes.CDLL, names: tuple[str, ...]) -> Callable[..., int] | None:
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    return None


class BlasThreads:
    """Switches the BLAS thread count, skipping calls that would not change it."""

    def __init__(self) -> None:
        lib = _loaded_openblas()
        self._set = _symbol(lib, _SET_SYMBOLS) if lib is not None else None
        get = _symbol(lib, _GET_SYMBOLS) if lib is not None else None
        self.default = int(get()) if get is not None and self._set is not None else 1
        self.current = self.default

    @property
    def available(self) -> bool:
        return self._set is not None

    def use(self, num_threads: int) -> None:
        if num_threads != self.current and self._set is not None:
            self._set(num_threads)
            self.current = num_threads

    def for_rows(self, num_rows: int, single_thread_max_rows: int) -> None:
        """One thread for GEMMs of at most ``single_thread_max_rows`` rows, the default above."""
        self.use(1 if num_rows <= single_thread_max_rows else self.default)
