"""The fused Triton ops (layers/triton_ops.py) against their PyTorch twins in layers/ (each CustomOp's
forward_native), on fresh random inputs each run, and ``custom_ops`` choosing between the two.

Each test draws its seed from os.urandom (printed, so a failure shows it; set MICRO_VLLM_TEST_SEED
to replay one). On CPU the kernels run under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1), so shapes stay small; the gpu-marked tests repeat the comparison at real sizes,
replay the ops in a CUDA graph, and run a tiny Qwen3 through both paths.

What "matches" means: PyTorch rounds each elementwise op's fp32 result to the tensor's dtype and the
kernels round at the same points, so rotary embedding and the residual sum are bit-exact in every
dtype. Two things may still move a result by one ulp: the order of RMSNorm's fp32 variance sum, and,
on CPU only, numpy's exp against PyTorch's inside SiLU; the final multiply (by the norm weight, by
the up projection) can stretch that ulp to two. So fp32 is held within 1e-6, and fp16/bf16 within
two ulps with at most 0.1% of the elements (plus two) off at all.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from helpers.paged_run import bind_backend, layer_metadata
from helpers.tiny_models import make_tiny_model

pytest.importorskip("triton")

from micro_vllm import LLM, SamplingParams  # noqa: E402
from micro_vllm.attention.backends.abstract import CommonAttentionMetadata  # noqa: E402
from micro_vllm.config import CUSTOM_OPS  # noqa: E402
from micro_vllm import triton_utils  # noqa: E402
from micro_vllm.layers import custom_op, triton_ops  # noqa: E402
from micro_vllm.layers.activation import SiluAndMul  # noqa: E402
from micro_vllm.layers.custom_op import resolve_custom_ops, set_custom_ops  # noqa: E402
from micro_vllm.layers.norm import QKNorm, RMSNorm  # noqa: E402
from micro_vllm.layers.qk_norm_rope import QKNormRoPE  # noqa: E402
from micro_vllm.layers.rotary import RotaryEmbedding  # noqa: E402
from micro_vllm.model_loader.checkpoint import load_hf_config, load_model  # noqa: E402
from micro_vllm.sampling import triton_sampler  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=1024,  # below max_position, so all three bands are in use
)
MAX_POSITION = 4096


@pytest.fixture(autouse=True)
def seed() -> int:
    seed = int(os.environ.get("MICRO_VLLM_TEST_SEED", 0)) or int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed} (replay with MICRO_VLLM_TEST_SEED={seed})")
    torch.manual_seed(seed)
    return seed


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the rare ulps the module docstring allows."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    finfo = torch.finfo(want.dtype)
    # An ulp of a normal number x is at most eps * |x|; atol covers the subnormal range.
    torch.testing.assert_close(got, want, rtol=2 * finfo.eps, atol=2 * finfo.smallest_normal * finfo.eps)
    assert_rare_ulps(got, want)


def assert_rare_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """The rare ulp is allowed, a systematic one (say, truncating instead of rounding: about half of
    every row) is not. Counted per row: a row's scalar (its RMS) an fp32 ulp off moves the few of
    its elements that sit at a rounding edge, up to 4 of 1,024 in 3,200 fp16 rows drawn as the
    tests draw them (seeds 0 to 399, 2026-11-30)."""
    off = (got != want).reshape(-1, want.shape[-1]).sum(dim=1)
    assert (off <= 4 + want.shape[-1] // 100).all(), f"{off.max()} of a row's {want.shape[-1]} elements differ"


def assert_rotation_matches(got: torch.Tensor, want: torch.Tensor, rotated: torch.Tensor, head_size: int) -> None:
    """Rotary embedding of inputs that may differ by the rare ulp (the fused q/k norm's, as above).
    Rotation sums each element with its partner's product, so where the two nearly cancel, an ulp of
    the inputs is many ulps of the result: the difference is held to two ulps of the largest of the
    head's ``rotated`` inputs, and to rare elements at all."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    heads = rotated.reshape(*rotated.shape[:-1], -1, head_size)
    bound = 2 * torch.finfo(want.dtype).eps * heads.abs().amax(dim=-1, keepdim=True).float()
    diff = (got.float() - want.float()).reshape(heads.shape)
    assert (diff.abs() <= bound).all(), f"off by up to {(diff.abs() / bound).max():.1f}x two ulps of the head's inputs"
    assert_rare_ulps(got, want)


def random_norm(hidden: int, dtype: torch.dtype, device: str = "cpu") -> RMSNorm:
    layer = RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    layer.weight.data.uniform_(0.5, 1.5)
    return layer


def fused_qkv(
    tokens: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the column slices of one qkv projection output, as the model passes them."""
    qkv = 2 * torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
    q, k, _ = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return q, k


@contextlib.contextmanager
def counted_kernel_calls() -> Iterator[Counter]:
    """Count the calls into ``triton_ops`` and the Triton sampler: where both paths are bit-exact,
    equal outputs alone cannot tell that the layers took the kernels."""
    calls: Counter = Counter()
    with pytest.MonkeyPatch.context() as patch:
        for module, name, op in [*((triton_ops, name, name) for name in CUSTOM_OPS if name != "sampler"),
                                 (triton_sampler, "sample", "sampler")]:
            def spy(*args, _kernel=getattr(module, name), _op=op, **kwargs):
                calls[_op] += 1
                return _kernel(*args, **kwargs)
            patch.setattr(module, name, spy)
        yield calls


class EveryLayerOp:
    """Each layer op once, on random inputs: RMSNorm alone and with the residual, the q/k norm,
    rotary embedding, the two fused, and SiLU-and-mul."""

    KERNEL_CALLS = {"rms_norm": 2, "qk_norm": 1, "rotary_embedding": 1, "fused_qk_norm_rope": 1, "silu_and_mul": 1}

    def __init__(self, tokens: int, hidden: int, heads: int, kv_heads: int, head_size: int, intermediate: int,
                 dtype: torch.dtype, device: str) -> None:
        self.layer = random_norm(hidden, dtype, device)
        self.qk_norm = QKNorm(random_norm(head_size, dtype, device), random_norm(head_size, dtype, device))
        self.rope = RotaryEmbedding(head_size, MAX_POSITION, LLAMA3_ROPE).to(device)
        self.qk_norm_rope = QKNormRoPE(self.qk_norm, self.rope)
        self.act = SiluAndMul()
        self.x, self.residual = 3 * torch.randn(2, tokens, hidden, dtype=dtype, device=device)
        self.q, self.k = fused_qkv(tokens, heads, kv_heads, head_size, dtype, device)
        self.positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
        self.gate_up = 4 * torch.randn(tokens, 2 * intermediate, dtype=dtype, device=device)

    def use(self, enabled: set[str]) -> None:
        set_custom_ops(torch.nn.ModuleList([self.layer, self.qk_norm, self.rope, self.qk_norm_rope, self.act]), enabled)

    def outputs(self) -> list[torch.Tensor]:
        return [
            self.layer(self.x),
            *self.layer(self.x, self.residual),
            *self.qk_norm(self.q, self.k),
            *self.rope(self.positions, self.q, self.k),
            *self.qk_norm_rope(self.positions, self.q, self.k),
            self.act(self.gate_up),
        ]

    def check(self, fused_outputs: list[torch.Tensor], pytorch_outputs: list[torch.Tensor]) -> None:
        for index, (got, want) in enumerate(zip(fused_outputs, pytorch_outputs, strict=True)):
            if index in (2, 5, 6):  # the residual sum and rotary embedding: bit-exact
                assert torch.equal(got, want)
            elif index in (7, 8):  # the q/k norm and rotary embedding fused: the normed q or k, rotated
                assert_rotation_matches(got, want, pytorch_outputs[index - 4], self.rope.head_size)
            else:
                assert_matches(got, want)


# --- CPU, under the interpreter -------------------------------------------------------------------


# 576, 896 and 960: hidden sizes of real checkpoints that are not powers of two (the kernels pad).
@pytest.mark.parametrize("hidden, tokens", [(64, 33), (1000, 7), (1024, 1), (576, 5), (896, 3), (960, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    layer = random_norm(hidden, dtype)
    x, residual = 3 * torch.randn(2, tokens, hidden, dtype=dtype)
    assert_matches(triton_ops.rms_norm(x, layer.weight, layer.eps), layer(x))

    out, new_residual = triton_ops.rms_norm(x, layer.weight, layer.eps, residual)
    want_out, want_residual = layer(x, residual)
    assert torch.equal(new_residual, want_residual)
    assert_matches(out, want_out)


def test_rms_norm_promotes_to_the_weight_dtype() -> None:
    layer = random_norm(64, torch.float32)  # an fp32 weight on bf16 activations: fp32 out, as in PyTorch
    x, residual = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    out, new_residual = triton_ops.rms_norm(x, layer.weight, layer.eps, residual)
    want_out, want_residual = layer(x, residual)
    assert out.dtype == torch.float32 and new_residual.dtype == torch.bfloat16
    assert torch.equal(new_residual, want_residual)
    assert_matches(out, want_out)


@pytest.mark.parametrize("head_size, tokens", [(64, 7), (128, 33), (80, 5), (12, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_views(dtype: torch.dtype, head_size: int, tokens: int) -> None:
    """3-D input, normalized without a copy: rows are (token, head) pairs of a column slice of a
    fused qkv output."""
    layer = random_norm(head_size, dtype)
    q, k = fused_qkv(tokens, 4, 2, head_size, dtype)
    for flat in (q, k):
        heads = flat.unflatten(-1, (-1, head_size))
        assert not heads.is_contiguous()
        before = heads.clone()
        assert_matches(triton_ops.rms_norm(heads, layer.weight, layer.eps), layer.forward_native(heads))
        assert torch.equal(heads, before)


@pytest.mark.parametrize("head_size, tokens", [(64, 9), (128, 33), (96, 4), (12, 5), (20, 3), (80, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm(dtype: torch.dtype, head_size: int, tokens: int) -> None:
    """Qwen3's per-head q/k norm in one launch, on column slices of the fused qkv output, against
    each head through its own RMSNorm."""
    op = QKNorm(random_norm(head_size, dtype), random_norm(head_size, dtype))
    q, k = fused_qkv(tokens, 4, 2, head_size, dtype)
    before = q.clone(), k.clone()
    got = op.forward_triton(q, k)
    for got_part, want_part in zip(got, op.forward_native(q, k), strict=True):
        assert got_part.is_contiguous()
        assert_matches(got_part, want_part)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize(
    "head_size, tokens, rope",
    [(64, 33, LLAMA3_ROPE), (128, 7, LLAMA3_ROPE), (128, 1, dict(rope_type="default", rope_theta=1e6)),
     (12, 5, LLAMA3_ROPE), (20, 3, LLAMA3_ROPE), (80, 4, dict(rope_type="default", rope_theta=1e6))],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(dtype: torch.dtype, head_size: int, tokens: int, rope: dict) -> None:
    layer = RotaryEmbedding(head_size, MAX_POSITION, rope)
    q, k = fused_qkv(tokens, 4, 2, head_size, dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,))  # unordered, repeats allowed
    before = q.clone(), k.clone()
    got = triton_ops.rotary_embedding(positions, q, k, layer.cos_sin_cache, head_size)
    want = layer(positions, q, k)
    for got_part, want_part in zip(got, want, strict=True):
        assert got_part.is_contiguous()
        assert torch.equal(got_part, want_part)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_rotary_embedding_head_size_not_a_power_of_two() -> None:
    layer = RotaryEmbedding(96, MAX_POSITION, LLAMA3_ROPE)
    q, k = fused_qkv(5, 3, 1, 96, torch.bfloat16)
    positions = torch.randint(0, MAX_POSITION, (5,))
    got = triton_ops.rotary_embedding(positions, q, k, layer.cos_sin_cache, 96)
    for got_part, want_part in zip(got, layer(positions, q, k), strict=True):
        assert torch.equal(got_part, want_part)


# Head sizes with padded halves (80, 96, 12) and head counts that are not powers of two.
@pytest.mark.parametrize("head_size, heads, kv_heads, tokens", [(128, 4, 2, 3), (80, 3, 1, 2), (96, 5, 3, 2), (12, 6, 2, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_norm_rope(dtype: torch.dtype, head_size: int, heads: int, kv_heads: int, tokens: int) -> None:
    """The q/k norm and rotary embedding in one launch, on column slices of the fused qkv output,
    against the two ops' PyTorch code one after the other, and against their two kernels."""
    qk_norm = QKNorm(random_norm(head_size, dtype), random_norm(head_size, dtype))
    rope = RotaryEmbedding(head_size, MAX_POSITION, LLAMA3_ROPE)
    q, k = fused_qkv(tokens, heads, kv_heads, head_size, dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,))
    before = q.clone(), k.clone()
    got = QKNormRoPE(qk_norm, rope).forward_triton(positions, q, k)
    normed = qk_norm.forward_native(q, k)
    want = rope.forward_native(positions, *normed)
    two_kernels = rope.forward_triton(positions, *qk_norm.forward_triton(q, k))
    for got_part, want_part, two_kernels_part, normed_part in zip(got, want, two_kernels, normed, strict=True):
        assert got_part.is_contiguous()
        assert_rotation_matches(got_part, want_part, normed_part, head_size)
        # The same rounding as the two kernels; a power-of-two head is even the q/k norm kernel's own
        # tile, whose variance the interpreter sums in the same order.
        if head_size & (head_size - 1) == 0:
            assert torch.equal(got_part, two_kernels_part)
        else:
            assert_rotation_matches(got_part, two_kernels_part, normed_part, head_size)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize(
    "shape", [(33, 2 * 1000), (7, 2 * 1536), (1, 2 * 64), (2, 5, 2 * 64), (3, 2 * 576), (2, 2 * 896), (1, 2 * 960)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # Scaled so the gate reaches the saturated ends of SiLU as well as its bend.
    gate_up = 4 * torch.randn(shape, dtype=dtype)
    assert_matches(triton_ops.silu_and_mul(gate_up), SiluAndMul()(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_dispatch_each_op_to_its_kernel(dtype: torch.dtype) -> None:
    """The layers' own dispatch, set to the kernels on CPU as it is by default on CUDA: one kernel
    call per op, and the PyTorch code's results."""
    ops = EveryLayerOp(9, 64, 4, 2, 32, 96, dtype, "cpu")
    with counted_kernel_calls() as calls:
        pytorch_outputs = ops.outputs()
        assert not calls  # a CustomOp runs its PyTorch code until told otherwise
        ops.use(set(CUSTOM_OPS))
        fused_outputs = ops.outputs()
    assert calls == EveryLayerOp.KERNEL_CALLS
    ops.check(fused_outputs, pytorch_outputs)


@pytest.mark.parametrize(
    "custom_ops, kernels",
    [(["none"], set()), (["all"], set(CUSTOM_OPS) - {"qk_norm", "rotary_embedding"}),
     (["all", "-fused_qk_norm_rope"], set(CUSTOM_OPS) - {"fused_qk_norm_rope"}),
     (["none", "+qk_norm", "+sampler"], {"qk_norm", "sampler"}),
     (["all", "-rotary_embedding"], set(CUSTOM_OPS) - {"rotary_embedding", "fused_qk_norm_rope"}), (None, set())],
)
def test_custom_ops_setting_reaches_every_layer(tmp_path, custom_ops: list[str] | None, kernels: set[str]) -> None:
    """``LLM(custom_ops=...)`` decides, once, which ops of the model and which sampler route run Triton
    (here under the interpreter): exactly the enabled ones are called, each in every layer, and the
    default on CPU is the PyTorch code throughout. Where the fused q/k norm and RoPE runs, the two
    kernels it replaces do not; where it is off, either runs alone."""
    path = make_tiny_model("qwen3", tmp_path)
    with counted_kernel_calls() as calls:
        with LLM(model=str(path), device="cpu", custom_ops=custom_ops, num_blocks=16, max_model_len=64) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=1.0, seed=0), use_tqdm=False)
    assert set(calls) == kernels
    steps, layers = 2, 2  # a prefill and a decode, each through the tiny model's two decoder layers
    per_layer = ("qk_norm", "rotary_embedding", "fused_qk_norm_rope", "silu_and_mul")
    for op, per_step in (*((op, layers) for op in per_layer), ("sampler", 1)):
        assert calls[op] == (steps * per_step if op in kernels else 0), op


@pytest.mark.parametrize(
    "device, custom_ops, enabled",
    [("cuda", None, set(CUSTOM_OPS)), ("cuda", ["-sampler"], set(CUSTOM_OPS) - {"sampler"}),
     ("cuda", ["none", "+rms_norm"], {"rms_norm"}), ("cuda", ["none"], set()), ("cpu", None, set()),
     ("cpu", ["-rms_norm"], set()), ("cpu", ["+silu_and_mul"], {"silu_and_mul"}), ("cpu", ["all"], set(CUSTOM_OPS)),
     ("cuda", ["-qk_norm"], set(CUSTOM_OPS) - {"qk_norm", "fused_qk_norm_rope"}),
     ("cuda", ["none", "+qk_norm", "+rotary_embedding"], {"qk_norm", "rotary_embedding"}),
     ("cpu", ["+qk_norm", "+rotary_embedding", "+fused_qk_norm_rope"], {"qk_norm", "rotary_embedding", "fused_qk_norm_rope"})],
)
def test_custom_ops_resolve_per_device(device: str, custom_ops: list[str] | None, enabled: set[str]) -> None:
    """The default is every op on CUDA and none elsewhere; "all" or "none" replaces it, then "+op"
    and "-op" add and remove (the CPU cases run under the interpreter that conftest turns on). The
    fused q/k norm and RoPE is on only where both ops it fuses are."""
    assert resolve_custom_ops(custom_ops, torch.device(device)) == enabled


def test_a_fusion_enabled_without_the_ops_it_fuses_is_refused() -> None:
    with pytest.raises(ValueError, match=r"custom_ops=\['none', '\+qk_norm', '\+fused_qk_norm_rope'\] enables "
                                         r"'fused_qk_norm_rope' without all of \['qk_norm', 'rotary_embedding'\]"):
        resolve_custom_ops(["none", "+qk_norm", "+fused_qk_norm_rope"], torch.device("cuda"))


def test_triton_ops_on_cpu_without_the_interpreter_are_refused(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"custom_ops=\['\+sampler'\] \(enabling \['sampler'\]\) .*TRITON_INTERPRET=1"):
        resolve_custom_ops(["+sampler"], torch.device("cpu"))
    assert resolve_custom_ops(None, torch.device("cpu")) == set()


def test_without_triton_no_op_is_enabled_by_default_and_none_can_be(monkeypatch) -> None:
    monkeypatch.setattr(custom_op, "HAS_TRITON", False)
    monkeypatch.setattr(triton_utils, "HAS_TRITON", False)
    assert resolve_custom_ops(None, torch.device("cuda")) == set()
    with pytest.raises(ValueError, match="needs Triton, which is not installed"):
        resolve_custom_ops(["all"], torch.device("cuda"))


def test_empty_batch() -> None:
    layer, rope = random_norm(64, torch.bfloat16), RotaryEmbedding(64, 16, LLAMA3_ROPE)
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    out, new_residual = triton_ops.rms_norm(x, layer.weight, layer.eps, x)
    assert out.shape == new_residual.shape == (0, 64)
    q, k = fused_qkv(0, 2, 1, 64, torch.bfloat16)
    no_positions = torch.empty(0, dtype=torch.long)
    q_out, k_out = triton_ops.rotary_embedding(no_positions, q, k, rope.cos_sin_cache, 64)
    assert q_out.shape == (0, 128) and k_out.shape == (0, 64)
    head_norm = (layer.weight, layer.eps)
    q_out, k_out = triton_ops.fused_qk_norm_rope(no_positions, q, k, head_norm, head_norm, rope.cos_sin_cache, 64)
    assert q_out.shape == (0, 128) and k_out.shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)


# --- CUDA -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCuda:
    """Real sizes (Qwen3-0.6B's widths, 256 decode tokens), bf16, through the layers' own dispatch."""

    TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_SIZE, INTERMEDIATE = 256, 1024, 16, 8, 128, 3072

    def test_layers_take_the_triton_path_and_match_pytorch(self) -> None:
        ops = EveryLayerOp(self.TOKENS, self.HIDDEN, self.HEADS, self.KV_HEADS, self.HEAD_SIZE, self.INTERMEDIATE,
                           torch.bfloat16, "cuda")
        ops.use(set(CUSTOM_OPS))
        with counted_kernel_calls() as calls:
            fused_outputs = ops.outputs()
        assert calls == EveryLayerOp.KERNEL_CALLS
        ops.use(set())
        pytorch_outputs = ops.outputs()
        ops.check(fused_outputs, pytorch_outputs)

    def test_cuda_graph_replay(self) -> None:
        dtype, device = torch.bfloat16, "cuda"
        layer = random_norm(self.HIDDEN, dtype, device)
        rope = RotaryEmbedding(self.HEAD_SIZE, MAX_POSITION, LLAMA3_ROPE).to(device)
        qk_norm_rope = QKNormRoPE(QKNorm(*(random_norm(self.HEAD_SIZE, dtype, device) for _ in range(2))), rope)
        x, residual = torch.randn(2, self.TOKENS, self.HIDDEN, dtype=dtype, device=device)
        q, k = fused_qkv(self.TOKENS, self.HEADS, self.KV_HEADS, self.HEAD_SIZE, dtype, device)
        positions = torch.randint(0, MAX_POSITION, (self.TOKENS,), device=device)
        gate_up = torch.randn(self.TOKENS, 2 * self.INTERMEDIATE, dtype=dtype, device=device)
        act = SiluAndMul()
        for op in (layer, rope, qk_norm_rope, act):
            op.use_triton(True)

        def run() -> list[torch.Tensor]:
            return [*layer(x, residual), *rope(positions, q, k), *qk_norm_rope(positions, q, k), act(gate_up)]

        run()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        for tensor in (x, residual, q, k, gate_up):
            tensor.copy_(torch.randn_like(tensor))
        positions.copy_(torch.randint_like(positions, MAX_POSITION))
        graph.replay()
        for got, want in zip(captured, run(), strict=True):
            assert torch.equal(got, want)

    def test_tiny_qwen3_forward(self, tmp_path) -> None:
        path = make_tiny_model("qwen3", tmp_path)
        model = bind_backend(load_model(path, load_hf_config(path), torch.bfloat16, torch.device("cuda"), set(CUSTOM_OPS)), "sdpa")
        num_tokens, block_size = 40, 16
        slots = torch.arange(block_size, block_size + num_tokens, device="cuda")  # blocks 1, 2 and 3
        query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc=query_start_loc.cuda(),
            seq_lens=seq_lens.cuda(),
            block_table=torch.tensor([[1, 2, 3]], dtype=torch.int32, device="cuda"),
            slot_mapping=slots,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.randint(0, 256, (num_tokens,), device="cuda")
        positions = torch.arange(num_tokens, device="cuda")

        def forward() -> torch.Tensor:
            for attn in model.attention_layers():
                spec = attn.spec
                shape = (2, 4, block_size, spec.num_kv_heads, spec.head_size)
                attn.kv_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
            with torch.inference_mode():
                return model.compute_logits(model(input_ids, positions, layer_metadata(model, common, block_size)))

        fused = forward()
        set_custom_ops(model, set())
        eager = forward()
        # Bit-equal unless an RMSNorm variance rounds differently somewhere; then bf16 noise follows.
        torch.testing.assert_close(fused, eager, atol=2e-2, rtol=2e-2)
