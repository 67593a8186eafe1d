"""Loads the Hugging Face tokenizer that sits beside a model, when there is one.

Models built for tests often ship without a tokenizer; the engine then takes token ids only.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)
