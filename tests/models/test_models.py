"""Our models against transformers on tiny random checkpoints, plus the loader's error paths."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from helpers.paged_run import PagedRun, bind_backend
from helpers.tiny_models import FAMILIES, load_hf_reference, make_tiny_model, tiny_config

from micro_vllm import LLM, SamplingParams
from micro_vllm.layers.activation import SiluAndMul
from micro_vllm.layers.norm import RMSNorm
from micro_vllm.layers.rotary import (
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    cos_sin_scale,
    inverse_frequencies,
    rope_parameters,
)
from micro_vllm.model_loader.checkpoint import load_hf_config, load_model, resolve_model_path
from micro_vllm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from micro_vllm.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_model(family, root) for family in FAMILIES}


def prompts_for(seed: int, lengths: tuple[int, ...] = (5, 11, 18)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


def load_ours(path: Path, backend: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return bind_backend(load_model(path, load_hf_config(path), dtype, torch.device("cpu")), backend)


# The triton kernels run under Triton's CPU interpreter, slowly: one prefill per family, no decodes.
@pytest.mark.parametrize("backend, block_size", [("reference", 4), ("sdpa", 16), ("triton", 8)])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(model_dirs, family, backend, block_size):
    path = model_dirs[family]
    ours, reference = load_ours(path, backend), load_hf_reference(path)
    prompts = prompts_for(seed=1)
    logits = PagedRun(ours, len(prompts), block_size).step(prompts)
    for prompt, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(reference, prompt), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_decode_match_transformers(model_dirs, family):
    path = model_dirs[family]
    ours, reference = load_ours(path, "sdpa"), load_hf_reference(path)
    prompts = prompts_for(seed=2, lengths=(7, 13, 17))
    run = PagedRun(ours, len(prompts), block_size=4, seed=3)
    splits = [3, 9, 16]  # the second chunk attends to cached K/V of the first
    run.step([p[:s] for p, s in zip(prompts, splits, strict=True)])
    second = run.step([p[s:] for p, s in zip(prompts, splits, strict=True)])
    for prompt, got in zip(prompts, second, strict=True):
        torch.testing.assert_close(got[-1], hf_logits(reference, prompt)[-1], atol=ATOL, rtol=RTOL)
    # One decode step per request, all in one batch.
    next_tokens = [int(got[-1].argmax()) for got in second]
    decoded = run.step([[t] for t in next_tokens])
    for prompt, token, got in zip(prompts, next_tokens, decoded, strict=True):
        torch.testing.assert_close(got[0], hf_logits(reference, prompt + [token])[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family, windows", [("mistral", [8, 8]), ("qwen2_sliding", [None, 5])])
def test_window_shorter_than_prompt(model_dirs, family, windows):
    path = model_dirs[family]
    ours, reference = load_ours(path, "reference"), load_hf_reference(path)
    assert [attn.sliding_window for attn in ours.attention_layers()] == windows
    prompt = prompts_for(seed=4, lengths=(27,))[0]
    got = PagedRun(ours, 1, block_size=4).step([prompt])[0]
    torch.testing.assert_close(got, hf_logits(reference, prompt), atol=ATOL, rtol=RTOL)
    # The window must matter here, or the comparison above proves nothing about it.
    for attn in ours.attention_layers():
        attn.sliding_window = None
    full = PagedRun(ours, 1, block_size=4).step([prompt])[0]
    assert not torch.allclose(full[-1], got[-1], atol=1e-2)


@pytest.mark.parametrize("model_class", [Qwen2ForCausalLM, Qwen3ForCausalLM])
def test_qwen_sliding_windows_follow_transformers_layer_types(model_class):
    """use_sliding_window, sliding_window, max_window_layers and layer_types decide, as in transformers."""
    family = "qwen2_sliding" if model_class is Qwen2ForCausalLM else "qwen3_sliding"
    window = tiny_config(family).sliding_window
    cases = [
        (dict(num_hidden_layers=4, max_window_layers=1), [None, window, window, window]),
        (dict(num_hidden_layers=4, max_window_layers=3), [None, None, None, window]),
        (dict(use_sliding_window=False), [None, None]),
        (dict(layer_types=["sliding_attention", "full_attention"]), [window, None]),
        (dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]), [None, None]),
    ]
    for overrides, expected in cases:
        config = tiny_config(family, **overrides)
        assert model_class.sliding_windows(config) == expected, overrides
        hf_windows = [
            layer.self_attn.sliding_window
            for layer in AutoModelForCausalLM.from_config(config).model.layers
        ]
        assert hf_windows == expected, overrides


def test_attention_biases_per_family(model_dirs):
    """Qwen2: q/k/v biases, none on o_proj; Llama: attention_bias switches all four."""
    qwen2, llama_untied = load_ours(model_dirs["qwen2"], "reference"), load_ours(model_dirs["llama_untied"], "reference")
    qwen2_attn, llama_attn = qwen2.model.layers[0].self_attn, llama_untied.model.layers[0].self_attn
    assert qwen2_attn.qkv_proj.bias is not None and qwen2_attn.o_proj.bias is None
    assert llama_attn.qkv_proj.bias is not None and llama_attn.o_proj.bias is not None
    assert llama_untied.model.layers[0].mlp.down_proj.bias is not None


def test_tied_and_untied_embeddings(model_dirs):
    tied_path, untied_path = model_dirs["llama"], model_dirs["llama_untied"]
    assert "lm_head.weight" not in load_file(tied_path / "model.safetensors")
    tied, untied = load_ours(tied_path, "reference"), load_ours(untied_path, "reference")
    for model, tied_head in ((tied, True), (untied, False)):
        assert torch.equal(plain(model.lm_head.weight), model.model.embed_tokens.weight) == tied_head


def test_bf16_build(model_dirs):
    ours = load_ours(model_dirs["qwen3"], "sdpa", dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    prompts = prompts_for(seed=5, lengths=(6, 9))
    logits = PagedRun(ours, 2, block_size=4).step(prompts)
    assert all(x.dtype == torch.bfloat16 and torch.isfinite(x).all() for x in logits)  # the model's dtype


# --- layers ---------------------------------------------------------------------------------------


def test_rmsnorm_fused_residual_matches_separate_add():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))


def test_silu_and_mul():
    gate_up = torch.randn(4, 6)
    expected = torch.nn.functional.silu(gate_up[:, :3]) * gate_up[:, 3:]
    torch.testing.assert_close(SiluAndMul()(gate_up), expected)


def test_rope_reads_old_and_new_config_forms():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    new = SimpleNamespace(
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **scaling), max_position_embeddings=64
    )
    old = SimpleNamespace(
        rope_theta=500000.0, rope_scaling=dict(type="llama3", **scaling), max_position_embeddings=64
    )
    assert rope_parameters(new) == rope_parameters(old)
    plain = SimpleNamespace(rope_theta=500000.0, rope_scaling=None, max_position_embeddings=64)
    assert rope_parameters(plain) == {"rope_type": "default", "rope_theta": 500000.0}
    scaled = inverse_frequencies(16, rope_parameters(new))
    unscaled = inverse_frequencies(16, rope_parameters(plain))
    assert torch.equal(scaled[0], unscaled[0]) and torch.allclose(scaled[-1], unscaled[-1] / 8)


def test_unknown_rope_type_is_refused_naming_the_field_and_the_choices(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                     long_factor=[2.0] * 8, original_max_position_embeddings=64)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_type='longrope' \(in the config's rope_parameters") as error:
        load_ours(path, "reference")
    assert all(repr(name) in str(error.value) for name in SUPPORTED_ROPE_TYPES)


_ROPE_CASES = {
    "linear": dict(factor=3.0),
    "dynamic": dict(factor=4.0),
    "yarn": dict(factor=4.0, original_max_position_embeddings=64),
    "yarn, betas, no truncation": dict(
        factor=4.0, original_max_position_embeddings=64, beta_fast=8, beta_slow=2, truncate=False
    ),
    "yarn, DeepSeek mscales": dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
    "yarn, given attention factor": dict(factor=4.0, original_max_position_embeddings=64, attention_factor=0.9),
    "yarn, factor from lengths": dict(factor=None, original_max_position_embeddings=64),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),
}


@pytest.mark.parametrize("case", _ROPE_CASES)
def test_rope_frequencies_and_scale_equal_transformers(case):
    """Bit for bit: the inverse frequencies and the cos/sin factor of transformers' rotary embedding
    (as built, i.e. for positions below max_position_embeddings)."""
    rope_type = case.partition(",")[0]
    rope = dict(rope_type=rope_type, rope_theta=1_000_000.0 if "betas" in case else 10000.0, **_ROPE_CASES[case])
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rope)
    theirs = LlamaRotaryEmbedding(config)
    params = rope_parameters(config)
    assert torch.equal(inverse_frequencies(16, params), theirs.inv_freq)
    assert cos_sin_scale(params) == theirs.attention_scaling
    ours = RotaryEmbedding(16, 256, params)
    positions = torch.arange(256)[None]
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(ours.cos_sin_cache, torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1))


def test_rope_position_zero_is_identity_and_norm_preserving():
    rope = RotaryEmbedding(8, 16, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(3, 16), torch.randn(3, 8)
    q_rot, k_rot = rope(torch.tensor([0, 5, 15]), q, k)
    torch.testing.assert_close(q_rot[0], q[0])
    torch.testing.assert_close(q_rot.view(3, 2, 8).norm(dim=-1), q.view(3, 2, 8).norm(dim=-1))
    assert k_rot.shape == k.shape


# --- loader ---------------------------------------------------------------------------------------


def test_registry_maps_each_architecture():
    pairs = [
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
    ]
    for family, architecture in pairs:
        assert get_model_class(tiny_config(family, architectures=[architecture])).__name__ == architecture
    assert set(SUPPORTED_ARCHITECTURES) == {architecture for _, architecture in pairs}


def test_resolve_model_path(tmp_path, model_dirs):
    assert resolve_model_path(str(model_dirs["llama"])) == model_dirs["llama"]
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_resolve_hub_id_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="model='no-org/no-such-model' does not exist"):
        resolve_model_path("no-org/no-such-model")


def test_config_required(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        load_hf_config(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyForCausalLM") as error:
        load_ours(path, "reference")
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "family, dropped",
    [
        ("llama", "model.layers.1.self_attn.k_proj.weight"),  # one piece of a fused qkv_proj
        ("llama_untied", "lm_head.weight"),
        ("qwen2", "model.layers.1.self_attn.v_proj.bias"),
        ("qwen3", "model.layers.0.self_attn.q_norm.weight"),
    ],
)
def test_missing_weight_is_named(tmp_path, family, dropped):
    path = make_tiny_model(family, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        load_ours(path, "reference")


def test_no_weights_at_all(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_ours(path, "reference")


def test_sharded_checkpoint_loads(tmp_path, model_dirs):
    path = make_tiny_model("qwen3_sliding", tmp_path, max_shard_size="64KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    sharded, single = load_ours(path, "reference"), load_ours(model_dirs["qwen3_sliding"], "reference")
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(plain(a), plain(b)), name


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor (on CPU, linear layers hold oneDNN's layout of theirs)."""
    return tensor.to_dense() if tensor.is_mkldnn else tensor


