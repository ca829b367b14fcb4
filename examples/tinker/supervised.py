"""Run tinker-cookbook's supervised training loop (`tinker_cookbook.supervised.train`) from the
command line, with chz arguments exactly as the cookbook documents them.

tinker-cookbook 0.6.1's own `python -m tinker_cookbook.supervised.train` fails before it starts
("Nested entrypoints must take a type annotated argument"); this is the same `main(Config)`
behind a working entrypoint. Point it at `axrl serve --training` with TINKER_BASE_URL (docs/service.md):

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/tinker/supervised.py \\
        model_name=MODEL_DIR renderer_name=role_colon log_path=/tmp/sl \\
        dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder \\
        dataset_builder.file_path=…/tinker_cookbook/example_data/conversations.jsonl \\
        dataset_builder.common_config.model_name_for_tokenizer=MODEL_DIR \\
        dataset_builder.common_config.renderer_name=role_colon
"""

from __future__ import annotations

import asyncio

import chz
from tinker_cookbook.supervised import train


def run(config: train.Config) -> None:
    """The cookbook's supervised loop on `config`."""
    asyncio.run(train.main(config))


if __name__ == "__main__":
    chz.nested_entrypoint(run, allow_hyphens=True)
