"""ModelConfig refuses sizes no model can have, with a ValueError naming the field."""
import re

import pytest

from minitron.model import ModelConfig


@pytest.mark.parametrize("field,value", [("n_heads", 0), ("hidden", -64), ("seq_len", 0),
                                         ("vocab_size", 0), ("n_layers", 0), ("n_kv_heads", 0),
                                         ("ffn_hidden", 0), ("hidden", 64.0), ("n_heads", True)])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} must be a positive integer")) as e:
        ModelConfig(**{field: value})
    assert f"(ModelConfig.{field}); use {field}=" in str(e.value)   # the field, and a value that works


def test_optional_sizes_default_from_the_others():
    cfg = ModelConfig(hidden=32, n_heads=4, n_kv_heads=None, ffn_hidden=None)
    assert (cfg.kv_heads, cfg.ffn) == (4, 128)
