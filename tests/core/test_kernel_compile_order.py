"""The start-up kernel compile (``openinfer.backend.cuda.loader.compile_kernels``) on the CPU:
modules start slowest first by their estimated cost, each module is built once with all its
kernels, its seconds are recorded, and the thread count and order come from their switches.
CuPy is a stand-in here (nothing compiles); the GPU start-up benchmark times the real thing."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

LOADER = "openinfer.backend.cuda.loader"


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch):
    """The loader imported against a stand-in CuPy, removed again afterwards (other tests import
    it against theirs)."""
    device = types.SimpleNamespace(use=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: device)))
    original = sys.modules.pop(LOADER, None)
    try:
        yield importlib.import_module(LOADER)
    finally:
        sys.modules.pop(LOADER, None)
        if original is not None:
            sys.modules[LOADER] = original


def test_source_cost_counts_the_source_and_every_local_header_once(tmp_path: Path, loader) -> None:
    (tmp_path / "common.cuh").write_text("x" * 100)
    (tmp_path / "mma.cuh").write_text('#include "common.cuh"\n' + "y" * 50)
    main = '#include "mma.cuh"\n  #  include "common.cuh"\n#include <cuda_bf16.h>\n' + "z" * 10
    (tmp_path / "a.cu").write_text(main)
    (tmp_path / "b.cu").write_text('#include "missing.cuh"\n')
    assert loader.source_cost("a.cu", str(tmp_path)) == len(main) + 100 + len('#include "common.cuh"\n') + 50
    assert loader.source_cost("b.cu", str(tmp_path)) == len('#include "missing.cuh"\n')
    assert loader.source_cost("nothing.cu", str(tmp_path)) == 0
    # the package's own sources: every one that exists has a cost
    assert loader.source_cost("rms_norm.cu") > 0


def test_compile_order_is_slowest_first_with_arch_modules_counting_double(loader) -> None:
    costs = {"small.cu": 10, "big.cu": 100, "wgmma.cu": 60, "tie_a.cu": 10}
    modules = [("small.cu", ()), ("tie_a.cu", (("N", 1),)), ("wgmma.cu", (), "sm_90a"), ("big.cu", ())]
    ordered = loader.compile_order(modules, cost=costs.__getitem__)
    assert ordered == [("wgmma.cu", (), "sm_90a"), ("big.cu", ()), ("small.cu", ()), ("tie_a.cu", (("N", 1),))]


def test_compile_kernels_builds_each_module_once_slowest_first_and_times_it(monkeypatch, loader) -> None:
    """OPENINFER_KERNEL_MODULES=source: one module per file (and defines), with all its kernels."""
    monkeypatch.setenv("OPENINFER_KERNEL_MODULES", "source")
    built: list[tuple] = []
    monkeypatch.setattr(loader, "_kernel", lambda source, name, defines: built.append((source, name, defines)))
    monkeypatch.setattr(loader, "_arch_kernel",
                        lambda source, name, arch, defines, shared: built.append((source, name, defines, arch, shared)))
    costs = {"elementwise.cu": 5, "prefill_attention_sm90.cu": 40, "decode_attention_mma.cu": 30}
    monkeypatch.setattr(loader, "source_cost", costs.__getitem__)
    loader.module_compile_seconds.clear()
    keys = [("elementwise.cu", "silu_mul", ()), ("decode_attention_mma.cu", "decode", (("HEAD_DIM", 128),)),
            ("elementwise.cu", "add", ()), ("prefill_attention_sm90.cu", "prefill", (), "sm_90a", 1024)]
    assert loader.compile_kernels(keys, device_id=0, threads=1) == 3
    # one thread: the order the modules start in is the order they were built in
    assert [b[0] for b in built] == ["prefill_attention_sm90.cu", "decode_attention_mma.cu", "elementwise.cu",
                                     "elementwise.cu"]
    assert built[0] == ("prefill_attention_sm90.cu", "prefill", (), "sm_90a", 1024)
    assert sorted(loader.module_compile_seconds) == ["decode_attention_mma.cu[HEAD_DIM=128]", "elementwise.cu",
                                                     "prefill_attention_sm90.cu@sm_90a"]
    assert all(seconds >= 0 for seconds in loader.module_compile_seconds.values())
    built.clear()
    monkeypatch.setenv("OPENINFER_COMPILE_ORDER", "discovery")
    loader.compile_kernels(keys, device_id=0, threads=1)
    assert [b[0] for b in built] == ["elementwise.cu", "elementwise.cu", "decode_attention_mma.cu",
                                     "prefill_attention_sm90.cu"]
    monkeypatch.setenv("OPENINFER_COMPILE_ORDER", "fastest")
    with pytest.raises(ValueError, match="OPENINFER_COMPILE_ORDER"):
        loader.compile_kernels(keys, device_id=0, threads=1)
    assert loader.compile_kernels([], device_id=0) == 0


def test_kernel_modules_build_each_kernel_alone_slowest_kernel_first(monkeypatch, loader) -> None:
    """The default (OPENINFER_KERNEL_MODULES=kernel): every kernel is a module of its own, so a file's
    kernels compile in parallel; they start slowest first by their own estimated cost."""
    monkeypatch.delenv("OPENINFER_KERNEL_MODULES", raising=False)
    assert loader.kernel_modules() == "kernel"
    built: list[tuple] = []
    monkeypatch.setattr(loader, "_kernel", lambda source, name, defines: built.append((source, name)))
    monkeypatch.setattr(loader, "_arch_kernel", lambda source, name, arch, defines, shared: built.append((source, name)))
    costs = {("elementwise.cu", "silu_mul"): 5, ("elementwise.cu", "add"): 50, ("prefill.cu", "prefill"): 20}
    monkeypatch.setattr(loader, "kernel_cost", lambda source, name: costs[(source, name)])
    loader.module_compile_seconds.clear()
    keys = [("elementwise.cu", "silu_mul", ()), ("elementwise.cu", "add", ()), ("prefill.cu", "prefill", (), "sm_90a", 0)]
    assert loader.compile_kernels(keys, device_id=0, threads=1) == 3
    # sm_90a counts double: prefill (40) after add (50), before silu_mul (5)
    assert built == [("elementwise.cu", "add"), ("prefill.cu", "prefill"), ("elementwise.cu", "silu_mul")]
    assert sorted(loader.module_compile_seconds) == ["elementwise.cu:add", "elementwise.cu:silu_mul",
                                                     "prefill.cu@sm_90a:prefill"]
    monkeypatch.setenv("OPENINFER_KERNEL_MODULES", "each")
    with pytest.raises(ValueError, match="OPENINFER_KERNEL_MODULES"):
        loader.compile_kernels(keys, device_id=0, threads=1)


def test_kernel_cost_is_the_file_cut_down_to_the_kernel(loader) -> None:
    whole = loader.source_cost("gemv.cu")
    alone = loader.kernel_cost("gemv.cu", "gemv_m1")
    assert 0 < alone < whole
    assert loader.kernel_cost("no_such_file.cu", "k") == 0


def test_every_package_kernel_can_be_cut_out_of_its_file(loader) -> None:
    """The one-kernel modules need every kernel's definition found: a kernel made by a macro (or a
    parse failure) would compile its whole file instead, and set the start-up's wall."""
    import importlib.util
    import re

    sources = sorted(loader.KERNEL_DIR.glob("*.cu"))
    assert sources
    for plugin in ("openinfer_qwen35", "openinfer_deepseek_v4"):  # plugins' kernels go through the loader too
        spec = importlib.util.find_spec(plugin)
        if spec is not None and spec.submodule_search_locations:
            sources += sorted((Path(next(iter(spec.submodule_search_locations))) / "kernels").glob("*.cu"))
    for path in sources:
        text = path.read_text()
        definitions = loader.kernel_definitions(text)
        assert definitions is not None, f"{path.name}: kernel_definitions cannot parse it"
        names = [name for name, _, _ in definitions]
        # every extern "C" kernel the file has (outside line comments) is one of them: none made by a macro
        code = "\n".join(line.split("//")[0] for line in text.splitlines())
        mentioned = len(re.findall(r'extern\s+"C"\s+__global__', code))
        assert len(definitions) == mentioned, f"{path.name}: {mentioned} kernels, {names} found"
        for name, start, end in definitions:
            alone = loader.kernel_subset(text, (name,))
            assert text[start:end] in alone
            assert [n for n, _, _ in loader.kernel_definitions(alone)] == [name], f"{path.name}: {name}"


