"""Llama, from a Hugging Face ``LlamaConfig``: the decoder stack Mistral, Qwen2 and Qwen3 reuse.

Module names follow the checkpoint's, except that q/k/v and gate/up run as one matmul each
(``stacked_params_mapping`` says which checkpoint tensors fill them). Subclasses change per-layer
policy (sliding windows, q/k norm, attention biases) through ``LlamaForCausalLM``'s hooks, not by
copying layers.

Under tensor parallelism every rank builds the same model from its slices (layers/linear.py,
layers/vocab_parallel_embedding.py): its share of the attention heads (its attention layers, and so
its KV cache, hold only those) and of the MLP's hidden features, and its rows of the vocabulary. Per
decoder layer two all-reduces run, after ``o_proj`` and after ``down_proj``; one after the embedding
lookup, and one all-gather of the logits. Norms, q/k norms and the rotary tables are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from micro_vllm.attention.attention import Attention
from micro_vllm.attention.backends.abstract import AttentionMetadata
from micro_vllm.distributed import divide, num_kv_heads_per_rank
from micro_vllm.layers.activation import SiluAndMul
from micro_vllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from micro_vllm.layers.norm import QKNorm, RMSNorm
from micro_vllm.layers.qk_norm_rope import QKNormRoPE
from micro_vllm.layers.rotary import RotaryEmbedding
from micro_vllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from micro_vllm.model_loader.weight_utils import CheckpointTensor, ShardId, default_weight_loader
from micro_vllm.models.utils import head_size_of, num_kv_heads_of


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Projections, RoPE (after a per-head q/k RMSNorm in Qwen3), paged attention, output projection,
    over this rank's heads.

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
        total_num_heads = hf_config.num_attention_heads
        self.head_size = head_size_of(hf_config)
        qkv_bias, o_bias = biases
        hidden_size = hf_config.hidden_size
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_size, total_num_heads, num_kv_heads_of(hf_config),
                                          bias=qkv_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size  # this rank's
        self.o_proj = RowParallelLinear(total_num_heads * self.head_size, hidden_size, bias=o_bias)
        if qk_norm:  # the checkpoint's per-head norms, applied before RoPE by one op (layers/qk_norm_rope.py)
            self.q_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps)
            rotary_emb = QKNormRoPE(QKNorm(self.q_norm, self.k_norm), rotary_emb)
        self.rotary_emb = rotary_emb  # chosen here, so forward never asks which
        self.attn = Attention(self.qkv_proj.num_heads, self.head_size, self.qkv_proj.num_kv_heads,
                              self.head_size**-0.5, sliding_window)

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
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
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

    # (our fused module, a checkpoint module stacked into it, the shard_id its weight_loader takes).
    stacked_params_mapping: tuple[tuple[str, str, ShardId], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
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

    @classmethod
    def verify_tensor_parallel_size(cls, hf_config: PretrainedConfig, tensor_parallel_size: int) -> None:
        """Raise a ValueError naming both numbers for a split the layers cannot make: the attention
        heads and the MLP's hidden features split evenly over the ranks, the KV heads too or each
        replicated over several ranks. (The vocabulary is padded to a multiple of the ranks.)"""
        divide(hf_config.num_attention_heads, tensor_parallel_size, "num_attention_heads")
        num_kv_heads_per_rank(num_kv_heads_of(hf_config), tensor_parallel_size)
        divide(hf_config.intermediate_size, tensor_parallel_size, "intermediate_size")

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
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      tied_to=self.model.embed_tokens if self.tied else None)

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
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Hand each checkpoint tensor (or safetensors slice) to its parameter's ``weight_loader``,
        which copies in this rank's part of it (a fused parameter's rows for the piece ``shard_id``
        names; a parameter every rank holds whole, as the norms, takes it all). Returns the names of
        the parameters written.

        Tensors this model has no parameter for (a tied ``lm_head.weight``, old rotary buffers) are
        skipped; the loader checks that nothing the model needs is missing.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name, shard_id = self._stacked_name(name)
            param = params.get(name)
            if param is None:
                continue
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)
        return loaded

    def _stacked_name(self, name: str) -> tuple[str, ShardId]:
        """The parameter a checkpoint tensor fills, and the shard_id of its piece (None: all of it)."""
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        for fused, piece, shard_id in self.stacked_params_mapping:
            if leaf == piece:
                return f"{parent}.{fused}.{param_name}", shard_id
        return name, None
