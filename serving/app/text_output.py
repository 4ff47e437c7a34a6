"""From the engine's token ids to the text and token count a client sees.

:class:`IncrementalDecoder` turns a growing list of ids into text deltas without
splitting characters; :class:`TextOutput` adds where a request ends: a stop token id
(the tokenizer's EOS unless ``ignore_eos``, and ``stop_token_ids``) ends it, is not
shown and is not counted; a stop string ends the text before it (or after it with
``include_stop_str_in_output``) and the tokens that only made the stop string are not
counted either, so ``usage.completion_tokens`` is the tokens that produced output. As in
vLLM (vllm/v1/engine/detokenizer.py: stop strings are checked only once more than
``min_tokens`` tokens came out, and only where they overlap the new text) a stop string
that completed before ``min_tokens`` does not end the request. Pure: no Ray, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting characters.

    A byte-level tokenizer can end a step in the middle of a UTF-8 sequence; the
    decoded tail is then U+FFFD, so the delta is held back until it completes.
    Each push decodes only a short window (the ids since the text last came out
    clean, plus the ones before them for context, as vLLM's incremental
    detokenizer does), so a long output costs O(1) per token, not O(length).
    """

    decode: Callable[[Sequence[int]], str]
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # window start: ids before it are out and do not change the text
    read: int = 0  # ids before it are out (as text)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def push_many(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        done = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if not final and text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]


@dataclass(kw_only=True)
class TextOutput:
    """One request's output: feed it the engine's token chunks (:meth:`push`), send
    what it returns, then :meth:`finish`. ``tokens`` counts the tokens that produced
    output; ``stopped`` is "id" or "string" once a stop token id or a stop string ended
    the request (the engine ends on a stop id by itself; on a stop string the caller
    stops the engine request)."""

    decode: Callable[[Sequence[int]], str]
    stop_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    min_tokens: int = 0
    tokens: int = 0
    stopped: str | None = None
    _decoder: IncrementalDecoder = field(init=False)
    _held: str = ""  # text out of the decoder, held back: a stop string may start in it
    _sent: int = 0  # characters returned so far
    _starts: list[int] = field(default_factory=list)  # per token: chars decoded before it

    def __post_init__(self) -> None:
        self._decoder = IncrementalDecoder(decode=self.decode)
        self._keep = max((len(s) for s in self.stop), default=1) - 1

    def push(self, chunk: Sequence[int]) -> str:
        """The text of ``chunk`` that can go out now ("" while a character or a possible
        stop string is incomplete). Tokens after the request stopped are ignored."""
        if self.stopped is not None:
            return ""
        cut = next((i for i, t in enumerate(chunk) if t in self.stop_ids), None)
        if cut is not None:
            self.stopped = "id"
            chunk = chunk[:cut]
        if not self.stop:
            self.tokens += len(chunk)
            return self._decoder.push_many(chunk)
        for tok in chunk:
            self._starts.append(self._sent + len(self._held))
            self.tokens += 1
            self._add(self._decoder.push(tok))
            if self.stopped == "string":
                break
        return self._release(final=self.stopped is not None)

    def finish(self, max_tokens: int) -> tuple[str, str]:
        """(the text still held, the finish reason): "stop" for a stop id or string,
        "length" when ``max_tokens`` tokens came out."""
        if self.stopped != "string":
            tail = self._decoder.flush()
            if not self.stop:
                return tail, "stop" if self.stopped or self.tokens < max_tokens else "length"
            self._add(tail)
        text = self._release(final=True)
        reason = "stop" if self.stopped or self.tokens < max_tokens else "length"
        return text, reason

    def _add(self, text: str) -> None:
        """Append decoded text; end at the first stop string that overlaps it."""
        if not text or self.tokens <= self.min_tokens:
            self._held += text
            return
        old = len(self._held)
        held = self._held = self._held + text
        found = [(i, s) for s in self.stop if (i := held.find(s, max(0, old - len(s) + 1))) >= 0]
        if not found:
            return
        i, s = min(found)
        end = i + (len(s) if self.include_stop_str else 0)
        self._held = held[:end]
        self.stopped = "string"
        # tokens whose text starts before the end of the output produced it
        self.tokens = bisect.bisect_left(self._starts, self._sent + end)

    def _release(self, *, final: bool) -> str:
        n = len(self._held) if final else max(0, len(self._held) - self._keep)
        out, self._held = self._held[:n], self._held[n:]
        self._sent += n
        return out
