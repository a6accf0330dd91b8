"""The tiny fine-tuning case of tests/test_finetune.py and benchmarks/finetune.py: a
text file, a BPE tokenizer trained on it (the ``tokenizers`` library's trainer) and a
tiny random Llama written by ``save_hf_checkpoint`` (bf16 files, norm scales 1), with
the tokenizer's ``</s>`` as the config's ``eos_token_id``."""

from __future__ import annotations

import json

import numpy as np

WORDS = ("the cat sat on the mat . a dog ran to the park . we like to read books . "
         "zero shards the optimizer state over data parallel devices . ").split()


def text(n_words: int, seed: int = 0) -> str:
    """Sentences in order with a few words swapped: learnable, not constant."""
    rng = np.random.default_rng(seed)
    words = [WORDS[i % len(WORDS)] for i in range(n_words)]
    for i in rng.integers(0, n_words, n_words // 20):
        words[i] = WORDS[rng.integers(len(WORDS))]
    return " ".join(words)


def write_case(root, n_words: int = 6000, vocab: int = 64, layers: int = 2,
               hidden: int = 32, dtype="bfloat16"):
    """Writes ``root/data.txt`` and the checkpoint ``root/tiny-llama``; returns
    ``(checkpoint directory, LlamaConfig)``."""
    import jax
    import ml_dtypes
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from zerojax.models import llama

    data = text(n_words)
    (root / "data.txt").write_text(data)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([data], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "</s>"], show_progress=False))
    assert tok.get_vocab_size() <= vocab
    cfg = llama.LlamaConfig(vocab=vocab, seq=32, layers=layers, hidden=hidden, heads=4,
                            kv_heads=2, mlp_hidden=2 * hidden)
    shapes = llama.llama_param_shapes(llama.Llama(cfg))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.05 * rng.normal(size=s.shape)).astype(np.float32),
                          shapes)
    params["decoder"]["decoder_norm"]["scale"][:] = 1
    for norm in ("pre_self_attention_layer_norm", "post_self_attention_layer_norm"):
        params["decoder"]["layers"][norm]["scale"][:] = 1
    ckpt = root / "tiny-llama"
    llama.save_hf_checkpoint(params, cfg, ckpt,
                             dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    hf = json.loads((ckpt / "config.json").read_text())
    hf["eos_token_id"] = tok.token_to_id("</s>")
    (ckpt / "config.json").write_text(json.dumps(hf))
    tok.save(str(ckpt / "tokenizer.json"))
    return ckpt, cfg


# the mixture-of-experts fine-tuning case (tests/test_hf_moe.py and
# scripts/make_hf_fixtures.py --check --moe, which records transformers' logits of the
# export): a fixture of tests/fixtures/hf_moe with this module's tokenizer beside it
MOE_FINETUNED = ("mixtral", "qwen3_moe")


def moe_finetune_args(ckpt, data, out, png) -> list:
    """``zerojax finetune``'s arguments for the MoE case (stage 3 on 8 devices)."""
    return ["finetune", str(ckpt), str(data), "--out", str(out), "--steps", "12",
            "--batch", "8", "--seq", "16", "--lr", "1e-2", "--png", str(png),
            "--no-progress", "--max-shard-size", "40KB"]


def write_moe_case(root, fixture) -> tuple:
    """Copies the checkpoint directory ``fixture`` to ``root/ckpt`` with a BPE
    tokenizer of 64 tokens trained on ``root/data.txt`` (written here); returns
    ``(ckpt, data)``."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    data = text(3000)
    (root / "data.txt").write_text(data)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([data], trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<unk>", "</s>"], show_progress=False))
    ckpt = root / "ckpt"
    shutil.copytree(fixture, ckpt)
    hf = json.loads((ckpt / "config.json").read_text())
    hf["eos_token_id"] = tok.token_to_id("</s>")
    (ckpt / "config.json").write_text(json.dumps(hf))
    tok.save(str(ckpt / "tokenizer.json"))
    return ckpt, root / "data.txt"
