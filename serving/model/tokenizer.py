"""Tokenizers: byte-level by default; a checkpoint's own ``tokenizer.json`` when possible.

- :class:`ByteTokenizer`: UTF-8 bytes are ids 0-255, then BOS (256) and EOS
  (257). Needs nothing and works with any model whose vocabulary has at least
  258 entries. A model with random weights and a larger vocabulary emits ids
  beyond the byte range; ``decode`` shows each of those as one printable ASCII
  character (``chr(32 + id % 95)``) so a demo stream is visible text.
- :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` in a checkpoint
  directory, read with the ``tokenizers`` library (pure local file, no network).
  ``tokenizers`` is optional: without it a checkpoint's tokenizer is ignored
  with a warning and the byte-level tokenizer is used.

:func:`render_chat` is the plain chat template ``/v1/chat/completions`` uses with every
tokenizer (a checkpoint's own Jinja template is not read): one ``"{role}: {content}\n"``
line per message, then ``"assistant: "`` for the model to continue.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    max_token_chars: int  # characters of text one token covers, at most
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    BOS, EOS = 256, 257
    N_BYTES = 256

    def __init__(self, *, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size={vocab_size}: the byte tokenizer needs at least 258 ids")
        self.vocab_size = vocab_size
        self.bos_id: int | None = self.BOS
        self.eos_id: int | None = self.EOS
        self.max_token_chars = 1  # a token is one byte, a character at least one

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < self.N_BYTES:
                out.append(i)
            elif i in (self.BOS, self.EOS):
                continue
            else:
                out.append(32 + i % 95)
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, *, bos_id: int | None, eos_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = bos_id, eos_id
        # the longest token, in characters of its vocabulary string (a byte-level BPE
        # writes one character per byte): a text of N characters is at least
        # N / max_token_chars tokens, up to what normalization removes
        self.max_token_chars = max((len(t) for t in self._tok.get_vocab(True)), default=1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids  # with the post-processor (e.g. Llama BOS)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


CHAT_GENERATION_PROMPT = "assistant: "


def render_chat(messages: Sequence[tuple[str, str]], *, generation_prompt: bool = True) -> str:
    """The plain chat template: ``"{role}: {content}\n"`` per (role, content), then
    :data:`CHAT_GENERATION_PROMPT` unless ``generation_prompt`` is false (vLLM's
    ``add_generation_prompt``)."""
    text = "".join(f"{role}: {content}\n" for role, content in messages)
    return text + CHAT_GENERATION_PROMPT if generation_prompt else text


def _first_id(v: object) -> int | None:
    if isinstance(v, list):
        return v[0] if v else None
    return v if isinstance(v, int) else None


def load_tokenizer(checkpoint_dir: str | Path | None, *, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer.json when readable, else byte-level."""
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / "tokenizer.json"
        if path.is_file():
            cfg_path = Path(checkpoint_dir) / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            try:
                tok = HFTokenizer(
                    path,
                    bos_id=_first_id(cfg.get("bos_token_id")),
                    eos_id=_first_id(cfg.get("eos_token_id")),
                )
            except ImportError:
                logger.warning(
                    "%s found but the 'tokenizers' package is not installed: "
                    "using the byte-level tokenizer",
                    path,
                )
            else:
                if tok.vocab_size > vocab_size:
                    raise ValueError(
                        f"{path}: tokenizer has {tok.vocab_size} ids but the model's "
                        f"vocab_size is {vocab_size}"
                    )
                return tok
    return ByteTokenizer(vocab_size=vocab_size)
