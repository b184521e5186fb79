import pytest

from tests.engine.tiny_models import write_tiny_model

MOE_ARCHS = ("qwen3_moe", "qwen3_moe_step2", "qwen2_moe")


@pytest.fixture(scope="session")
def moe_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe_models")
    return {arch: write_tiny_model(arch, root / arch) for arch in MOE_ARCHS}
