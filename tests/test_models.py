"""GGUF identity and metadata on the real model, and bad files."""

from __future__ import annotations

import hashlib

import pytest

from workers import simulated
from workers.errors import BadInput
from workers.models import ARCH_SHAPES, SHAPE_DETAILS, ModelInfo, named_model, read_model_info


def test_real_model_metadata(model_path, model_info):
    assert model_info.architecture == "llama"
    assert model_info.n_layer == 30
    assert model_info.file_type == "Q4_1"
    assert 130e6 < model_info.n_params < 140e6
    assert model_info.size_bytes == model_path.stat().st_size
    assert model_info.context_length == 8192
    assert model_info.sha256 == hashlib.sha256(model_path.read_bytes()).hexdigest()
    # the shape is read once, with the identity: SmolLM2-135M's layout (its output shares the embedding)
    assert (model_info.n_ff, model_info.n_head, model_info.n_head_kv) == (1536, 9, 3)
    assert model_info.tied_embeddings and model_info.quant == "q4_1"
    assert model_info.weight_params == pytest.approx(model_info.n_params, rel=0.01)


def test_a_named_shape_is_the_same_record_as_a_file_with_its_views():
    """One record: a sim:// model is a ModelInfo whose identity is its name, whose size and parameter
    count follow from its shape, and which the simulator takes as it is."""
    model = named_model("llama3-8b", "q4_k_m")
    assert isinstance(model, ModelInfo) and model == simulated.sim_model_info("sim://llama3-8b/q4_k_m")
    assert model.sha256 == hashlib.sha256(b"sim://llama3-8b/q4_k_m").hexdigest()
    assert (model.name, model.shape_name, model.quant, model.file_type) == ("llama3-8b-q4_k_m", "llama3-8b",
                                                                           "q4_k_m", "Q4_K_M")
    # Meta's count, less the 266,240 weights of the norms, which the simulator does not stream
    assert model.n_params == model.weight_params == 8_030_261_248 - 266_240
    assert model.size_bytes == int(model.weight_params * 4.89 / 8)
    assert (model.n_layer, model.n_ff, model.n_head_kv) == (ARCH_SHAPES["llama3-8b"].n_layer, 14336, 8)
    assert simulated.predict(simulated.parse_chip("M2 Max/38"), model, simulated.BenchParams(99, 8, 512, 512)).fits


def test_the_model_commands_print_identity_and_size_not_layout_details():
    summary = named_model("llama2-7b", "q4_0").summary()
    assert set(summary) == set(ModelInfo.__dataclass_fields__) - set(SHAPE_DETAILS)
    assert summary["n_layer"] == 32 and summary["n_vocab"] == 32000


def test_an_unknown_file_type_is_simulated_as_q4_0():
    model = named_model("llama2-7b", "q4_0")
    assert ModelInfo(**{**model.to_dict(), "file_type": "IQ2_XXS"}).quant == "q4_0"


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
