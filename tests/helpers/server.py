"""Real ``micro-vllm serve`` processes for tests: each started on a free port, waited for until /health
answers, stopped at the end; its log is kept for the test to read."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from helpers.tiny_models import make_tiny_model

# A minimal chat template for tiny test models, whose byte-level tokenizer has none: a line per
# message, and (short: the tiny model takes 256 tokens, one a byte) a line naming the tools when a
# request has some, and the tool calls of assistant messages. A line's newline is an expression:
# transformers renders templates with trim_blocks, which drops a newline that follows a block tag.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}<s>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %} calls {{ c['function']['name'] }}{{ c['function']['arguments'] | tojson }}"
    "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tiny_chat_model(directory: Path) -> Path:
    """A tiny llama (``helpers.tiny_models``) whose tokenizer has ``TINY_CHAT_TEMPLATE``."""
    path = make_tiny_model("llama", directory)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@dataclasses.dataclass(frozen=True)
class TinyChatServer:
    """The settings of the tiny chat model's server that test_server.py, test_server_vllm_fields.py,
    test_bad_requests.py and test_tool_calling.py share (the ``tiny_chat_server`` fixture of
    tests/entrypoints/conftest.py: one start-up, not four); each module's tests rely on some of them.
    Its other flags: ``--enable-auto-tool-choice --tool-call-parser hermes --max-num-seqs 16
    --max-num-batched-tokens 256 --block-size 8 --enable-log-requests``."""

    served_model_name: str = "tiny"
    api_key: str = "test-key"
    max_model_len: int = 256  # all the tiny model takes: the tool-calling prompts need it
    max_logprobs: int = 10  # not the default (20), so that the flag is seen to work
    max_request_body_bytes: int = 4_000_000
    max_log_len: int = 12

    def flags(self) -> list[str]:
        return ["--served-model-name", self.served_model_name, "--api-key", self.api_key,
                "--max-model-len", str(self.max_model_len), "--max-logprobs", str(self.max_logprobs),
                "--max-request-body-bytes", str(self.max_request_body_bytes), "--enable-log-requests",
                "--max-log-len", str(self.max_log_len), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--block-size", "8"]


TINY_CHAT_SERVER = TinyChatServer()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: typing.IO[str]  # what the server wrote to stdout and stderr

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


@contextlib.contextmanager
def serve_process(model: str, *args: str, startup_timeout: float = 180.0) -> Iterator[ServerProcess]:
    """Run ``micro-vllm serve MODEL ARGS`` on CPU until the block ends; yield it once /health answers."""
    with serve_processes({"server": [model, *args]}, startup_timeout) as servers:
        yield servers["server"]


@contextlib.contextmanager
def serve_processes(commands: dict[str, list[str]],
                    startup_timeout: float = 180.0) -> Iterator[dict[str, ServerProcess]]:
    """``serve_process`` for several servers, by name (each ``[model, *args]``), started together and
    yielded once every one answers /health: a start-up is seconds of imports and loading on one core
    (the server's, then its engine's), so side by side two take about the time of one on two cores."""
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(_started(*command)) for name, command in commands.items()}
        for server in servers.values():
            _wait_until_healthy(server, startup_timeout)
        yield servers


@contextlib.contextmanager
def _started(model: str, *args: str) -> Iterator[ServerProcess]:
    port = free_port()
    command = [sys.executable, "-m", "micro_vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--disable-uvicorn-access-log", *args]
    # One torch thread: the server's steps are tiny and the test machine is small and shared.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield ServerProcess(f"http://127.0.0.1:{port}", process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_until_healthy(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n{server.output()[-5000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{server.output()[-5000:]}")


def sse_data(texts: Iterable[str]) -> Iterator[str]:
    """The data of each server-sent event in a stream's text, given in pieces, with its lines split as
    the format splits them: at CR, LF or CRLF only. A JSON string in an event may hold U+2028 or U+0085
    unescaped, where ``str.splitlines`` (and httpx's ``iter_lines``) would split it too."""
    pending = ""
    for text in texts:
        *lines, pending = re.split(r"\r\n|\r|\n", pending + text)
        yield from (line.removeprefix("data: ") for line in lines if line.startswith("data: "))
    if pending.startswith("data: "):
        yield pending.removeprefix("data: ")


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text: the first of ``name`` that has ``labels``."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} with {labels} is not in the metrics")


def spawned_by(pid: int) -> list[int]:
    """The processes that ``pid`` started through multiprocessing (not its resource tracker)."""
    return [child for child in children(pid) if b"spawn_main" in command_line(child)]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


def command_line(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()
