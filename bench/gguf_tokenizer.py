"""A Hugging Face tokenizer directory rebuilt from a GGUF file's own vocabulary (no model hub needed).

The load generators that synthesise prompts (AIPerf, GuideLLM, inference-perf) want a Hugging Face
tokenizer; offline there is none to download, but a GGUF file carries its tokenizer. This rebuilds a
byte-level BPE one (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen) from the file's
tokens and merges, with digits split one by one as SmolLM2's pre-tokenizer does, and writes
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and a minimal
``config.json``. Token counts match llama.cpp's closely enough to size prompts; the referee's output
counts come from the server (``usage``), not from this.

Needs ``gguf`` and ``tokenizers`` (the referee's environment has ``tokenizers``; add ``gguf``):

    /tmp/ref/venv-aiperf/bin/pip install gguf
    /tmp/ref/venv-aiperf/bin/python bench/gguf_tokenizer.py MODEL.gguf /tmp/ref/smollm2-tokenizer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rebuild(gguf_path: str, out: Path) -> None:
    from gguf import GGUFReader  # noqa: PLC0415 - the referee's environment, not the project's
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    reader = GGUFReader(gguf_path)

    def strings(name: str) -> list[str]:
        field = reader.fields[name]
        return [bytes(field.parts[i]).decode() for i in field.data]

    def scalar(name: str) -> int | str:
        field = reader.fields[name]
        value = field.parts[field.data[0]]
        return bytes(value).decode() if field.types[0].name == "STRING" else int(value[0])

    kind = scalar("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SystemExit(f"{gguf_path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is rebuilt")
    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    bos, eos = tokens[scalar("tokenizer.ggml.bos_token_id")], tokens[scalar("tokenizer.ggml.eos_token_id")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": eos,
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(tokens)}))
    print(f"{out}: {len(tokens)} tokens, {len(merges)} merges, pre-tokenizer {scalar('tokenizer.ggml.pre')!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    rebuild(args.gguf, args.out)


if __name__ == "__main__":
    main()
