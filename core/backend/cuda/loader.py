"""The one cached loader of openinfer's CUDA sources (``openinfer/kernels/*.cu``).

``kernel("rms_norm.cu", "rms_norm")`` compiles the file once per (file, defines) with NVRTC
through ``cupy.RawModule`` (CuPy also caches the binary on disk per source, options and GPU
architecture) and returns the ``RawKernel``. ``arch_kernel("x.cu", "x", "sm_90a")`` builds for an
architecture-specific target (wgmma and setmaxnreg need sm_90a), which RawModule cannot ask for: it
always appends its own ``-arch=sm_XY``. Package files are only read.

On a fresh machine (CuPy's disk cache empty) compiling is most of an engine's start (about
0.3 s per module, one after the other as a forward first meets them). ``discover_kernels``
records the kernels a dry forward would compile instead of compiling them (launching one then
does nothing), and ``compile_kernels`` compiles the recorded modules in parallel threads: NVRTC
releases the GIL. The compile's wall time is at least its slowest module's, so the modules start
slowest first (``compile_order``: source bytes with the headers it includes as the estimate; sm_90a
modules count double), and each module's seconds are kept in ``module_compile_seconds``.

What a module holds (``OPENINFER_KERNEL_MODULES``): ``kernel`` (the default), one kernel cut out of its
file (``kernel_subset``), so the start-up compile's wall is its slowest *kernel*, not its slowest file,
and each build starts the moment its kernel is known (``start_compiling``: the sampler's when the
backend is made, beside the weight load; a model's as the dry forward meets them);
``found``, the kernels the dry forward found in one file together; ``source``, the whole file. A kernel
met only after the engine started serving (``mark_serving``) is a start-up discovery miss: it is built
(alone, in the first two modes), logged as a warning and listed in ``late_compiles``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cupy

from openinfer.backend.cuda import kernel_include_dir, kernel_include_options
from openinfer.engine_core.startup import note_event

logger = logging.getLogger(__name__)

KERNEL_DIR = kernel_include_dir()
COMPILE_THREADS = min(16, os.cpu_count() or 8)  # one-kernel modules: ~20 of them at a start, up to ~1 s each
COMPILE_THREADS_ENV = "OPENINFER_COMPILE_THREADS"  # threads of compile_kernels (default COMPILE_THREADS)
# "cost" (default): modules start slowest first (compile_order); "discovery": in the order met
COMPILE_ORDER_ENV = "OPENINFER_COMPILE_ORDER"
# "0": kernels build only when compile_kernels is called (after the discovery), not as they are found
COMPILE_EARLY_ENV = "OPENINFER_COMPILE_EARLY"

# (source, kernel name, sorted defines), and for ``arch_kernel`` also (arch, shared bytes)
KernelKey = tuple[Any, ...]

_compiled: set[KernelKey] = set()
_discovery = threading.local()  # .found: the set a discover_kernels block records into
# seconds each module took to build (NVRTC, or CuPy's disk cache), by ``module_label``
module_compile_seconds: dict[str, float] = {}
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


# what one compiled module holds: "kernel" (one kernel), "found" (the kernels found in one file), "source"
# (the whole file). NVRTC compiles every kernel of a file and every template only unused kernels
# instantiate; cut down, the files compile in parallel pieces
KERNEL_MODULES_ENV = "OPENINFER_KERNEL_MODULES"
KERNEL_MODULES = ("kernel", "found", "source")
DEFAULT_KERNEL_MODULES = "kernel"
_prebuilt: dict[KernelKey, Any] = {}  # functions compile_kernels built together, for _kernel to take

_serving = threading.Event()  # set by mark_serving: from then on a build is a start-up discovery miss
late_compiles: list[str] = []  # the kernels built after mark_serving, in order


def kernel_modules() -> str:
    """``OPENINFER_KERNEL_MODULES`` (``kernel``, ``found`` or ``source``), else the default."""
    mode = os.environ.get(KERNEL_MODULES_ENV, "").strip().lower() or DEFAULT_KERNEL_MODULES
    if mode not in KERNEL_MODULES:
        raise ValueError(f"{KERNEL_MODULES_ENV}={mode!r}: expected one of {', '.join(KERNEL_MODULES)}")
    return mode


def mark_serving(serving: bool = True) -> None:
    """``True``: the engine has started, kernels built from now on were missed by the start-up
    discovery; ``False``: an engine is starting (its builds are expected)."""
    if serving:
        _serving.set()
    else:
        _serving.clear()


def _note_build(label: str) -> None:
    if _serving.is_set():
        late_compiles.append(label)
        logger.warning("kernel %s compiled while serving: the start-up discovery did not find it "
                       "(a request waited for NVRTC); report it with the model and batch shape", label)


def _skip_literal_or_comment(text: str, index: int) -> int:
    """The index after the comment or string / char literal starting at ``index`` (else ``index``)."""
    if text.startswith("//", index):
        end = text.find("\n", index)
        return len(text) if end < 0 else end
    if text.startswith("/*", index):
        end = text.find("*/", index + 2)
        return len(text) if end < 0 else end + 2
    quote = text[index]
    if quote in "\"'":
        at = index + 1
        while at < len(text) and text[at] != quote:
            at += 2 if text[at] == "\\" else 1
        return at + 1
    return index


_CONDITIONAL = re.compile(r"^[ \t]*#[ \t]*(if|ifdef|ifndef|elif|else|endif)\b", re.MULTILINE)


def _skip_other_branches(text: str, index: int) -> int:
    """At an ``#else`` / ``#elif`` line: the index of its ``#endif`` line (nested conditionals
    skipped), else ``index``. Brackets are counted in a conditional's first branch only: the
    branches of one ``#if`` each open what the code after ``#endif`` closes."""
    line = _CONDITIONAL.match(text, index)
    if line is None or line.group(1) not in ("elif", "else"):
        return index
    depth = 0
    for found in _CONDITIONAL.finditer(text, line.end()):
        if found.group(1).startswith("if"):
            depth += 1
        elif found.group(1) == "endif":
            if depth == 0:
                return found.start()
            depth -= 1
    return len(text)


