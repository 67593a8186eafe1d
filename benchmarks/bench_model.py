"""The benchmark model (docs/benchmarks.md, "Setup"): Qwen3-0.6B's architecture with random bf16 weights.

Throughput does not depend on weight values when every request ignores EOS, so a random model built
from the config stands in for the real one on a machine without a hub. It gets a word-level
tokenizer (token i is the word ``t<i>``), so that a server streams text and detokenizing costs what
it costs with a real tokenizer of the same vocabulary size. The vocabulary's last ids are JSON's
characters and literals, then EOS (``JSON_PIECES``), so that a JSON schema can be satisfied (the
``json-schema`` workload); the other workloads draw their ids below 10,001 and never meet them.

    python benchmarks/bench_model.py DIR     # write the checkpoint that every benchmark loads with --model DIR
"""

from __future__ import annotations

import argparse
import string
import tempfile
from pathlib import Path

QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
)

# The ids just below EOS, the last id: one token per printable non-space ASCII character and one per
# JSON literal, enough to write any JSON without whitespace.
JSON_PIECES = tuple(c for c in string.printable if not c.isspace()) + ("true", "false", "null")
EOS_TOKEN = "<|endoftext|>"


def build_random_model(directory: Path | None = None, **overrides) -> Path:
    """Write a random Qwen3-0.6B-shaped bf16 checkpoint and return its directory."""
    import torch  # here, so that floor.py reads QWEN3_0_6B without torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    directory = Path(directory or tempfile.mkdtemp(prefix="qwen3-0.6b-random-"))
    config = Qwen3Config(**{**QWEN3_0_6B, **overrides})
    config.eos_token_id = config.vocab_size - 1  # the tokenizer's EOS_TOKEN
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    save_word_tokenizer(directory, config.vocab_size)
    return directory


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """Write a fast tokenizer whose id i is the word ``t<i>`` (text: the words joined by spaces), but
    for its last ids: ``JSON_PIECES``, which join their neighbours without a space, then ``EOS_TOKEN``.

    It is SentencePiece-shaped so that decoded text and xgrammar agree on every token's text: a word
    is stored as ``▁t<i>`` ("▁" a space, dropped before the first token of a text, as SentencePiece
    does), and the byte-fallback step in the decoder is what makes xgrammar read "▁" as a space (there
    are no byte tokens). A JSON output starts with a piece, so its text is exactly the concatenation
    of the tokens' texts that the grammar accepted; words can only stand inside its strings.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    num_words = vocab_size - len(JSON_PIECES) - 1
    if num_words < 1:
        raise ValueError(f"vocab_size={vocab_size} is too small; it must exceed {len(JSON_PIECES) + 1}, "
                         "the JSON pieces and EOS")
    vocab = {f"\u2581t{i}": i for i in range(num_words)}
    vocab |= {piece: num_words + j for j, piece in enumerate(JSON_PIECES)} | {EOS_TOKEN: vocab_size - 1}
    # An unknown word encodes as t0, which stays an ordinary word (a special token's text would be
    # skipped in decoded text, and xgrammar would still count it).
    words = Tokenizer(models.WordLevel(vocab, unk_token="\u2581t0"))
    words.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    words.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token=EOS_TOKEN).save_pretrained(directory)



if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the checkpoint and its tokenizer")
    print(build_random_model(parser.parse_args().directory))
