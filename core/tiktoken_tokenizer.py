"""tiktoken vocabularies (Kimi-K2, Moonlight): ``tiktoken.model`` + ``tokenizer_config.json``.

A ``tiktoken.model`` file holds only the mergeable ranks (``base64(token bytes) rank`` per
line); what surrounds them comes from the model family's convention, which Kimi's remote
``tokenization_kimi.py`` fixes:

* the pre-tokenizer split is ``KIMI_PATTERN`` (o200k-like, Han runs split out);
* ``num_base = len(ranks)`` ordinary ids, then 256 special ids ``num_base … num_base + 255``,
  named by ``tokenizer_config.json``'s ``added_tokens_decoder``; unnamed ones are
  ``<|reserved_token_{id}|>``.

``TiktokenVocabulary`` exposes the few methods ``openinfer.tokenizer.Tokenizer`` calls on a
``tokenizers.Tokenizer``, so the frontends need no second code path.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openinfer.errors import InvalidRequestError

NUM_RESERVED_SPECIAL_TOKENS = 256
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


@dataclass(frozen=True)
class _Encoded:
    ids: list[int]


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model`` → {token bytes: rank}; a malformed line is an error naming the line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (IndexError, ValueError) as exc:
            raise InvalidRequestError(f"{path}:{number} is not a 'base64 rank' tiktoken line", "tokenizer") from exc
    return ranks


class TiktokenVocabulary:
    """A tiktoken encoding with Kimi's special-token layout, behind the ``tokenizers`` API subset."""

    def __init__(self, ranks: dict[bytes, int], special_tokens: Mapping[int, str], add_bos_id: int | None = None,
                 pattern: str = KIMI_PATTERN):
        import tiktoken

        self.num_base = len(ranks)
        self.special_by_id = {i: special_tokens.get(i, f"<|reserved_token_{i}|>")
                              for i in range(self.num_base, self.num_base + NUM_RESERVED_SPECIAL_TOKENS)}
        self.special_by_id.update({i: name for i, name in special_tokens.items() if i >= self.num_base})
        self.id_by_special = {name: i for i, name in self.special_by_id.items()}
        self.encoding = tiktoken.Encoding(name="openinfer-tiktoken", pat_str=pattern, mergeable_ranks=ranks,
                                          special_tokens=self.id_by_special)
        self.add_bos_id = add_bos_id
        self._bytes_by_id = {rank: token for token, rank in ranks.items()}

    @classmethod
    def from_dir(cls, directory: Path, config: Mapping[str, Any]) -> TiktokenVocabulary:
        ranks = read_tiktoken_ranks(directory / "tiktoken.model")
        decoder = config.get("added_tokens_decoder") or {}
        specials: dict[int, str] = {}
        for key, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, Mapping) else entry
            if isinstance(content, str):
                specials[int(key)] = content
        by_name = {name: i for i, name in specials.items()}
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, Mapping) else bos
        add_bos = by_name.get(bos) if config.get("add_bos_token") and isinstance(bos, str) else None
        return cls(ranks, specials, add_bos)

    # --- the tokenizers.Tokenizer subset ----------------------------------------------------------

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.encoding.n_vocab if with_added_tokens else self.num_base

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        """Every token spelled one character per byte (latin-1), so a piece's length is its byte count."""
        vocab = {token.decode("latin-1"): rank for token, rank in self.encoding._mergeable_ranks.items()}
        if with_added_tokens:
            vocab.update(self.id_by_special)
        return vocab

    def get_added_tokens_decoder(self) -> dict[int, str]:
        return dict(self.special_by_id)

    def to_str(self) -> str:
        """The parts of a tokenizer.json that callers inspect: no normalizer, no byte-level decoder."""
        return json.dumps({"normalizer": None, "decoder": None, "model": {"type": "tiktoken"}})

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of a token (special tokens: their text)."""
        if token_id in self.special_by_id:
            return self.special_by_id[token_id].encode("utf-8")
        return self._bytes_by_id.get(token_id, b"")

    def token_to_id(self, token: str) -> int | None:
        special = self.id_by_special.get(token)
        if special is not None:
            return special
        return self.encoding._mergeable_ranks.get(token.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self.special_by_id:
            return self.special_by_id[token_id]
        token = self._bytes_by_id.get(token_id)
        return None if token is None else token.decode("utf-8", errors="replace")

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoded:
        """Special-token text (``<|im_end|>`` …) becomes its id, as in Kimi's tokenizer."""
        ids = self.encoding.encode(text, allowed_special="all")
        if add_special_tokens and self.add_bos_id is not None:
            ids = [self.add_bos_id, *ids]
        return _Encoded(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        valid = [i for i in ids if 0 <= i < self.encoding.n_vocab
                 and not (skip_special_tokens and i in self.special_by_id)]
        return self.encoding.decode(valid, errors="replace")