def _matching(text: str, index: int, opening: str, closing: str) -> int | None:
    """The index of the bracket closing the one at ``index``, skipping comments, literals and the
    later branches of preprocessor conditionals."""
    depth, at = 0, index
    while at < len(text):
        skipped = _skip_literal_or_comment(text, at)
        if skipped == at and (at == 0 or text[at - 1] == "\n"):
            skipped = _skip_other_branches(text, at)
        if skipped != at:
            at = skipped
            continue
        if text[at] == opening:
            depth += 1
        elif text[at] == closing:
            depth -= 1
            if depth == 0:
                return at
        at += 1
    return None


_GLOBAL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+')
_KERNEL_ATTRIBUTES = {"__launch_bounds__", "__cluster_dims__", "__maxnreg__"}


def kernel_definitions(text: str) -> list[tuple[str, int, int]] | None:
    """Every ``extern "C" __global__ void`` kernel *defined* in ``text`` (declarations skipped):
    ``(name, start, end)`` with ``text[start:end]`` its whole definition; None when one's extent
    cannot be found. Attributes (``__launch_bounds__(..)``, attribute macros) may precede the
    name; brackets count in each preprocessor conditional's first branch. Each file's text is
    parsed once (a start cuts ~50 kernels out of a few files, and the parse is pure Python that
    would hold the GIL against the weight load)."""
    found = _parsed_definitions(text)
    return None if found is None else list(found)


@functools.lru_cache(maxsize=256)
def _parsed_definitions(text: str) -> tuple[tuple[str, int, int], ...] | None:
    masked, at = list(text), 0  # comments blanked: no kernel is found inside one (``extern "C"`` is a literal)
    while at < len(text):
        skipped = _skip_literal_or_comment(text, at)
        if skipped != at:
            if text.startswith(("//", "/*"), at):
                masked[at:skipped] = " " * (skipped - at)
            at = skipped
        else:
            at += 1
    found: list[tuple[str, int, int]] = []
    position = 0
    for match in _GLOBAL.finditer("".join(masked)):
        if match.start() < position:
            continue
        at, close = match.end(), None
        while close is None:  # attributes up to the kernel's name
            word = re.match(r"\s*([A-Za-z_]\w*)\s*", text[at:])
            if word is None:
                return None
            after = at + word.end()
            if text[after:after + 1] != "(":
                at = after  # an attribute macro, e.g. a cluster-dims one
                continue
            end = _matching(text, after, "(", ")")
            if end is None:
                return None
            if word.group(1) in _KERNEL_ATTRIBUTES:
                at = end + 1
            else:
                name, close = word.group(1), end
        body = re.match(r"\s*", text[close + 1:])
        brace = close + 1 + body.end()
        if text[brace:brace + 1] != "{":
            continue  # a declaration
        end = _matching(text, brace, "{", "}")
        if end is None:
            return None
        found.append((name, match.start(), end + 1))
        position = end + 1
    return tuple(found)


