"""Deterministic builder for the shipped tokenizer (``axrl/tokenizer/assets``).

    python -m axrl.tokenizer.build [--out DIR]

Trains a byte-level BPE on the synthetic corpus from :mod:`axrl.tokenizer.corpus` and writes
``tokenizer.json`` + ``tokenizer_config.json``. The output is byte-for-byte reproducible, so
the committed assets can be checked against a rebuild.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from axrl.tokenizer import corpus
from axrl.tokenizer.chat_template import CHAT_TEMPLATE, IM_END, PAD_TOKEN, SPECIAL_TOKENS
from axrl.tokenizer.tokenizer import dump_json

VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 4096
CORPUS_SIZE = 20000
SEED = 0
ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def train_tokenizer(vocab_size: int = VOCAB_SIZE, n: int = CORPUS_SIZE, seed: int = SEED) -> Tokenizer:
    """Train the byte-level BPE; the special tokens get ids ``0..len(SPECIAL_TOKENS)-1``."""
    tok = Tokenizer(models.BPE())
    # No normalizer: any normalisation (e.g. NFC) would break exact round-trips of arbitrary text.
    # Digits first, so every digit is its own pre-token and thus its own token: numbers stay
    # compositional, which arithmetic tasks need.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no tokens
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so text never seen in training still encodes (and round-trips).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.generate(n, seed), trainer=trainer, length=n)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"corpus too small: got {tok.get_vocab_size()} tokens, want {vocab_size}")
    return tok


def tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer_config.json`` that makes the directory loadable by ``AutoTokenizer``."""
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",  # batched generation pads on the left
        "clean_up_tokenization_spaces": False,  # HF's cleanup would alter decoded text
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build(out: Path | str = ASSETS_DIR) -> Path:
    """Train and write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(dump_json(tokenizer_config(tok)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ASSETS_DIR, help="output directory (default: shipped assets)")
    out = build(ap.parse_args(argv).out)
    print(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer_config.json'}")


if __name__ == "__main__":
    main()
