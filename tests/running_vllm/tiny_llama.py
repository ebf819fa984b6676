"""Build a tiny random-weight Llama that vLLM can serve: no weights can be downloaded here.

    .venv-vllm/bin/python tests/running_vllm/tiny_llama.py OUT_DIR [--hybrid]

Deterministic (fixed seed, a word-level tokenizer trained on the text below), a few MB. Greedy decoding of
random weights still gives the same tokens on every run, which is all the engine tests compare. `--hybrid`
makes its first layer a sliding-window one (`layer_types`, as vLLM's Llama reads them): vLLM then keeps the
two layers in two KV cache groups.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

WORDS = (
    "the cache moves blocks from storage to the device and back while the model reads its keys and values "
    "a prefix that was seen before is loaded instead of computed again so the first token comes sooner "
    "when a block is corrupt the engine must compute it again and never serve what it read "
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "red green blue yellow black white orange purple brown grey pink gold silver copper iron tin "
).split()
VOCAB_SIZE = 256


SLIDING_WINDOW = 64  # tokens: two of the tests' 32-token blocks


def cached_dir(hybrid: bool = False) -> pathlib.Path:
    """Where the model lives once built: ~/.cache/kvobs/tiny-llama (or KVOBS_MODEL_CACHE) / a hash of this
    script, so a changed recipe builds a new model."""
    root = pathlib.Path(os.environ.get("KVOBS_MODEL_CACHE", "~/.cache/kvobs/tiny-llama")).expanduser()
    name = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]
    return root / (f"{name}-hybrid" if hybrid else name)


def corpus() -> list[str]:
    """Lines of the words above in several orders, so the trainer sees every word."""
    lines = []
    for shift in range(len(WORDS)):
        rotated = WORDS[shift:] + WORDS[:shift]
        lines.append(" ".join(rotated[:24]))
    return lines


def build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)


def build_model(out: pathlib.Path, hybrid: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": SLIDING_WINDOW} if hybrid else {}
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32",
                         **sliding)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def main(out_dir: str, hybrid: bool = False) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out, hybrid)


if __name__ == "__main__":
    main(sys.argv[1], hybrid="--hybrid" in sys.argv[2:])
