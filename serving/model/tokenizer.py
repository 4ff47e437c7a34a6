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

EOS: a request ends at any of the model's end ids (:attr:`Tokenizer.eos_ids`): those of
config.json's and generation_config.json's ``eos_token_id`` (an id or a list: Llama 3
Instruct ends turns with ``<|eot_id|>``, listed only there) and tokenizer_config.json's
``eos_token``.

Chat: a checkpoint's own Jinja template where it has one (:attr:`Tokenizer.chat_template`,
serving/model/chat_template.py); otherwise :func:`render_chat`, the plain template: one
``"{role}: {content}\n"`` line per message, then ``"assistant: "`` for the model to continue.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from serving.model.chat_template import ChatTemplate, load_chat_template, token_text

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    max_token_chars: int  # characters of text one token covers, at most
    bos_id: int | None
    eos_ids: frozenset[int]  # every id that ends a request (unless it asks ignore_eos)
    chat_template: ChatTemplate | None  # the checkpoint's own; None: render_chat

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    BOS, EOS = 256, 257
    N_BYTES = 256

    def __init__(self, *, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size={vocab_size}: the byte tokenizer needs at least 258 ids")
        self.vocab_size = vocab_size
        self.bos_id: int | None = self.BOS
        self.eos_ids = frozenset((self.EOS,))
        self.chat_template: ChatTemplate | None = None
        self.max_token_chars = 1  # a token is one byte, a character at least one

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # adds no special tokens either way

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

    def __init__(
        self,
        path: str | Path,
        *,
        bos_id: int | None,
        eos_ids: frozenset[int],
        chat_template: ChatTemplate | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_ids, self.chat_template = bos_id, eos_ids, chat_template
        # the longest token, in characters of its vocabulary string (a byte-level BPE
        # writes one character per byte): a text of N characters is at least
        # N / max_token_chars tokens, up to what normalization removes
        self.max_token_chars = max((len(t) for t in self._tok.get_vocab(True)), default=1)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens: the post-processor's (e.g. Llama's BOS)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


CHAT_GENERATION_PROMPT = "assistant: "


def render_chat(messages: Sequence[tuple[str, str]], *, generation_prompt: bool = True) -> str:
    """The plain chat template: ``"{role}: {content}\n"`` per (role, content), then
    :data:`CHAT_GENERATION_PROMPT` unless ``generation_prompt`` is false (vLLM's
    ``add_generation_prompt``)."""
    text = "".join(f"{role}: {content}\n" for role, content in messages)
    return text + CHAT_GENERATION_PROMPT if generation_prompt else text


def _ids(v: object) -> list[int]:
    """An id or a list of ids, as config.json states ``eos_token_id``."""
    items = v if isinstance(v, list) else [v]
    return [i for i in items if isinstance(i, int) and not isinstance(i, bool)]


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(checkpoint_dir: str | Path | None, *, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer.json when readable, else byte-level."""
    if checkpoint_dir is not None:
        d = Path(checkpoint_dir)
        path = d / "tokenizer.json"
        if path.is_file():
            cfg, gen = _json(d / "config.json"), _json(d / "generation_config.json")
            bos = _ids(cfg.get("bos_token_id")) or _ids(gen.get("bos_token_id"))
            try:
                tok = HFTokenizer(
                    path,
                    bos_id=bos[0] if bos else None,
                    eos_ids=frozenset(
                        _ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id"))
                    ),
                    chat_template=load_chat_template(d),
                )
            except ImportError:
                logger.warning(
                    "%s found but the 'tokenizers' package is not installed: "
                    "using the byte-level tokenizer",
                    path,
                )
            else:
                eos_text = token_text(_json(d / "tokenizer_config.json").get("eos_token"))
                eos = tok.token_id(eos_text) if eos_text else None
                if eos is not None:
                    tok.eos_ids |= {eos}
                if tok.vocab_size > vocab_size:
                    raise ValueError(
                        f"{path}: tokenizer has {tok.vocab_size} ids but the model's "
                        f"vocab_size is {vocab_size}"
                    )
                return tok
    return ByteTokenizer(vocab_size=vocab_size)
