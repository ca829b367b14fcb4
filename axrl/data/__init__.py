"""Prompt data: built-in task generators and JSONL/Parquet prompt files, resumable."""

from axrl.data.loader import PromptDataError, PromptLoader, read_prompt_file

__all__ = ["PromptDataError", "PromptLoader", "read_prompt_file"]
