"""The errors the engine's process boundary adds (vLLM's names)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an error in a step, its process exited, or shutdown); no request can be
    served any more."""
