"""Plugin kernels include core's headers; an edited header must not load a stale cached binary."""

from pathlib import Path

from openinfer.backend.cuda import headers_digest, kernel_include_dir, kernel_include_options


def test_core_headers_ship_with_the_package():
    assert (kernel_include_dir() / "common.cuh").is_file()
    assert (kernel_include_dir() / "mma.cuh").is_file()


def test_the_digest_follows_every_header_byte(tmp_path: Path):
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "a.cuh").write_text("#define A 1\n")
    (folder / "b.cu").write_text("// not a header: not part of the digest\n")
    before = headers_digest(folder)
    (folder / "b.cu").write_text("// edited\n")
    assert headers_digest.__wrapped__(folder) == before
    (folder / "a.cuh").write_text("#define A 2\n")
    assert headers_digest.__wrapped__(folder) != before


def test_include_options_name_each_folder_and_the_digest(tmp_path: Path):
    options = kernel_include_options(tmp_path)
    assert options[0] == f"-I{tmp_path}" and options[1] == f"-I{kernel_include_dir()}"
    assert options[2].startswith("-DOPENINFER_HEADERS_DIGEST=0x") and len(options[2].split("0x")[1]) == 16
