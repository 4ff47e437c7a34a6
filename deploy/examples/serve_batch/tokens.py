"""The example's tokenizer: a token is a byte (0-255), plus one end-of-sequence id.

Kept free of torch so the HTTP side can import it before the replica picks torch's
threading settings (app.py).
"""

from __future__ import annotations

EOS_ID = 256
VOCAB_SIZE = 257  # the 256 byte values and EOS


def encode(text: str) -> tuple[int, ...]:
    """A string's token ids: its UTF-8 bytes."""
    return tuple(text.encode("utf-8"))


def token_text(token: int) -> str:
    """A token's text: one byte as one Latin-1 character (EOS has none)."""
    return "" if token == EOS_ID else bytes([token]).decode("latin-1")
