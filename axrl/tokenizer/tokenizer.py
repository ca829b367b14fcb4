"""AxRL's tokenizer: a thin wrapper over ``tokenizers.Tokenizer`` plus the ChatML template.

Deliberately free of ``transformers``: rollout workers and the trainer only need token ids, and
the HF-format files written by :meth:`Tokenizer.save` keep exported models loadable by HF.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from axrl.tokenizer import chat_template as _ct

Message = dict[str, Any]


class Tokenizer:
    """Byte-level BPE tokenizer with special-token ids and chat-template rendering.

    ``encode`` never adds special tokens but recognises them in the text; ``decode`` keeps
    them unless asked otherwise, so ``decode(encode(text)) == text`` for any string.
    """

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any]) -> None:
        """Wrap a loaded ``tokenizers.Tokenizer`` and its ``tokenizer_config.json`` dict."""
        self._tok = tokenizer
        self.config = dict(config)
        self.chat_template: str = self.config.get("chat_template") or _ct.CHAT_TEMPLATE
        self.eos_token: str = self.config.get("eos_token") or _ct.IM_END
        self.pad_token: str = self.config.get("pad_token") or _ct.PAD_TOKEN
        self.eos_token_id: int = self._require_id(self.eos_token)
        self.pad_token_id: int = self._require_id(self.pad_token)
        self.im_start_id: int = self._require_id(_ct.IM_START)
        self.im_end_id: int = self._require_id(_ct.IM_END)

    # -- loading / saving ---------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja`` if any)."""
        path = Path(path)
        tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}
        # transformers >= 4.43 saves the template as a separate file, which then takes precedence.
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            config["chat_template"] = jinja_file.read_text(encoding="utf-8")
        return cls(tok, config)

    @classmethod
    def default(cls) -> Tokenizer:
        """The tokenizer shipped in ``axrl/tokenizer/assets`` (built by ``axrl.tokenizer.build``)."""
        with resources.as_file(resources.files("axrl.tokenizer") / "assets") as assets:
            return cls.from_dir(assets)

    def save(self, path: str | Path) -> Path:
        """Write an HF-loadable tokenizer directory (tokenizer.json, tokenizer_config.json,
        special_tokens_map.json)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {**self.config, "chat_template": self.chat_template}
        special = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        (path / "tokenizer.json").write_text(self._tok.to_str(pretty=True) + "\n", encoding="utf-8")
        (path / "tokenizer_config.json").write_text(dump_json(config), encoding="utf-8")
        (path / "special_tokens_map.json").write_text(dump_json(special), encoding="utf-8")
        return path

    # -- vocabulary ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding rows must cover it)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (a vocabulary entry, e.g. ``"Ġthe"``), or None if absent."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry for ``token_id``, or None if out of range."""
        return self._tok.id_to_token(token_id)

    @property
    def special_token_ids(self) -> list[int]:
        """Ids of all special tokens (the ones ``decode(skip_special_tokens=True)`` drops)."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def _require_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} missing from the vocabulary")
        return token_id

    # -- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` for many strings at once (parallel in Rust)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut multi-byte char) decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> list[int] | str:
        """Render ``messages`` with the chat template; ids if ``tokenize`` else the text.

        Same output as ``transformers``' ``apply_chat_template`` on the saved directory.
        """
        # transformers exposes the special-token strings to templates; mirror it for parity.
        text = _ct.render(
            self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token, pad_token=self.pad_token,
        )
        return self.encode(text) if tokenize else text

    def encode_message(self, message: Message, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of one message as it appears inside a rendered conversation.

        Concatenating ``encode_message`` over a conversation, then ``generation_prompt_ids()``,
        equals ``apply_chat_template(messages, tools, add_generation_prompt=True)``. Pass
        ``tools`` with the first message only: the tools block is rendered in front of it.
        """
        return self.apply_chat_template([message], tools=tools)

    def generation_prompt_ids(self) -> list[int]:
        """Ids that open an assistant turn (``<|im_start|>assistant\\n``)."""
        return self.apply_chat_template([], add_generation_prompt=True)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, pad={self.pad_token!r})"


def dump_json(obj: Any) -> str:
    """Stable JSON text for config files: key order as given, UTF-8, trailing newline."""
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
