"""A deterministic toy tokenizer and token stream.

The same seed and prompt always give the same tokens and logprobs, so a golden-output probe can tell
good output from the two broken kinds vLLM produces: *garbled* (level-2 weights used without a reload:
random words unrelated to the prompt) and *degenerate* (token id 0 "!" repeated with NaN logprobs, the
#44972 class).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from enum import Enum

_WORDS = (
    " the of and to in is was for on that with as by at from it an be are this which or his had"
    " not but were have one all their they has been new more there also after first time two"
    " would when some into other than its only over most can may such then these about while"
    " river light stone paper garden window engine signal silver winter market harbor quiet"
).split(" ")[1:]
DEGENERATE_ID = 0
# id 0 is "!" as in the GPT-2 family, ids 1..3 are specials, then whole words, then one id per byte.
VOCAB: tuple[str, ...] = ("!", "<s>", "</s>", "<pad>", *(f" {w}" for w in _WORDS))
_BYTE_BASE = len(VOCAB)
VOCAB_SIZE = _BYTE_BASE + 256
_PIECE_ID = {piece: i for i, piece in enumerate(VOCAB)}
_SPLIT = re.compile(r" ?[A-Za-z]+|\s|[^A-Za-z\s]")


class Quality(Enum):
    NORMAL = "normal"
    GARBLED = "garbled"
    DEGENERATE = "degenerate"


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]


def tokenize(text: str) -> list[int]:
    ids: list[int] = []
    for piece in _SPLIT.findall(text):
        if piece in _PIECE_ID:
            ids.append(_PIECE_ID[piece])
        else:
            ids.extend(_BYTE_BASE + b for b in piece.encode())
    return ids


def piece_id(text: str) -> int:
    """The id of a whole vocabulary piece (every generated token and top-logprob candidate is one)."""
    return _PIECE_ID[text]


def piece(token_id: int) -> str:
    if 0 <= token_id < _BYTE_BASE:
        return VOCAB[token_id]
    if _BYTE_BASE <= token_id < VOCAB_SIZE:
        return bytes([token_id - _BYTE_BASE]).decode("latin-1")
    raise ValueError(f"token id {token_id} is outside the vocabulary (0..{VOCAB_SIZE - 1})")


def detokenize(ids: list[int]) -> str:
    out = bytearray()
    for token_id in ids:
        if _BYTE_BASE <= token_id < VOCAB_SIZE:
            out.append(token_id - _BYTE_BASE)
        else:
            out.extend(piece(token_id).encode())
    return out.decode(errors="replace")


class TokenStream:
    """Yields the tokens a request would generate; ``natural_length`` models an EOS."""

    def __init__(self, seed: int | str, prompt: str, *, top_logprobs: int = 0) -> None:
        self._good = random.Random(f"{seed}\x00{prompt}")
        # Garbled output ignores the prompt: weights that were discarded no longer encode it.
        self._garbled = random.Random(f"{seed}\x00garbled")
        self._top = top_logprobs
        self.natural_length = self._good.randint(8, 32)

    def next(self, quality: Quality) -> Token:
        if quality is Quality.DEGENERATE:
            nan_top = tuple((VOCAB[DEGENERATE_ID], math.nan) for _ in range(self._top))
            return Token(DEGENERATE_ID, VOCAB[DEGENERATE_ID], math.nan, nan_top)
        rng = self._good if quality is Quality.NORMAL else self._garbled
        word_id = rng.randrange(4, _BYTE_BASE)
        logprob = -round(rng.uniform(0.05, 2.5), 4)
        top = [(VOCAB[word_id], logprob)]
        for _ in range(self._top - 1):
            top.append((VOCAB[rng.randrange(4, _BYTE_BASE)], round(logprob - rng.uniform(0.1, 3.0), 4)))
        return Token(word_id, VOCAB[word_id], logprob, tuple(top[: self._top]))
