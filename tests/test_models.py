"""GGUF identity and metadata on the real model, and bad files."""

from __future__ import annotations

import hashlib

import pytest

from workers.errors import BadInput
from workers.models import read_model_info


def test_real_model_metadata(model_path, model_info):
    assert model_info.architecture == "llama"
    assert model_info.n_layer == 30
    assert model_info.file_type == "Q4_1"
    assert 130e6 < model_info.n_params < 140e6
    assert model_info.size_bytes == model_path.stat().st_size
    assert model_info.context_length == 8192
    assert model_info.sha256 == hashlib.sha256(model_path.read_bytes()).hexdigest()


def test_missing_file(tmp_path):
    with pytest.raises(BadInput, match="no such model"):
        read_model_info(tmp_path / "missing.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, not a model")
    with pytest.raises(BadInput, match="not a GGUF"):
        read_model_info(path)


def test_truncated_gguf_is_corrupt(tmp_path, model_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(model_path.read_bytes()[:4096])
    with pytest.raises(BadInput, match="corrupt"):
        read_model_info(path)
