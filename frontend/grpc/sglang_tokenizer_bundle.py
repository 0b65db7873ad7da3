"""The tokenizer as a zip bundle, for the SGLang protocol's ``GetTokenizer`` RPC.

A router on another machine cannot read the worker's ``tokenizer_path``; it then asks the
worker for the files instead. The bundle is a zip of the tokenizer files found in the
directory, streamed in chunks; the last chunk carries the SHA-256 of the whole zip.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 64 * 1024

# What a router needs to tokenize, detokenize and render the chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def build_tokenizer_zip(directory: str | Path) -> bytes:
    """The zip of every tokenizer file present in ``directory``."""
    root = Path(directory)
    found = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        raise FileNotFoundError(
            f"no tokenizer.json in {str(root)!r}; start the worker with a model directory (or "
            "--tokenizer DIR) that holds the Hugging Face tokenizer files")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in found:
            archive.write(root / name, name)
    return buffer.getvalue()


def iter_bundle_chunks(data: bytes) -> Iterator[tuple[bytes, str]]:
    """(chunk bytes, sha256): the digest is empty on every chunk but the last."""
    digest = hashlib.sha256(data).hexdigest()
    offsets = range(0, max(len(data), 1), CHUNK_BYTES)
    last = offsets[-1]
    for offset in offsets:
        yield data[offset:offset + CHUNK_BYTES], digest if offset == last else ""
