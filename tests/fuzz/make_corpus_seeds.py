"""Write the seed inputs of fuzz_safetensors and fuzz_hf_config into tests/fuzz/corpus_safetensors/
and tests/fuzz/corpus_hf_config/: small .safetensors files made with the safetensors package
(every dtype kiln reads, metadata, an empty file) and config.json files of the architectures
kiln loads, written by transformers' config classes. Without seeds the fuzzers rarely get past
the 8-byte header length or the first JSON key in a 30-second CI run.
Run: /root/.cache/kiln-venv/bin/python tests/fuzz/make_corpus_seeds.py"""
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save
import transformers

HERE = Path(__file__).resolve().parent


def safetensors_seeds():
    out = HERE / "corpus_safetensors"
    out.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    seeds = {
        "f32.safetensors": {"w": r(3, 5)},
        "mixed.safetensors": {"a.weight": r(4, 4).to(torch.bfloat16), "b.bias": r(7).half(),
                              "c": r(2, 3, 2), "ids": torch.arange(6, dtype=torch.int64)},
        "empty.safetensors": {},
        "scalarish.safetensors": {"one": r(1), "zero_rows": torch.zeros(0, 4)},
    }
    for name, tensors in seeds.items():
        meta = {"format": "pt"} if name == "mixed.safetensors" else None
        (out / name).write_bytes(save(tensors, metadata=meta))


def hf_config_seeds():
    out = HERE / "corpus_hf_config"
    out.mkdir(exist_ok=True)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    configs = {
        "llama.json": transformers.LlamaConfig(**small),
        "qwen2.json": transformers.Qwen2Config(**small),
        "qwen3.json": transformers.Qwen3Config(**small, head_dim=16),
        "mistral.json": transformers.MistralConfig(**small, sliding_window=None),
        "llama_rope_scaling.json": transformers.LlamaConfig(
            **small, max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    }
    for name, cfg in configs.items():
        (out / name).write_text(cfg.to_json_string())


if __name__ == "__main__":
    safetensors_seeds()
    hf_config_seeds()
