"""Tokenizer: byte-level BPE (shipped in ``assets/``) or a checkpoint's own, its chat template,
tool-call parsing."""

from axrl.tokenizer.loader import load_tokenizer, run_tokenizer
from axrl.tokenizer.tokenizer import Tokenizer
from axrl.tokenizer.tool_calls import parse_tool_calls

__all__ = ["Tokenizer", "load_tokenizer", "parse_tool_calls", "run_tokenizer"]
