"""The tokenizer a run uses: the model directory's own (``model.path``) or the shipped one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from axrl.tokenizer.tokenizer import Tokenizer


def load_tokenizer(model_path: str | Path | None, tool_parser: str | None = None) -> Tokenizer:
    """``Tokenizer.default()`` for a preset model (``model_path`` None), else the checkpoint's own
    tokenizer and chat template (see :class:`Tokenizer`), checked against its ``config.json``:
    every token id must have an embedding row. Errors name ``model.path`` and the file.
    ``tool_parser`` (``model.tool_parser``) overrides the tool-call parser read off the template."""
    if model_path is None:
        tok = Tokenizer.default()
        if tool_parser:
            tok._read_tool_format(tok.arguments_form, tool_parser)
        return tok
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model.path {path}: no such directory (a Hugging Face model directory "
                                "with config.json, model.safetensors and tokenizer files)")
    try:
        tokenizer = Tokenizer.from_dir(path, tool_parser=tool_parser)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"model.path: {e}") from None
    config = path / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    if isinstance(vocab, int) and tokenizer.vocab_size > vocab:
        raise ValueError(f"model.path: {path / 'tokenizer.json'} has {tokenizer.vocab_size} token ids but "
                         f"{config} has vocab_size {vocab}: ids from {vocab} up have no embedding row")
    tokenizer.check_incremental()
    return tokenizer


def run_tokenizer(config: dict[str, Any] | None) -> Tokenizer:
    """The tokenizer a recorded run used, for decoding its trace: its ``model.path``'s own when the
    directory is still there, else the shipped one (token ids stay right either way)."""
    model = (config or {}).get("model") if isinstance(config, dict) else None
    try:
        return load_tokenizer((model or {}).get("path"), (model or {}).get("tool_parser"))
    except (OSError, ValueError):
        return Tokenizer.default()
