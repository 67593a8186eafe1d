"""The servers that several tests here use, by fixture: ``tiny_chat_server`` (the tiny chat model,
shared by four modules: ``helpers.server.TinyChatServer`` says which and with what flags) and
``one_slot_server`` (test_server.py's, whose last test kills its engine).

A start-up costs seconds of imports and loading, in the server's process and then in its engine's,
on one core: the servers the run's tests use start together, at the first test that needs one, and
that test waits until both answer. They stay up to the end of the run (an idle server costs no CPU,
and each holds about 0.6 GB). The default model's server (test_server_default_model.py) is not one
of them: its engine holds 1.5 GB, which the run should not hold beside the others for longer than
its module."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.server import TINY_CHAT_SERVER, ServerProcess, make_tiny_chat_model, serve_processes
from helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


def one_slot_command(directory: Path) -> list[str]:
    """A server that runs one request at a time, with a long context."""
    model = make_tiny_model("llama", directory, max_position_embeddings=4096)
    return [str(model), "--max-model-len", "4096", "--max-num-seqs", "1", "--max-num-batched-tokens", "256",
            "--block-size", "16"]


@pytest.fixture(scope="session")
def servers(request, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """The servers the run's tests use, by fixture name."""
    used = {name for item in request.session.items for name in item.fixturenames}
    commands = {}
    if "tiny_chat_server" in used:
        commands["tiny_chat_server"] = [str(request.getfixturevalue("tiny_chat_model")), *TINY_CHAT_SERVER.flags()]
    if "one_slot_server" in used:
        commands["one_slot_server"] = one_slot_command(tmp_path_factory.mktemp("one_slot"))
    with serve_processes(commands) as started:
        yield started


@pytest.fixture(scope="session")
def tiny_chat_server(servers) -> ServerProcess:
    return servers["tiny_chat_server"]


@pytest.fixture(scope="session")
def one_slot_server(servers) -> ServerProcess:
    return servers["one_slot_server"]
