"""Llama, from a Hugging Face ``LlamaConfig``: the decoder stack Mistral, Qwen2 and Qwen3 reuse.

Module names follow the checkpoint's, except that q/k/v and gate/up run as one matmul each
(``packed_modules_mapping`` says which checkpoint tensors fill them). Subclasses change per-layer
policy (sliding windows, q/k norm, attention biases) through ``LlamaForCausalLM``'s hooks, not by
copying layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from micro_vllm.attention.attention import Attention
from micro_vllm.attention.backends.abstract import AttentionMetadata
from micro_vllm.layers.activation import SiluAndMul
from micro_vllm.layers.linear import Linear, MergedLinear
from micro_vllm.layers.norm import QKNorm, RMSNorm
from micro_vllm.layers.qk_norm_rope import QKNormRoPE
from micro_vllm.layers.rotary import RotaryEmbedding
from micro_vllm.models.utils import head_size_of


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Projections, RoPE (after a per-head q/k RMSNorm in Qwen3), paged attention, output projection.

    ``biases`` says whether the q/k/v projections and the output projection have a bias."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        qk_norm: bool,
        biases: tuple[bool, bool],
    ) -> None:
        super().__init__()
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_size = head_size_of(hf_config)
        self.q_size = num_heads * self.head_size
        self.kv_size = num_kv_heads * self.head_size
        qkv_bias, o_bias = biases
        hidden_size = hf_config.hidden_size
        self.qkv_proj = MergedLinear(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        if qk_norm:  # the checkpoint's per-head norms, applied before RoPE by one op (layers/qk_norm_rope.py)
            self.q_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps)
            rotary_emb = QKNormRoPE(QKNorm(self.q_norm, self.k_norm), rotary_emb)
        self.rotary_emb = rotary_emb  # chosen here, so forward never asks which
        self.attn = Attention(num_heads, self.head_size, num_kv_heads, self.head_size**-0.5, sliding_window)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)  # with q/k norm first where the model has it
        return self.o_proj(self.attn(q, k, v, metadata))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        qk_norm: bool,
        attention_biases: tuple[bool, bool],
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, rotary_emb, sliding_window, qk_norm, attention_biases)
        mlp_bias = getattr(hf_config, "mlp_bias", False)
        self.mlp = LlamaMLP(hidden_size, hf_config.intermediate_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside `hidden` and is added inside the next norm, so each
        # layer returns its sublayer output un-added.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        sliding_windows: list[int | None],
        qk_norm: bool,
        attention_biases: tuple[bool, bool],
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.rotary_emb = RotaryEmbedding.from_hf_config(hf_config, head_size_of(hf_config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, self.rotary_emb, window, qk_norm, attention_biases)
            for window in sliding_windows
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: list[AttentionMetadata]
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, metadata in zip(self.layers, attn_metadata, strict=True):
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The model interface the ModelRunner drives; Mistral, Qwen2 and Qwen3 override the hooks below."""

    # Our fused module -> the checkpoint modules stacked into it, in row order.
    packed_modules_mapping: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # Hook: RMSNorm each query/key head before RoPE.
    qk_norm: bool = False

    @classmethod
    def sliding_windows(cls, hf_config: PretrainedConfig) -> list[int | None]:
        """Hook: each decoder layer's sliding window (None = full attention)."""
        return [None] * hf_config.num_hidden_layers

    @classmethod
    def attention_biases(cls, hf_config: PretrainedConfig) -> tuple[bool, bool]:
        """Hook: whether the q/k/v projections and the output projection have a bias."""
        bias = getattr(hf_config, "attention_bias", False)
        return bias, bias

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; only 'silu' is")
        self.config = hf_config
        self.model = LlamaModel(
            hf_config,
            self.sliding_windows(hf_config),
            self.qk_norm,
            self.attention_biases(hf_config),
        )
        # Tied: logits reuse the embedding matrix, one parameter loaded under the embedding's name (the
        # head's own weight is never allocated).
        self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False,
                              device="meta" if self.tied else None)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: list[AttentionMetadata]
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    @property
    def tied(self) -> bool:
        return getattr(self.config, "tie_word_embeddings", False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into our parameters; returns the names of the parameters written.

        Tensors this model has no parameter for (a tied ``lm_head.weight``, old rotary buffers) are
        skipped; the loader checks that nothing the model needs is missing.
        """
        params = dict(self.named_parameters())
        shard_of = {
            piece: (fused, index)
            for fused, pieces in self.packed_modules_mapping.items()
            for index, piece in enumerate(pieces)
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in shard_of:
                fused, index = shard_of[leaf]
                target = f"{parent}.{fused}"
                if f"{target}.{param_name}" in params:
                    self.get_submodule(target).load_shard(index, param_name, tensor)
                    loaded.add(f"{target}.{param_name}")
            elif name in params:
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(name)
        return loaded
