"""The benchmark model (docs/benchmarks.md, "Setup"): Qwen3-0.6B's architecture with random bf16 weights.

Throughput does not depend on weight values when every request ignores EOS, so a random model built
from the config stands in for the real one on a machine without a hub. It gets a word-level
tokenizer (token i is the word ``t<i>``), so that a server streams text and detokenizing costs what
it costs with a real tokenizer of the same vocabulary size.

    python benchmarks/bench_model.py DIR     # write the checkpoint that every benchmark loads with --model DIR
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def build_random_model(directory: Path | None = None, **overrides) -> Path:
    """Write a random Qwen3-0.6B-shaped bf16 checkpoint and return its directory."""
    import torch  # here, so that floor.py reads QWEN3_0_6B without torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    directory = Path(directory or tempfile.mkdtemp(prefix="qwen3-0.6b-random-"))
    config = Qwen3Config(**{**QWEN3_0_6B, **overrides})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    save_word_tokenizer(directory, config.vocab_size)
    return directory


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """Write a fast tokenizer whose id i is the word ``t<i>``: text is the ids' words joined by spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")  # no word carries the prefix, so words join with spaces
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(directory)



if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the checkpoint and its tokenizer")
    print(build_random_model(parser.parse_args().directory))