def kernel_subset(text: str, keep: Iterable[str]) -> str | None:
    """``text`` without the definitions of the ``extern "C" __global__ void`` kernels not named in
    ``keep`` (declarations and everything else stay), or None when a kernel's extent cannot be
    found (then the whole file is compiled)."""
    keep = set(keep)
    definitions = kernel_definitions(text)
    if definitions is None:
        return None
    parts, position = [], 0
    for name, start, end in definitions:
        if name not in keep:
            parts.append(text[position:start])
            position = end
    parts.append(text[position:])
    return "".join(parts)


@functools.cache
def _module(source: str, defines: tuple[tuple[str, int], ...],
            kernels: tuple[str, ...] | None = None) -> cupy.RawModule:
    """The module of ``source`` under ``defines``; with ``kernels``, holding only those kernels."""
    path = KERNEL_DIR / source  # a plugin's kernel file is an absolute path
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing; reinstall the package that ships it (package data *.cu)")
    folders = () if path.parent == KERNEL_DIR else (path.parent,)  # a plugin's headers beside its file
    options = ("-std=c++17", *kernel_include_options(*folders), *(f"-D{name}={value}" for name, value in defines))
    text = path.read_text()
    if kernels is not None:
        text = kernel_subset(text, kernels) or text
    _note_build(module_label(source, defines, kernels=kernels))
    return cupy.RawModule(code=text, options=options)


def _alone(name: str) -> tuple[str, ...] | None:
    """The kernels a module built for ``name`` alone holds: just it, unless whole files are wanted."""
    return None if kernel_modules() == "source" else (name,)


@functools.cache
def _kernel(source: str, name: str, defines: tuple[tuple[str, int], ...]) -> cupy.RawKernel:
    function = _prebuilt.pop((source, name, defines), None)
    if function is None:  # compiles and loads the module once (one of its own unless whole files are wanted)
        function = _module(source, defines, _alone(name)).get_function(name)
    _compiled.add((source, name, defines))
    return function


class _NotCompiled:
    """What ``kernel`` returns while discovering: launching it (or setting its attributes) does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> int:
        return 0

    def __setattr__(self, name: str, value: Any) -> None:
        return None


def kernel_key(source: str | Path, name: str, **defines: int) -> KernelKey:
    """The key of ``kernel(source, name, **defines)``, for ``start_compiling`` ahead of its first launch."""
    return (str(source), name, tuple(sorted(defines.items())))


def kernel(source: str | Path, name: str, **defines: int) -> cupy.RawKernel:
    """The compiled kernel ``name`` of ``source`` with ``-DNAME=value`` for each define. ``source`` is
    a file of core's kernel folder, or a plugin's kernel file by its absolute path (its folder is
    then on the include path too): either way one kernel a module, built in the background when
    ``start_compiling`` or a start-up discovery met it first, and counted in ``late_compiles``."""
    key = kernel_key(source, name, **defines)
    found = getattr(_discovery, "found", None)
    if found is not None:  # no kernel runs on a dry forward's garbage, compiled or not
        _found(found, key)
        return _NotCompiled()
    if _pending:
        _await(key)
    return _kernel(*key)


MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


# "1": architecture-specific cubins are kept on disk beside CuPy's kernel cache (CuPy caches only
# RawModule's builds; without this every sm_90a module compiles again at each start)
ARCH_CACHE_ENV = "OPENINFER_ARCH_KERNEL_CACHE"


def arch_cache_path(text: str, options: tuple[str, ...], arch: str, compiler: str) -> Path | None:
    """Where an sm_XYa cubin of ``text`` built with ``options`` by NVRTC ``compiler`` (its
    version) is kept: ``CUPY_CACHE_DIR`` (else ``~/.cupy/kernel_cache``), named by a digest of all
    four and of the kernel headers (an edited header builds anew); None when the cache is off."""
    if os.environ.get(ARCH_CACHE_ENV, "0").strip() != "1":
        return None
    from openinfer.backend.cuda import headers_digest

    folder = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    digest = hashlib.sha256("\0".join((text, *options, arch, compiler, headers_digest())).encode()).hexdigest()
    return folder / f"openinfer_{arch}_{digest[:40]}.cubin"


def _read_cached(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes() or None
    except OSError:
        return None


def _write_cached(path: Path | None, cubin: bytes) -> None:
    """Atomically (a temporary name, then a rename): a concurrent start reads all or nothing."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_bytes(cubin)
        os.replace(partial, path)
    except OSError:  # a read-only or full disk: the next start compiles again
        logger.debug("cannot keep %s", path, exc_info=True)