# --- contexts past max_position_embeddings ---------------------------------------------------------


@pytest.mark.parametrize(
    "family, overrides, limit",
    [
        ("llama_rope_linear", dict(max_position_embeddings=32), 128),  # 32 positions stretched 4x
        ("qwen2_rope_yarn", dict(max_position_embeddings=64), 256),  # 4x its pretraining length of 64
        ("llama_rope_dynamic", dict(max_position_embeddings=32), 32),  # no longer context: see _dynamic_ntk
    ],
)
def test_rope_scaling_serves_the_context_vllm_derives(tmp_path, family, overrides, limit):
    """linear and YaRN serve ``factor`` times the pretraining context, greedy tokens equal to
    transformers' past max_position_embeddings; dynamic NTK ends at max_position_embeddings."""
    path = make_tiny_model(family, tmp_path, **overrides)
    with LLM(model=str(path), device="cpu", attention_backend="sdpa", block_size=8) as llm:
        assert llm.engine.max_model_len == limit
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} is not allowed"):
        LLM(model=str(path), device="cpu", max_model_len=limit + 1)
    if limit == overrides["max_position_embeddings"]:
        return
    prompt = prompts_for(seed=4, lengths=(limit - 30,))[0]  # prompt and output run past the original length
    reference = load_hf_reference(path)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    with LLM(model=str(path), device="cpu", attention_backend="sdpa", block_size=8) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected.tolist()