def test_kernels_built_after_serving_starts_are_reported(monkeypatch, loader, caplog) -> None:
    """A kernel the start-up discovery missed is built when first launched while serving: logged as a
    warning and listed in late_compiles (the GPU test asserts the list stays empty)."""
    loader.late_compiles.clear()
    loader._note_build("before.cu")
    assert loader.late_compiles == []
    loader.mark_serving()
    try:
        with caplog.at_level("WARNING"):
            loader._note_build("rms_norm.cu:rms_norm")
        assert loader.late_compiles == ["rms_norm.cu:rms_norm"]
        assert "compiled while serving" in caplog.text
    finally:
        loader._serving.clear()
        loader.late_compiles.clear()


def test_compile_threads_switch(monkeypatch, loader) -> None:
    monkeypatch.delenv("OPENINFER_COMPILE_THREADS", raising=False)
    assert loader.compile_threads() == loader.COMPILE_THREADS and loader.compile_threads(default=3) == 3
    monkeypatch.setenv("OPENINFER_COMPILE_THREADS", "16")
    assert loader.compile_threads() == 16
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("OPENINFER_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="OPENINFER_COMPILE_THREADS"):
            loader.compile_threads()


def test_arch_cubin_cache_is_opt_in_keyed_by_everything_and_written_whole(tmp_path: Path, monkeypatch, loader) -> None:
    """OPENINFER_ARCH_KERNEL_CACHE=1 keeps sm_90a cubins (which CuPy's cache never sees) in
    CUPY_CACHE_DIR, one file per (source, options, arch, NVRTC version)."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPENINFER_ARCH_KERNEL_CACHE", raising=False)
    assert loader.arch_cache_path("src", ("-DX=1",), "sm_90a", "13.0") is None
    monkeypatch.setenv("OPENINFER_ARCH_KERNEL_CACHE", "1")
    path = loader.arch_cache_path("src", ("-DX=1",), "sm_90a", "13.0")
    assert path is not None and path.parent == tmp_path and path.name.startswith("openinfer_sm_90a_")
    others = {loader.arch_cache_path("src2", ("-DX=1",), "sm_90a", "13.0"),
              loader.arch_cache_path("src", ("-DX=2",), "sm_90a", "13.0"),
              loader.arch_cache_path("src", ("-DX=1",), "sm_100a", "13.0"),
              loader.arch_cache_path("src", ("-DX=1",), "sm_90a", "13.1")}
    assert path not in others and len(others) == 4
    assert loader._read_cached(path) is None
    loader._write_cached(path, b"\x7fELF cubin")
    assert loader._read_cached(path) == b"\x7fELF cubin"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    (tmp_path / "blocked").write_text("a file where a folder should be")
    loader._write_cached(tmp_path / "blocked" / "x.cubin", b"cubin")  # cannot write: no error, no cache
    assert loader._read_cached(tmp_path / "blocked" / "x.cubin") is None


def test_kernel_subset_drops_only_the_unasked_kernel_definitions(loader) -> None:
    """OPENINFER_KERNEL_SUBSET=1: a module keeps the extern "C" kernels asked for; braces inside
    comments and literals, launch bounds and declarations are handled; an unparsable file gives
    None (compiled whole)."""
    text = (
        'template <int N> __device__ int helper() { return N; }\n'
        'extern "C" __global__ void __launch_bounds__((WARPS) * 32) first(int* out) {\n'
        '  out[0] = helper<1>(); // a } in a comment\n  const char* s = "}{"; char c = \'}\';\n}\n'
        'extern "C" __global__ void second(int* out);\n'
        'extern "C" __global__ void second(int* out) { if (out) { out[0] = helper<2>(); } }\n'
        '/* extern "C" __global__ void ghost() { } */\n'
        'extern "C" __global__ void third(int* out) { out[0] = 3; }\n')
    only_second = loader.kernel_subset(text, ["second"])
    assert "void second(int* out);" in only_second and "helper<2>" in only_second
    assert " first(" not in only_second and "void third" not in only_second and "helper<1>" not in only_second
    assert "template <int N>" in only_second
    assert loader.kernel_subset(text, ["first", "second", "third"]) == text
    both = loader.kernel_subset(text, ["first", "third"])
    assert "helper<1>" in both and "out[0] = 3" in both and "helper<2>" not in both
    assert loader.kernel_subset('extern "C" __global__ void broken(int* out) { {\n', ["x"]) is None
    # the package's own decode-attention file: four kernels, each keepable alone
    source = (loader.KERNEL_DIR / "decode_attention_mma.cu").read_text()
    merge = loader.kernel_subset(source, ["decode_attention_merge"])
    assert merge is not None and "void decode_attention_merge" in merge and "void short_query_attention_mma" not in merge


def test_kernels_found_by_the_discovery_start_building_at_once(monkeypatch, loader) -> None:
    """discover_kernels(device_id): a kernel's build starts the moment the dry forward meets it (the
    forward's Python overlaps NVRTC); compile_kernels then waits for those builds instead of building
    them again, and a launch of a kernel still building waits for it."""
    import threading

    monkeypatch.delenv("OPENINFER_KERNEL_MODULES", raising=False)
    release, entered = threading.Event(), threading.Event()
    built: list[str] = []

    def build(source, name, defines):
        entered.set()
        release.wait(5)
        built.append(name)
        loader._compiled.add((source, name, defines))
        return f"fn:{name}"

    monkeypatch.setattr(loader, "_kernel", build)
    loader.module_compile_seconds.clear()
    with loader.discover_kernels(device_id=0) as found:
        loader.kernel("elementwise.cu", "add")
        loader.kernel("elementwise.cu", "add")  # met twice, built once
        loader.kernel("rms_norm.cu", "rms_norm", VECS=2)
        assert set(loader._pending) == found and len(found) == 2  # both under way before the forward ends
        assert built == []
    release.set()
    assert loader.compile_kernels([*found, ("sampling.cu", "sample_rows", ())], device_id=0) == 3
    assert sorted(built) == ["add", "rms_norm", "sample_rows"] and not loader._pending
    # a build started early and launched before compile_kernels: the launch waits, nothing is built twice
    release.clear()
    entered.clear()
    assert loader.start_compiling([("elementwise.cu", "silu_mul", ())], device_id=0) == 1
    assert loader.start_compiling([("elementwise.cu", "silu_mul", ())], device_id=0) == 0
    assert entered.wait(5)  # the build is under way (in the stand-in) before _kernel is swapped below
    threading.Timer(0.05, release.set).start()
    monkeypatch.setattr(loader, "_kernel", lambda source, name, defines: built.count(name))
    assert loader.kernel("elementwise.cu", "silu_mul") == 1 and not loader._pending
    monkeypatch.setenv("OPENINFER_COMPILE_EARLY", "0")
    assert loader.start_compiling([("elementwise.cu", "gelu", ())], device_id=0) == 0
    monkeypatch.delenv("OPENINFER_COMPILE_EARLY")
    monkeypatch.setenv("OPENINFER_KERNEL_MODULES", "source")  # whole files: nothing starts early
    assert loader.start_compiling([("elementwise.cu", "gelu", ())], device_id=0) == 0
    loader._compiled.clear()


def test_one_module_label_names_every_kind_of_module(loader) -> None:
    """``module_label`` is the one place a module's name is built: the whole file, with defines,
    for an architecture, cut down to some kernels; a compile-plan module tuple gives the same."""
    defines = (("GROUP", 4), ("HEAD_DIM", 128))
    assert loader.module_label("a.cu", ()) == "a.cu"
    assert loader.module_label("a.cu", defines) == "a.cu[GROUP=4,HEAD_DIM=128]"
    assert loader.module_label("a.cu", defines, "sm_90a") == "a.cu[GROUP=4,HEAD_DIM=128]@sm_90a"
    assert loader.module_label("a.cu", (), kernels=("k1", "k2")) == "a.cu:k1,k2"
    assert loader.module_label("a.cu", defines, "sm_90a", ("k",)) == "a.cu[GROUP=4,HEAD_DIM=128]@sm_90a:k"
    assert loader._label(("a.cu", defines)) == loader.module_label("a.cu", defines)
    assert loader._label(("a.cu", defines, ("k",))) == loader.module_label("a.cu", defines, kernels=("k",))
    assert loader._label(("a.cu", defines, "sm_90a", ("k",))) == loader.module_label("a.cu", defines, "sm_90a", ("k",))
    assert loader._label(("a.cu", defines, "sm_90a")) == loader.module_label("a.cu", defines, "sm_90a")


def test_a_plugin_kernel_file_is_named_by_its_absolute_path(tmp_path: Path, loader) -> None:
    """A plugin's kernels: the key carries the file's absolute path, its cost counts the headers
    beside it (and core's), and logs name it ``package/file.cu``."""
    folder = tmp_path / "openinfer_toy" / "kernels"
    folder.mkdir(parents=True)
    (folder / "toy_common.cuh").write_text("h" * 40)
    text = '#include "toy_common.cuh"\n#include "common.cuh"\n' + 'extern "C" __global__ void toy(float* x) { x[0] = 1; }\n'
    (folder / "toy.cu").write_text(text)
    key = loader.kernel_key(folder / "toy.cu", "toy", DK=128, A=1)
    assert key == (str(folder / "toy.cu"), "toy", (("A", 1), ("DK", 128)))
    core_common = len((loader.KERNEL_DIR / "common.cuh").read_text())
    assert loader.source_cost(key[0]) >= len(text) + 40 + core_common
    assert loader.kernel_cost(key[0], "toy") == loader.source_cost(key[0])
    assert loader.module_label(key[0], key[2]) == "openinfer_toy/toy.cu[A=1,DK=128]"
