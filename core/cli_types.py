"""argparse ``type=`` validators: every numeric flag has a range, and a value outside it is a
clear usage error (argparse prints it with the usage line and exits 2) instead of a traceback or
a silently odd server.

    parser.add_argument("--port", type=port())                      # 1..65535
    parser.add_argument("--max-num-seqs", type=int_range(1, 2**31 - 1))
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def float_range(low: float, high: float = math.inf, *, low_inclusive: bool = True) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``(low, high]`` when not ``low_inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above_low = value >= low if low_inclusive else value > low
        if not math.isfinite(value) or not above_low or value > high:
            bracket = "[" if low_inclusive else "("
            upper = "" if math.isinf(high) else f"{high:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number in {bracket}{low:g}, {upper or 'inf'}"
                                             f"{']' if upper else ')'}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def port(allow_zero: bool = False) -> Callable[[str], int]:
    """A TCP port 1..65535 (or 0 when ``allow_zero``: the flag's "disabled" value)."""
    return int_range(0 if allow_zero else 1, 65535)


def non_empty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return text

    parse.__name__ = "string"
    return parse


def token_ids(text: str) -> list[int]:
    """Comma-separated token ids, each in [0, 2**31)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        ids = [int(p, 10) for p in parts]
    except ValueError:
        ids = []
    if not ids or not all(0 <= i <= INT32_MAX for i in ids):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers in [0, {INT32_MAX}], got {text!r}")
    return ids


token_ids.__name__ = "token ids"
