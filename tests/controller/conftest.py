"""Fixtures the load-generator tests share: the tiny tokenizers, trained once per module."""

from __future__ import annotations

import pytest

from tests.controller.tiny_tokenizers import bpe_tokenizer, wordlevel_tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of a byte-level BPE tokenizer.json that adds a BOS to every prompt."""
    return bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def wordlevel(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of a whitespace word-level tokenizer.json (no special tokens)."""
    return wordlevel_tokenizer(tmp_path_factory.mktemp("wl") / "tokenizer.json")