@functools.cache
def _arch_module(source: str, defines: tuple[tuple[str, int], ...], arch: str,
                 kernels: tuple[str, ...] | None = None) -> cupy.cuda.function.Module:
    """The ``arch`` cubin of ``source`` under ``defines``; with ``kernels``, holding only those kernels."""
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy_backends.cuda.libs import nvrtc

    path = KERNEL_DIR / source
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing; reinstall openinfer (package data *.cu)")
    options = assemble_cupy_compiler_options(
        ("-std=c++17", f"-I{KERNEL_DIR}", f"--gpu-architecture={arch}",
         *(f"-D{name}={value}" for name, value in defines)))
    text = path.read_text()
    if kernels is not None:
        text = kernel_subset(text, kernels) or text
    cached = None
    if os.environ.get(ARCH_CACHE_ENV, "0").strip() == "1":
        cached = arch_cache_path(text, tuple(options), arch, ".".join(map(str, nvrtc.getVersion())))
    cubin = _read_cached(cached)
    if cubin is None:
        _note_build(module_label(source, defines, arch, kernels))
        program = nvrtc.createProgram(text, source, (), ())
        try:
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError as error:
                raise RuntimeError(f"NVRTC could not build {source} for {arch}:\n{nvrtc.getProgramLog(program)}") from error
            cubin = nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)
        _write_cached(cached, cubin)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    return module


