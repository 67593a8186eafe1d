"""Maps an attention backend's name to the module that implements it, imported when first asked for.

A backend whose optional dependency is not installed is unavailable: choosing it is refused with the
module it lacks, and ``backends_supporting`` leaves it out. Any other import error is a broken module
and propagates.
"""

from __future__ import annotations

import importlib

from micro_vllm.attention.backends.abstract import AttentionBackend

# name -> (module, class, the optional dependency it needs or None)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "reference": ("micro_vllm.attention.backends.reference", "ReferenceBackend", None),
    "sdpa": ("micro_vllm.attention.backends.sdpa", "SdpaBackend", None),
    "triton": ("micro_vllm.attention.backends.triton_attn", "TritonBackend", "triton"),
}


class BackendUnavailableError(ValueError):
    """The chosen backend needs a module that is not installed."""


def get_backend_cls(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not supported; choose one of {sorted(_BACKENDS)}")
    module_name, class_name, dependency = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if dependency is None or error.name != dependency:
            raise
        raise BackendUnavailableError(
            f"attention_backend={name!r} needs the module {dependency!r}, which is not installed; install it "
            f"or choose one of {sorted(n for n, entry in _BACKENDS.items() if entry[2] is None)}"
        ) from error
    return getattr(module, class_name)


def backends_supporting(head_size: int) -> list[str]:
    """The names of the available backends that serve heads of ``head_size`` channels."""
    names = []
    for name in _BACKENDS:
        try:
            backend = get_backend_cls(name)
        except BackendUnavailableError:
            continue
        if backend.supports_head_size(head_size):
            names.append(name)
    return sorted(names)
