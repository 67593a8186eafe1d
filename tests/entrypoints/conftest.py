"""The tiny chat model's server that several modules here share (``helpers.server.TinyChatServer``
says which and with what flags): a server start-up costs seconds of imports and loading, in the
server's process and in its engine's. Session-scoped: started by the first test that needs it,
stopped at the end of the run (an idle server costs no CPU)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.server import TINY_CHAT_SERVER, ServerProcess, make_tiny_chat_model, serve_process


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="session")
def tiny_chat_server(tiny_chat_model) -> Iterator[ServerProcess]:
    with serve_process(str(tiny_chat_model), *TINY_CHAT_SERVER.flags()) as server:
        yield server
