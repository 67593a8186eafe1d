"""Finds a model's files, reads its Hugging Face config, builds the model and streams in its weights.

Weights come only from ``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``)
and are copied tensor by tensor into a model already built on the device, so peak host memory stays
near one tensor. They are streamed as safetensors slices, from which each parameter's ``weight_loader``
reads only its part: a tensor-parallel rank reads only its slices of the checkpoint
(``weight_utils.py``). ``load_format="dummy"`` (vLLM's) fills the model with random weights instead.
The model's ``generation_config.json`` also gives the default sampling parameters
(``default_sampling_overrides``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from micro_vllm.layers.custom_op import set_custom_ops
from micro_vllm.layers.linear import process_weights_after_loading
from micro_vllm.models.registry import get_model_class

# Enough to build the model and its tokenizer; skips *.bin / *.pt / *.gguf copies of the weights.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
SAFETENSORS_INDEX = "model.safetensors.index.json"

logger = logging.getLogger(__name__)


def resolve_model_path(model: str) -> Path:
    """A local model directory as is; otherwise a Hugging Face Hub id, downloaded (or found cached)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    # Only "name" or "org/name" can be a hub id; anything else was meant as a local path.
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model={model!r} does not exist: no such local directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=model, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as error:  # offline, unknown repo, gated, malformed id: all mean "not found"
        raise ValueError(
            f"model={model!r} does not exist as a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(error).__name__}: {error})"
        ) from error


HFOverrides = dict[str, Any] | Callable[[PretrainedConfig], PretrainedConfig] | None


def load_hf_config(path: Path, hf_overrides: HFOverrides = None) -> PretrainedConfig:
    """The model's Hugging Face config, with vLLM's ``hf_overrides`` applied: a dict's entries set as
    attributes, or a function's returned config."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; is it a Hugging Face model directory?")
    config = AutoConfig.from_pretrained(path)
    if isinstance(hf_overrides, dict):
        config.update(hf_overrides)
    elif hf_overrides is not None:
        config = hf_overrides(config)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"hf_overrides={hf_overrides!r} returned {type(config).__name__}; it must return a "
                            "transformers PretrainedConfig")
    return config


# The generation_config.json fields that vLLM's generation_config="auto" takes as default sampling
# parameters, under their SamplingParams names.
_GENERATION_DEFAULTS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                        "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def default_sampling_overrides(path: Path, generation_config: str) -> dict[str, Any]:
    """The SamplingParams fields the model's creator recommends, as vLLM reads them: from
    ``generation_config.json`` in the model directory ("auto") or in the directory named, none for
    "vllm". Fields the file leaves out (or sets to null) keep SamplingParams' defaults."""
    if generation_config == "vllm":
        return {}
    directory = Path(path) if generation_config == "auto" else Path(generation_config).expanduser()
    if generation_config != "auto" and not directory.is_dir():
        raise ValueError(f"generation_config={generation_config!r} is not allowed; it must be 'auto', 'vllm' or a "
                         "directory holding a generation_config.json")
    file = directory / "generation_config.json"
    if not file.is_file():
        return {}
    values = json.loads(file.read_text())
    return {ours: values[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if values.get(theirs) is not None}


def load_model(
    path: Path,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    custom_ops: frozenset[str] = frozenset(),
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    """Build the model for ``hf_config`` on ``device`` in ``dtype`` and fill it from ``path`` (or, with
    ``load_format="dummy"``, with random weights drawn from ``seed``); the layer ops named in
    ``custom_ops`` (``resolve_custom_ops``) run their Triton kernels, and on CPU the linear layers'
    weights are laid out for oneDNN once loaded."""
    model_class = get_model_class(hf_config)
    files = [] if load_format == "dummy" else safetensors_files(Path(path))
    with torch.device(device), _default_dtype(dtype):
        model = model_class(hf_config)
    set_custom_ops(model, custom_ops)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        _load_checkpoint(model, files)
    process_weights_after_loading(model)
    return model.eval()


# The range vLLM draws its dummy weights from.
_DUMMY_WEIGHT_RANGE = 1e-3


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter uniformly in [-1e-3, 1e-3] from a generator of its own device seeded with
    ``seed``: the same seed on the same kind of device gives the same weights, and torch's global
    random state is not touched."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-_DUMMY_WEIGHT_RANGE, _DUMMY_WEIGHT_RANGE, generator=generators[param.device])


def _load_checkpoint(model: nn.Module, files: list[Path]) -> None:
    """Stream the checkpoint's tensors into the model; every parameter must get its weights."""
    checkpoint_names: dict[str, Path] = {}  # each tensor read so far -> its file, in reading order
    try:
        loaded = model.load_weights(stream_weights(files, checkpoint_names))
    except ValueError as error:  # a tensor the model cannot take (a wrong shape): name it and its file
        if not checkpoint_names:
            raise
        name = next(reversed(checkpoint_names))
        detail = str(error) if name in str(error) else f"{name}: {error}"
        raise ValueError(f"{checkpoint_names[name]}: {detail}") from error
    _check_complete(model, loaded, set(checkpoint_names))


def safetensors_files(path: Path) -> list[Path]:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        absent = [str(file) for file in files if not file.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that do not exist: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    return files


def stream_weights(files: list[Path], seen: dict[str, Path]) -> Iterator[tuple[str, Any]]:
    """Each checkpoint tensor of ``files`` as a safetensors slice (``get_slice``), with its name,
    recording in ``seen`` the file it came from. A slice reads from the file what it is indexed for
    (``slice[:]`` the whole tensor): read it before asking for the next one."""
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    seen[name] = file
                    yield name, reader.get_slice(name)
        except (SafetensorError, OSError) as error:  # errors of the consumer never enter a generator
            raise OSError(f"{file} is not a readable safetensors file: {error}") from error


def _check_complete(model: nn.Module, loaded: set[str], checkpoint_names: set[str]) -> None:
    # A fused parameter counts as loaded after its first piece, so compare the checkpoint tensors
    # each parameter needs with the names the files held.
    stacked = model.stacked_params_mapping
    needed = {
        expected
        for name, _ in model.named_parameters()
        for expected in _checkpoint_names_for(name, stacked)
    }
    missing = sorted(needed - checkpoint_names)
    if missing:
        raise ValueError(f"checkpoint is missing weights the model needs: {', '.join(missing)}")
    unexpected = sorted(name for name in checkpoint_names - needed if not _skipped_on_purpose(model, name))
    if unexpected:  # as transformers does: a checkpoint for a variant of the model still loads
        logger.warning("checkpoint tensors this model has no use for, ignored: %s", ", ".join(unexpected))
    unloaded = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if unloaded:
        raise ValueError(f"the checkpoint's tensors did not reach these parameters: {', '.join(unloaded)}")


def _skipped_on_purpose(model: nn.Module, name: str) -> bool:
    """Tensors a model leaves unread by design: rotary tables it computes itself, and the output
    projection of a model whose logits reuse the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.tied)


def _checkpoint_names_for(param_name: str, stacked: tuple[tuple[str, str, Any], ...]) -> list[str]:
    """The checkpoint tensors that fill a parameter: the pieces stacked into a fused one, or its own name."""
    module_path, _, attr = param_name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    pieces = [piece for fused, piece, _ in stacked if fused == leaf]
    return [f"{parent}.{piece}.{attr}" for piece in pieces] or [param_name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