@functools.cache
def _arch_kernel(source: str, name: str, arch: str, defines: tuple[tuple[str, int], ...],
                 shared_bytes: int) -> cupy.cuda.function.Function:
    function = _prebuilt.pop((source, name, defines, arch), None)
    if function is None:
        function = _arch_module(source, defines, arch, _alone(name)).get_function(name)
    _compiled.add((source, name, defines, arch, shared_bytes))
    if shared_bytes > 48 * 1024:
        cupy.cuda.driver.funcSetAttribute(function.ptr, MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
    return function


def arch_kernel(source: str, name: str, arch: str, shared_bytes: int = 0, **defines: int) -> cupy.cuda.function.Function:
    """Kernel ``name`` of ``source`` compiled by NVRTC straight to a cubin for ``arch`` (e.g. "sm_90a"),
    its dynamic shared-memory limit raised to ``shared_bytes``; called like a RawKernel:
    ``fn(grid, block, args, shared_mem=...)``. Under ``discover_kernels`` it is recorded and not
    launched, like ``kernel``."""
    key = (source, name, tuple(sorted(defines.items())), arch, shared_bytes)
    found = getattr(_discovery, "found", None)
    if found is not None:
        _found(found, key)
        return _NotCompiled()
    if _pending:
        _await(key)
    return _arch_kernel(*key[:2], arch, key[2], shared_bytes)


def _found(found: set[KernelKey], key: KernelKey) -> None:
    if key not in _compiled and key not in found:
        found.add(key)
        device_id = getattr(_discovery, "device_id", None)
        if device_id is not None:  # its build starts now, while the dry forward goes on
            start_compiling([key], device_id)


@contextlib.contextmanager
def discover_kernels(device_id: int | None = None) -> Iterator[set[KernelKey]]:
    """Within the block (this thread only), launching any kernel does nothing and a kernel not
    compiled yet is recorded in the yielded set: run a dry forward inside, then
    ``compile_kernels`` what it found. The forward's outputs are garbage, so only a forward
    that computes no indices on the device may run dry (see ``DecoderOnlyLM.dry_run_safe``).
    With ``device_id``, each kernel's build starts in the background as soon as it is found
    (``start_compiling``): the dry forward's Python overlaps the compile."""
    previous = getattr(_discovery, "found", None), getattr(_discovery, "device_id", None)
    _discovery.found = found = set()
    _discovery.device_id = device_id
    try:
        yield found
    finally:
        _discovery.found, _discovery.device_id = previous


def discovering() -> bool:
    """Whether this thread is inside ``discover_kernels`` (a dry run: nothing launches)."""
    return getattr(_discovery, "found", None) is not None


def module_label(source: str, defines: tuple[tuple[str, int], ...], arch: str | None = None,
                 kernels: tuple[str, ...] | None = None) -> str:
    """``source[NAME=value,...]@arch:kernel,...``: one compiled module's name in logs and reports
    (``kernels``: the ones it holds when not the whole file; a plugin's file as ``package/file.cu``)."""
    path = Path(source)
    if path.is_absolute():
        source = f"{path.parent.parent.name}/{path.name}"
    label = source + (f"[{','.join(f'{k}={v}' for k, v in defines)}]" if defines else "")
    return label + (f"@{arch}" if arch else "") + (f":{','.join(kernels)}" if kernels is not None else "")


@functools.cache
def source_cost(source: str, kernel_dir: str | None = None) -> int:
    """Bytes NVRTC reads for ``source``: its text and that of the local headers it includes
    (recursively, each once); 0 for a file that is not there. A rough estimate of its compile time."""
    root = KERNEL_DIR if kernel_dir is None else Path(kernel_dir)
    seen: set[Path] = set()
    pending, total = [root / source], 0
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        if not path.is_file():
            continue
        text = path.read_text()
        total += len(text)
        for name in _INCLUDE.findall(text):  # beside the including file (a plugin's headers), else core's
            beside = path.parent / name
            pending.append(beside if beside.is_file() else KERNEL_DIR / name)
    return total


@functools.cache
def kernel_cost(source: str, name: str) -> int:
    """``source_cost`` of the file cut down to kernel ``name`` (``kernel_subset``): the estimate
    of a one-kernel module's compile time."""
    path = KERNEL_DIR / source
    if not path.is_file():
        return 0
    text = path.read_text()
    alone = kernel_subset(text, (name,)) or text
    return source_cost(source) - len(text) + len(alone)


def _module_cost(module: tuple[Any, ...], cost: Any, cost_of_kernel: Any) -> int:
    """A module ``(source, defines[, arch][, (kernel,)])``'s estimated cost, sm_90a counting double."""
    source, _, *rest = module
    arch = bool(rest) and isinstance(rest[0], str)
    alone = rest[-1] if rest and isinstance(rest[-1], tuple) else None
    estimate = cost(source) if alone is None else cost_of_kernel(source, alone[0])
    return estimate * (2 if arch else 1)


def compile_order(modules: Iterable[tuple[Any, ...]], cost: Any = None, cost_of_kernel: Any = None) -> list[tuple[Any, ...]]:
    """Modules ``(source, defines[, arch][, (kernel,)])`` slowest first by ``cost(source)``
    (``source_cost``; a one-kernel module by ``cost_of_kernel(source, kernel)``, ``kernel_cost``),
    an architecture-specific (sm_90a) module counting double; ties keep their order. With as many
    threads as modules the order does not matter; with fewer, the slowest starting last would
    set the wall time alone."""
    cost = source_cost if cost is None else cost
    cost_of_kernel = kernel_cost if cost_of_kernel is None else cost_of_kernel
    return sorted(modules, key=lambda module: -_module_cost(module, cost, cost_of_kernel))


def compile_threads(default: int = COMPILE_THREADS) -> int:
    """``OPENINFER_COMPILE_THREADS`` when set (a positive integer), else ``default``."""
    value = os.environ.get(COMPILE_THREADS_ENV, "").strip()
    if not value:
        return default
    try:
        threads = int(value)
    except ValueError:
        raise ValueError(f"{COMPILE_THREADS_ENV}={value!r}: expected a positive integer") from None
    if threads < 1:
        raise ValueError(f"{COMPILE_THREADS_ENV}={value!r}: expected a positive integer")
    return threads


def _module_of(key: KernelKey, mode: str) -> tuple[Any, ...]:
    """The module ``key``'s kernel is built in: ``(source, defines[, arch])``, and in ``kernel``
    mode its name too (one kernel a module)."""
    source, name, defines, *arch = key
    module = (source, defines, *arch[:1])
    return module + ((name,),) if mode == "kernel" else module


def _label(module: tuple[Any, ...]) -> str:
    """``module_label`` of a module ``(source, defines[, arch][, (kernel,)])``."""
    source, defines, *rest = module
    kernels = rest.pop() if rest and isinstance(rest[-1], tuple) else None
    return module_label(source, defines, *rest, kernels=kernels)


def _build(module: tuple[Any, ...], keys: list[KernelKey], mode: str) -> None:
    """Compile (or load from CuPy's disk cache) one module and take ``keys``' kernels from it."""
    note_event("first_kernel_build_started")
    began = time.perf_counter()
    if mode == "found":  # one module holding just the kernels found in its file
        source, defines, *arch = module
        names = tuple(sorted({key[1] for key in keys}))
        built = _arch_module(source, defines, arch[0], names) if arch else _module(source, defines, names)
        for name in names:
            _prebuilt[(source, name, defines, *arch)] = built.get_function(name)
    for source, name, defines, *arch in keys:  # "kernel": _kernel builds each alone
        if arch:
            _arch_kernel(source, name, arch[0], defines, arch[1])
        else:
            _kernel(source, name, defines)
    module_compile_seconds[_label(module)] = time.perf_counter() - began
    note_event("last_kernel_build_done", last=True)
    if mode == "kernel":  # when each one-kernel module was ready (the start-up report's timeline)
        note_event(f"built {module[0]}:{module[-1][0]}")


# kernels whose builds started before anyone waited for them (start_compiling); one pool per device
_pending: dict[KernelKey, Future | None] = {}
_pending_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(device_id: int) -> ThreadPoolExecutor:
    with _pending_lock:
        pool = _pools.get(device_id)
        if pool is None:
            pool = _pools[device_id] = ThreadPoolExecutor(
                compile_threads(), thread_name_prefix="openinfer-nvrtc",
                initializer=lambda: cupy.cuda.Device(device_id).use())
        return pool


def start_compiling(keys: Iterable[KernelKey], device_id: int) -> int:
    """Start building ``keys``' kernels in the background now (NVRTC releases the GIL) and return
    how many builds started; ``compile_kernels``, or the kernel's first launch, waits for them.
    One-kernel modules only (``OPENINFER_KERNEL_MODULES=kernel``): with whole files a module's
    kernels are known only once the discovery is over."""
    if kernel_modules() != "kernel" or os.environ.get(COMPILE_EARLY_ENV, "1").strip() == "0":
        return 0
    started = 0
    for key in keys:
        with _pending_lock:
            if key in _compiled or key in _pending:
                continue
            _pending[key] = None  # claimed; its future follows
        future = _pool(device_id).submit(_build, _module_of(key, "kernel"), [key], "kernel")
        with _pending_lock:
            _pending[key] = future
        started += 1
    return started


def _await(key: KernelKey) -> None:
    """Wait for ``key``'s background build, if one is under way (a kernel is never built twice)."""
    if key not in _pending:
        return
    future = _pending.get(key)
    while future is None and key in _pending:  # claimed a moment ago: its future comes next
        time.sleep(0.0005)
        future = _pending.get(key)
    if future is not None:
        future.result()
        with _pending_lock:
            _pending.pop(key, None)


def compile_kernels(keys: Iterable[KernelKey], device_id: int, threads: int | None = None) -> int:
    """Compile (or load from CuPy's disk cache) every kernel in ``keys``, one module per thread,
    slowest module first (``OPENINFER_COMPILE_ORDER=discovery``: in the order found); builds
    ``start_compiling`` began are waited for. Returns how many modules were built (those begun
    early included). ``threads``: ``compile_threads()`` when None."""
    mode = kernel_modules()
    by_module: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for key in keys:
        if key not in _compiled or key in _pending:
            by_module.setdefault(_module_of(key, mode), []).append(key)

    if not by_module:
        return 0
    order = os.environ.get(COMPILE_ORDER_ENV, "cost").strip().lower()
    if order not in ("cost", "discovery"):
        raise ValueError(f"{COMPILE_ORDER_ENV}={order!r}: expected 'cost' or 'discovery'")
    modules = compile_order(by_module) if order == "cost" else list(by_module)
    early = [module for module in modules if any(key in _pending for key in by_module[module])]
    late = [module for module in modules if module not in early]

    threads = compile_threads() if threads is None else threads
    began = time.perf_counter()
    if late:
        with ThreadPoolExecutor(min(threads, len(late)), thread_name_prefix="openinfer-nvrtc",
                                initializer=lambda: cupy.cuda.Device(device_id).use()) as pool:
            list(pool.map(lambda module: _build(module, by_module[module], mode), late))
    for module in early:
        for key in by_module[module]:
            _await(key)
    slowest = sorted(((module_compile_seconds.get(_label(m), 0.0), _label(m)) for m in modules), reverse=True)[:4]
    logger.info("built %d kernel modules (%d begun during the discovery) in %.2f s more on %d threads; "
                "slowest: %s", len(modules), len(early), time.perf_counter() - began, min(threads, len(modules)),
                ", ".join(f"{label} {seconds:.2f} s" for seconds, label in slowest))
    return len(modules)
