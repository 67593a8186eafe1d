"""Loads the Hugging Face tokenizer that sits beside a model, or the one the user names.

Models built for tests often ship without a tokenizer; the engine then takes token ids only. A
tokenizer the user names explicitly must exist.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: Path, tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer in ``tokenizer`` (a directory) if given, else the model directory's, if any."""
    path = model_path if tokenizer is None else Path(tokenizer).expanduser()
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        if tokenizer is None:
            return None
        raise ValueError(
            f"tokenizer={tokenizer!r} is not allowed; it must be a directory holding one of {_TOKENIZER_FILES}"
        )
    return AutoTokenizer.from_pretrained(path)
