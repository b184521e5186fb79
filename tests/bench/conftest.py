import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory):
    """The benchmark's word-level tokenizer (id i <-> "t<i>"), as make_dummy_model_dir.py writes it, small vocab."""
    out = tmp_path_factory.mktemp("wordtok")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(5000)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    return out
