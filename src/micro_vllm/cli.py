"""The ``micro-vllm`` command: generate text, serve it over HTTP, and read the traces a run writes.

``micro-vllm generate`` runs prompts (``--trace FILE`` records the run); ``micro-vllm serve [MODEL]``
runs the OpenAI-compatible server; ``micro-vllm trace summarize | plot | export FILE`` turn a trace
into figures, a picture, or a Chrome/Perfetto trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from micro_vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from micro_vllm.utils import FlexibleArgumentParser


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    EngineArgs.add_cli_args(p.add_argument_group("engine", "the engine's settings (vLLM's EngineArgs)"))
    p.add_argument("--no-chat", action="store_true", help="send prompts as they are, without the chat template")
    p.add_argument("--trace", metavar="FILE", help="write a JSON-lines trace of every engine step to FILE")
    p.add_argument("--trace-level", choices=["step", "block"], default="step",
                   help="'block' also records every block allocated, freed, cached or evicted")


def _generate(args) -> int:
    from micro_vllm.llm import LLM
    from micro_vllm.sampling.params import SamplingParams
    from micro_vllm.trace import TraceConfig

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.trace = TraceConfig(args.trace, level=args.trace_level) if args.trace else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p)
    with LLM(engine_args.create_engine_config()) as llm:
        tokenizer = llm.tokenizer
        if not args.no_chat and tokenizer is not None and tokenizer.chat_template:
            conversations = [[{"role": "user", "content": p}] for p in args.prompt]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        print(f"prompt: {prompt!r}\noutput: {completion.text!r}  [{completion.finish_reason}, "
              f"{len(completion.token_ids)} tokens]")
    return 0


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over HTTP with OpenAI's API")
    p.add_argument("model_tag", nargs="?", help="model directory or hub id, as --model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY' to /v1 routes")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients use (default: the model argument)")
    AsyncEngineArgs.add_cli_args(p.add_argument_group("engine", "the engine's settings (vLLM's EngineArgs)"))
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log every HTTP request")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="refuse (413) a request body larger than this (default: 16 MiB)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request the engine gets: its prompt, params and prompt token ids")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="log at most this many prompt characters or token ids per request (default: all)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool_choice='auto' (the default with tools): find tool calls in the output with "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", default=None,
                   help="the format of the model's tool calls: 'hermes' (Hermes, Qwen2.5, Qwen3) or 'llama3_json'")


def _serve(args) -> int:
    from micro_vllm.entrypoints.openai.api_server import run_server
    from micro_vllm.model_loader.default_model_download import DEFAULT_MODEL

    args.model = args.model_tag or args.model
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    names = args.served_model_name or [args.model or DEFAULT_MODEL]
    return run_server(config, names, args.host, args.port, args.api_key,
                      access_log=not args.disable_uvicorn_access_log,
                      max_request_body_bytes=args.max_request_body_bytes,
                      enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                      tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)


def _add_trace(subparsers) -> None:
    p = subparsers.add_parser("trace", help="summarize, plot or export a trace written with --trace / LLM(trace=...)")
    actions = p.add_subparsers(dest="trace_command", required=True)
    summarize = actions.add_parser("summarize", help="print the figures of each run in the trace")
    summarize.add_argument("file", help="a JSON-lines trace")
    summarize.add_argument("--json", action="store_true", help="print the figures as JSON, one object per run")
    plot = actions.add_parser("plot", help="draw batch composition, KV use and requests per step (PNG, SVG...)")
    plot.add_argument("file", help="a JSON-lines trace")
    plot.add_argument("-o", "--output", required=True, help="the image to write, e.g. run.png")
    export = actions.add_parser("export", help="write Chrome trace event JSON, to open in Perfetto")
    export.add_argument("file", help="a JSON-lines trace")
    export.add_argument("-o", "--output", required=True, help="the JSON file to write, e.g. trace.json")


def _trace(args) -> int:
    from micro_vllm.trace import tools

    events = tools.read_trace(args.file)
    if args.trace_command == "summarize":
        summaries = tools.summarize(events)
        if args.json:
            print(json.dumps([dataclasses.asdict(s) for s in summaries], indent=2))
        else:
            print("\n\n".join(f"run {i}\n{tools.format_summary(s)}" for i, s in enumerate(summaries)))
    elif args.trace_command == "plot":
        tools.plot(events, args.output)
        print(f"wrote {args.output}")
    else:
        tools.write_chrome_trace(events, args.output)
        print(f"wrote {args.output} (open it at https://ui.perfetto.dev)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = FlexibleArgumentParser(prog="micro-vllm", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_trace(subparsers)
    args = parser.parse_args(argv)
    try:
        return {"generate": _generate, "serve": _serve, "trace": _trace}[args.command](args)
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        print(f"micro-vllm: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
