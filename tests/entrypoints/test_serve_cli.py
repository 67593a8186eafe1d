"""``micro-vllm serve``'s flags reach the engine's config and the server, and its exit status is the
server's (no model is loaded)."""

from micro_vllm.cli import main
from micro_vllm.entrypoints.openai import api_server


def test_serve_flags_reach_the_config(monkeypatch):
    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *args, **kwargs: calls.append((args, kwargs)) or 1)
    assert main(["serve", "some/model", "--port", "9001", "--host", "127.0.0.1", "--api-key", "k",
                 "--served-model-name", "a", "b", "--max-model-len", "512", "--max-num-seqs", "3",
                 "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--dtype", "float32",
                 "--device", "cpu", "--disable-uvicorn-access-log", "--max-request-body-bytes", "1000",
                 "--enable-log-requests", "--max-log-len", "20", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes"]) == 1  # the server's status: its engine died
    [((config, names, host, port, api_key), kwargs)] = calls
    assert (names, host, port, api_key) == (["a", "b"], "127.0.0.1", 9001, "k")
    assert kwargs == {"access_log": False, "max_request_body_bytes": 1000, "enable_log_requests": True,
                      "max_log_len": 20, "tool_parser": "hermes"}
    assert (config.model_config.model, config.model_config.device) == ("some/model", "cpu")
    assert (config.scheduler_config.max_model_len, config.scheduler_config.max_num_seqs) == (512, 3)
    assert config.cache_config.gpu_memory_utilization == 0.5 and not config.cache_config.enable_prefix_caching


def test_a_bad_flag_value_is_an_error_naming_it(capsys):
    assert main(["serve", "some/model", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs=0" in capsys.readouterr().err
    # The server's own limits are checked before the model loads (there is none at some/model).
    assert main(["serve", "some/model", "--max-request-body-bytes", "0", "--device", "cpu"]) == 2
    assert "max_request_body_bytes=0" in capsys.readouterr().err
    assert main(["serve", "some/model", "--max-log-len", "-1", "--device", "cpu"]) == 2
    assert "max_log_len=-1" in capsys.readouterr().err
    assert main(["serve", "some/model", "--enable-auto-tool-choice", "--device", "cpu"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "some/model", "--enable-auto-tool-choice", "--tool-call-parser", "nope",
                 "--device", "cpu"]) == 2
    assert "tool_call_parser='nope' is not allowed; it must be one of ['hermes'," in capsys.readouterr().err
