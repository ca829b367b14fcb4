"""Tokenizer: byte-level BPE (shipped in ``assets/``), ChatML template, tool-call parsing."""

from axrl.tokenizer.tool_calls import parse_tool_calls
from axrl.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "parse_tool_calls"]
