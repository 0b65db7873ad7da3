"""tiktoken vocabularies (Kimi-K2, Moonlight): ``tiktoken.model`` + ``tokenizer_config.json``.

A ``tiktoken.model`` file holds only the mergeable ranks (``base64(token bytes) rank`` per
line); what surrounds them comes from the model family's convention, which Kimi's remote
``tokenization_kimi.py`` fixes:

* the pre-tokenizer split is ``KIMI_PATTERN`` (o200k-like, Han runs split out);
* ``num_base = len(ranks)`` ordinary ids, then 256 special ids ``num_base … num_base + 255``,
  named by ``tokenizer_config.json``'s ``added_tokens_decoder``; unnamed ones are
  ``<|reserved_token_{id}|>``; special-token text in the input encodes to its id.

``tiktoken_tokenizer`` turns that into a ``tokenizers.Tokenizer`` (byte-level BPE), so the
frontends keep one code path (streaming detokenizer, logprob bytes, special-token handling).
Rank BPE becomes merge BPE the usual way: every multi-byte token of rank r is the merge, at
priority r, of each split into two tokens that exist (lower-ranked splits first), and a piece
that is a whole token is taken as is (``ignore_merges``), as tiktoken does. Tests check the
result against ``tiktoken.Encoding`` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

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


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what byte-level BPE vocabularies spell)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model`` → {token bytes: rank}, ranks dense from 0."""
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(path))
    except (ValueError, IndexError) as exc:
        raise InvalidRequestError(f"{path} is not a tiktoken BPE file ('base64 rank' per line): {exc}",
                                  "tokenizer") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise InvalidRequestError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps", "tokenizer")
    return ranks


def special_tokens_from_config(config: Mapping[str, Any], num_base: int) -> dict[int, str]:
    """Kimi's layout: ``num_base + i`` for i < 256, named by ``added_tokens_decoder`` (ids beyond
    the reserved range too), unnamed ones ``<|reserved_token_{id}|>``."""
    named: dict[int, str] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, Mapping) else entry
        if isinstance(content, str) and str(key).isdigit() and int(key) >= num_base:
            named[int(key)] = content
    last = max([num_base + NUM_RESERVED_SPECIAL_TOKENS - 1, *named])
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(num_base, last + 1)}


def tiktoken_tokenizer(ranks: dict[bytes, int], special_tokens: Mapping[int, str], pattern: str = KIMI_PATTERN,
                       bos_token: str | None = None) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equal to the tiktoken encoding of ``ranks`` with
    ``pattern``; ``special_tokens`` (dense ids from ``len(ranks)``) are added tokens; ``bos_token``,
    if given, is prepended when special tokens are added."""
    alphabet = _byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                merges.append((rank, left, right, spell(token[:cut]), spell(token[cut:])))
    merges.sort()
    tokenizer = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    ids = sorted(special_tokens)
    if ids and ids != list(range(len(ranks), len(ranks) + len(ids))):
        raise InvalidRequestError(f"special token ids must follow the {len(ranks)} BPE ranks without gaps",
                                  "tokenizer")
    tokenizer.add_special_tokens([AddedToken(special_tokens[i], special=True, normalized=False) for i in ids])
    if bos_token is not None:
        bos_id = tokenizer.token_to_id(bos_token)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A $B", special_tokens=[(bos_token, bos_id)])
    return tokenizer


def load_tiktoken_dir(directory: Path, config: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of a model directory with ``tiktoken.model`` (Kimi-K2 layout)."""
    ranks = read_tiktoken_ranks(directory / "tiktoken.model")
    specials = special_tokens_from_config(config, len(ranks))
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, Mapping) else bos
    add_bos = bool(config.get("add_bos_token")) and isinstance(bos, str) and bos in specials.values()
    return tiktoken_tokenizer(ranks, specials, bos_token=bos if add_bos else None)


def tiktoken_encoding(directory: Path, config: Mapping[str, Any]) -> Any:
    """The same vocabulary as a ``tiktoken.Encoding`` (ranks, ``KIMI_PATTERN``, the special tokens),
    for consumers that take tiktoken's own form (llguidance's ``LLTokenizer.from_tiktoken``)."""
    import tiktoken

    ranks = read_tiktoken_ranks(directory / "tiktoken.model")
    specials = special_tokens_from_config(config, len(ranks))
    return tiktoken.Encoding(name=directory.name or "tiktoken", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens={name: i for i, name in specials.items()})
