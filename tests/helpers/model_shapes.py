"""The tiny-model shapes that cover every head size, GQA ratio and embedding kind, shared by the CPU
and GPU tests against transformers."""

# (family, head_dim, num_attention_heads, num_key_value_heads, tie_word_embeddings): each head size
# once, together covering GQA 1, 2, 4 and 8 and both embedding kinds in both families.
SHAPES = [
    ("llama", 12, 8, 1, True),
    ("qwen3", 20, 4, 2, False),
    ("llama", 64, 2, 2, False),
    ("qwen3", 80, 4, 1, True),
    ("llama", 96, 6, 3, True),
    ("qwen3", 128, 8, 1, False),
    ("llama", 256, 4, 1, False),
]


def shape_id(shape) -> str:
    family, head_size, num_heads, num_kv_heads, tied = shape
    return f"{family}-D{head_size}-GQA{num_heads // num_kv_heads}-{'tied' if tied else 'untied'}"


def shape_overrides(shape) -> dict:
    """tiny_models overrides for one row: ``head_dim`` explicit, so hidden stays small (and no power of two)."""
    family, head_size, num_heads, num_kv_heads, tied = shape
    return dict(hidden_size=48, intermediate_size=80, num_hidden_layers=1, head_dim=head_size,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, tie_word_embeddings=tied)
