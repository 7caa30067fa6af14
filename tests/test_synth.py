"""Shape-faithful synthetic GGUFs: a tiny one loads and decodes in llama.cpp; the 8B plan is the real size."""

from __future__ import annotations

import numpy as np
import pytest

from workers.errors import BadInput
from workers.models import ARCH_SHAPES, read_model_info, synth_plan, synthesize

GIB = 1024**3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return synthesize("tiny", "q4_0", model_path, out, seed=1)


def test_tiny_shape_metadata(tiny_model, model_info):
    shape = ARCH_SHAPES["tiny"]
    assert tiny_model.architecture == "llama"
    assert tiny_model.n_layer == shape.n_layer
    assert tiny_model.n_embd == shape.n_embd
    assert (tiny_model.n_ff, tiny_model.n_head, tiny_model.n_head_kv) == (shape.n_ff, shape.n_head, shape.n_head_kv)
    assert not tiny_model.tied_embeddings  # the writer emits output.weight
    assert tiny_model.file_type == "Q4_0"
    assert tiny_model.n_vocab == model_info.n_vocab  # the tokenizer is the real model's
    assert tiny_model.n_params == sum(t.n_elements for t in synth_plan(shape, "q4_0", model_info.n_vocab))


def test_tiny_model_decodes_with_finite_logits(tiny_model):
    from llama_cpp import Llama

    llm = Llama(tiny_model.path, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog")
    llm.eval(tokens)
    logits = np.asarray(llm.scores[: len(tokens)])
    assert logits.shape == (len(tokens), tiny_model.n_vocab)
    assert np.isfinite(logits).all()
    assert logits.std() > 0  # random weights, not zeros: the logits differ between tokens
    llm.close()


def test_llama3_8b_plan_matches_the_real_model():
    """llama.cpp's llama-bench reports Llama-3-8B Q4_0 as 4.33 GiB and 8.03 B parameters."""
    shape = ARCH_SHAPES["llama3-8b"]
    plan = synth_plan(shape, "q4_0")
    assert sum(t.n_elements for t in plan) == 8_030_261_248  # Meta's published count, exactly
    assert sum(t.nbytes for t in plan) / GIB == pytest.approx(4.33, abs=0.005)
    assert sum(t.name.endswith("attn_q.weight") for t in plan) == shape.n_layer
    assert next(t for t in plan if t.name == "output.weight").qtype == "q6_k"  # as llama-quantize does


def test_borrowed_vocabulary_changes_only_the_embedding_and_output(model_info):
    shape = ARCH_SHAPES["llama3-8b"]
    real = sum(t.nbytes for t in synth_plan(shape, "q4_0"))
    borrowed = sum(t.nbytes for t in synth_plan(shape, "q4_0", model_info.n_vocab))
    per_token = shape.n_embd * (18 / 32 + 210 / 256)  # one Q4_0 embedding row + one Q6_K output row
    assert real - borrowed == pytest.approx((shape.n_vocab - model_info.n_vocab) * per_token)


def test_unknown_quant_and_shape_are_bad_input(tmp_path, model_path):
    with pytest.raises(BadInput, match="cannot synthesise"):
        synth_plan(ARCH_SHAPES["tiny"], "q3_k")
    with pytest.raises(BadInput, match="unknown shape"):
        synthesize("gpt5", "q4_0", model_path, tmp_path / "x.gguf")


def test_a_write_that_fails_midway_leaves_nothing(tmp_path, model_path, monkeypatch):
    from workers import models

    real_random_tensor, written = models._random_tensor, []

    def fail_on_the_third(tensor, rng):
        written.append(tensor.name)
        if len(written) == 3:
            raise OSError("disk full")
        return real_random_tensor(tensor, rng)

    monkeypatch.setattr(models, "_random_tensor", fail_on_the_third)
    with pytest.raises(BadInput, match="cannot write .*out.gguf: disk full"):  # one line, not a traceback
        synthesize("tiny", "q4_0", model_path, tmp_path / "out.gguf")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its .part


@pytest.mark.parametrize("quant", ["q4_1", "q8_0", "f16"])
def test_other_quantisations_read_back(tmp_path, model_path, quant):
    info = synthesize("tiny", quant, model_path, tmp_path / f"tiny-{quant}.gguf")
    assert read_model_info(info.path).file_type == quant.upper()


def test_model_synth_command_writes_and_registers(tmp_path, model_path):
    import json

    from click.testing import CliRunner

    from orchestrator.cli import main

    url = f"sqlite:///{tmp_path / 'results.db'}"
    out = tmp_path / "tiny.gguf"
    result = CliRunner().invoke(main, ["model", "synth", "--shape", "tiny", "--vocab-from", str(model_path),
                                       "-o", str(out), "--db", url, "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)[0]
    assert row["path"] == str(out.resolve()) and row["n_layer"] == ARCH_SHAPES["tiny"].n_layer
    listed = json.loads(CliRunner().invoke(main, ["model", "list", "--db", url, "--json"]).output)
    assert [m["sha256"] for m in listed] == [row["sha256"]]
    missing = CliRunner().invoke(main, ["model", "synth", "--shape", "tiny", "--vocab-from",
                                        str(tmp_path / "none.gguf"), "-o", str(tmp_path / "x.gguf"), "--db", url])
    assert missing.exit_code == 2 and "no such model file" in missing.output
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(("shape_name", "architecture"), [("tiny-moe", "qwen3moe"), ("tiny-oss", "gpt-oss")])
def test_a_mixture_of_experts_loads_and_decodes_in_llama_cpp(shape_name, architecture, tmp_path, model_path):
    """Qwen3-MoE's layout (3-D expert tensors, a router, per-head q/k norms) and gpt-oss's (biases,
    attention sinks, sliding windows) are read back with their experts, and llama.cpp runs them."""
    from llama_cpp import Llama

    shape = ARCH_SHAPES[shape_name]
    model = synthesize(shape_name, "q4_0", model_path, tmp_path / f"{shape_name}.gguf", seed=1)
    assert model.architecture == architecture
    assert (model.n_expert, model.n_expert_used, model.n_ff_exp, model.head_dim) == (
        shape.n_expert, shape.n_expert_used, shape.n_ff_exp, shape.head_dim)
    assert model.n_params == sum(t.n_elements for t in synth_plan(shape, "q4_0", model.n_vocab))
    llm = Llama(model.path, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog")
    llm.eval(tokens)
    logits = np.asarray(llm.scores[: len(tokens)])
    assert np.isfinite(logits).all() and logits.std() > 0
    llm.close()


@pytest.mark.parametrize(("name", "published", "active", "outputs"), [
    ("qwen3-14b", 14.8e9, None, 2),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 2),  # Qwen's card: 30.5 B, 3.3 B activated
    ("gpt-oss-20b", 20.9e9, 3.6e9, 1),  # OpenAI's card: 20.9 B, 3.6 B active (the embedding not counted)
])
def test_the_plans_have_the_published_sizes(name, published, active, outputs):
    shape = ARCH_SHAPES[name]
    plan = synth_plan(shape, "q4_0")
    assert sum(t.n_elements for t in plan) == pytest.approx(published, rel=0.005)
    experts = [t for t in plan if t.name.endswith("_exps.weight")]
    assert len(experts) == (3 * shape.n_layer if shape.n_expert else 0)
    assert all(t.experts == shape.n_expert for t in experts)
    if active:
        assert shape.n_layer * shape.active_layer_params + outputs * shape.output_params == pytest.approx(active, rel=0.03)


def test_a_registered_model_resolves_with_its_shape_by_path_name_and_prefix(tmp_path, model_path):
    """The second study of a registered mixture of experts (the H200 run of issue 23: the first
    study registered the file, the second's --fit estimate found no heads) gets its shape from the
    file again, with the stored hash: by path, by name and by sha256 prefix."""
    from orchestrator import registry
    from orchestrator.db import open_database

    db = open_database(f"sqlite:///{tmp_path / 'results.db'}")
    out = tmp_path / "tiny-moe.gguf"
    first = registry.synth(db, "tiny-moe", "q4_0", out, vocab_from=str(model_path), seed=1)
    again = [registry.resolve(db, str(out)), registry.resolve(db, first.name), registry.resolve(db, first.sha256[:8])]
    for info in again:
        assert info == first
        assert info.n_expert == ARCH_SHAPES["tiny-moe"].n_expert and info.n_head
