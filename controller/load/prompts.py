"""Prompts of a known number of tokens: text or token ids, deterministic per seed.

With the served model's ``tokenizer.json`` (read by the ``tokenizers`` library, a local
file only) a prompt of N tokens is a run of words each of which is one token of that
vocabulary, at the start of a text and after a space; a pre-tokenizer that splits at
spaces (byte-level BPE, Metaspace, Whitespace) keeps them one token each, so N words
are N tokens. Every prompt is encoded once more to check, and a few words added or
dropped when the count is off; the count recorded is always the checked one.

How a server counts (so the client counts the same): ``/v1/completions`` tokenizes a
text prompt with the tokenizer's special tokens (vLLM's ``add_special_tokens`` defaults
to true there, vllm/entrypoints/openai/protocol.py CompletionRequest), so a BOS counts;
a token-id prompt is taken as is; a chat message is counted without special tokens (the
chat template adds its own, which the server's ``usage.prompt_tokens`` then includes).

Without a tokenizer, text prompts are characters of filler words (one token each with
slotune's byte tokenizer) and token-id prompts are those characters' ASCII codes.
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass

from controller.load.spec import LoadSpec, synth_prompt, tokenizer_file

log = logging.getLogger(__name__)

_POOL_MAX = 2048  # one-token words kept from a vocabulary (its lowest ids: the commonest)
_MAX_WORD = 16
_FIX_ROUNDS = 6


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """What goes into the request's ``prompt`` (or message content), and its length in the
    served model's tokens as the client counted them (characters without a tokenizer)."""

    value: str | tuple[int, ...]
    tokens: int

    def __post_init__(self) -> None:
        if not self.value:
            raise ValueError(f"prompt {self.value!r}: must not be empty")


class PromptMaker:
    """Builds the prompts of one :class:`~controller.load.spec.LoadSpec`."""

    def __init__(self, spec: LoadSpec) -> None:
        self.token_ids = spec.prompt_format == "token_ids"
        # chat: the template adds the special tokens, the content has none of its own
        self.specials = spec.endpoint == "completions"
        self.vocab = _vocab(str(tokenizer_file(spec.tokenizer))) if spec.tokenizer else None
        self._warned = False

    def make(self, n: int, rng: random.Random) -> Prompt:
        """A prompt of ``n`` tokens (``n`` characters without a tokenizer)."""
        if self.vocab is None:
            text = synth_prompt(n, rng)
            if self.token_ids:
                return Prompt(value=tuple(text.encode("ascii")), tokens=n)
            return Prompt(value=text, tokens=n)
        text, count = self._words(n, rng, warn=not self.token_ids)  # ids are cut to n below
        if self.token_ids:
            ids = self.vocab.encode(text, specials=True)
            if len(ids) < n:  # only when the vocabulary had no one-token words
                ids += [ids[i % len(ids)] for i in range(n - len(ids))]
            return Prompt(value=tuple(ids[:n]), tokens=n)
        return Prompt(value=text, tokens=count)

    def from_text(self, text: str) -> Prompt:
        """A trace's own prompt text, counted (or encoded, for token ids) with the tokenizer."""
        if self.vocab is None:
            if self.token_ids:  # LoadSpec refuses this; kept exact for direct callers
                raise ValueError("a text prompt as token ids needs a tokenizer")
            return Prompt(value=text, tokens=len(text))
        if self.token_ids:
            ids = tuple(self.vocab.encode(text, specials=True))
            return Prompt(value=ids, tokens=len(ids))
        return Prompt(value=text, tokens=len(self.vocab.encode(text, specials=self.specials)))

    def _words(self, n: int, rng: random.Random, *, warn: bool) -> tuple[str, int]:
        """About ``n`` tokens of one-token words, and their checked count."""
        vocab = self.vocab
        assert vocab is not None
        specials = self.specials  # token ids go to /v1/completions: with the BOS too
        pool = vocab.pool or _FALLBACK_WORDS
        words = [rng.choice(pool) for _ in range(max(1, n - (vocab.added if specials else 0)))]
        count = len(vocab.encode(" ".join(words), specials=specials))
        for _ in range(_FIX_ROUNDS):
            if count == n or (count > n and len(words) == 1):
                break
            if count > n:
                del words[max(1, len(words) - (count - n)) :]
            else:
                words += [rng.choice(pool) for _ in range(n - count)]
            count = len(vocab.encode(" ".join(words), specials=specials))
        if warn and count != n and not self._warned:
            self._warned = True
            log.warning(
                "a prompt of %d tokens came out as %d with this tokenizer (%d one-token "
                "words, %d special tokens a prompt); each request records its own count",
                n,
                count,
                len(vocab.pool),
                vocab.added if specials else 0,
            )
        return " ".join(words), count


_FALLBACK_WORDS = ("the", "a", "of", "and", "to", "in", "token", "batch")


class _Vocab:
    """A tokenizer and the words that are one token of it, at the start and after a space."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ValueError(f"tokenizer={path!r}: not a tokenizer.json ({e})") from None
        probe = "token"
        self.added = len(self.tok.encode(probe).ids) - len(
            self.tok.encode(probe, add_special_tokens=False).ids
        )
        self.pool = self._one_token_words()
        log.info(
            "tokenizer %s: %d ids, %d special token(s) added to a prompt, %d one-token words",
            path,
            self.tok.get_vocab_size(),
            self.added,
            len(self.pool),
        )

    def encode(self, text: str, *, specials: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=specials).ids)

    def _one_token_words(self) -> tuple[str, ...]:
        size = self.tok.get_vocab_size(with_added_tokens=False)
        texts = self.tok.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
        seen: set[str] = set()
        words: list[str] = []
        for t in texts:
            w = t.strip()
            if w and len(w) <= _MAX_WORD and w.isascii() and w.isalpha() and w not in seen:
                seen.add(w)
                words.append(w)
        out: list[str] = []
        step = 4 * _POOL_MAX  # check in slices: a big vocabulary fills the pool early
        for lo in range(0, len(words), step):
            part = words[lo : lo + step]
            alone = self.tok.encode_batch(part, add_special_tokens=False)
            spaced = self.tok.encode_batch([" " + w for w in part], add_special_tokens=False)
            pairs = zip(part, alone, spaced, strict=True)
            out += [w for w, a, s in pairs if len(a.ids) == len(s.ids) == 1]
            if len(out) >= _POOL_MAX:
                break
        return tuple(out[:_POOL_MAX])


@functools.lru_cache(maxsize=4)
def _vocab(path: str) -> _Vocab:
    """One :class:`_Vocab` per file for the process (a tune runs many windows)."""
    return _Vocab(path)
