"""The structured trace: what the engine did, one event at a time.

``events.py`` is the schema (every event and field), ``tracer.py`` records a run (``TraceConfig``,
the sinks, ``Tracer``), and ``tools.py`` reads a trace back for the ``micro-vllm trace`` commands.
"""

from micro_vllm.trace.tracer import TraceConfig, TraceSink

__all__ = ["TraceConfig", "TraceSink"]
