"""Tiny tokenizers trained in a test from a few sentences (no downloads): a byte-level
BPE that adds a BOS to every prompt (GPT-2/Llama-3 style) and a whitespace word-level one."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "serving engines batch decode steps under a latency objective",
    "the roofline bounds every token and the knee sits near the ridge",
] * 5


def bpe_tokenizer(path: Path) -> str:
    """A byte-level BPE (GPT-2/Llama-3 style) with a BOS added to every prompt."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path))
    return str(path)


def wordlevel_tokenizer(path: Path) -> str:
    """A whitespace word-level vocabulary, no special tokens added."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return str(path)
