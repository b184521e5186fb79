import pytest

from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models_tp")
    return {arch: write_tiny_model(arch, root / arch) for arch in ("llama", "qwen3", "gemma3")}
