"""AxRL's tokenizer: a thin wrapper over ``tokenizers.Tokenizer`` plus a Jinja chat template.

Deliberately free of ``transformers``: rollout workers and the trainer only need token ids, and
the HF-format files written by :meth:`Tokenizer.save` keep exported models loadable by HF.

The same class serves the shipped tokenizer (``Tokenizer.default()``, ChatML) and a Hugging Face
checkpoint's own (``Tokenizer.from_dir(model_dir)``): everything the agent loop needs is derived
from the directory's files, not assumed —

* the end-of-turn token (``eos_token_id``) is the token the chat template writes right after an
  assistant message's text; it must be one of the checkpoint's eos tokens
  (``tokenizer_config.json`` ``eos_token``, ``generation_config.json`` / ``config.json``
  ``eos_token_id``), all of which are ``stop_token_ids``;
* the generation prompt is what ``add_generation_prompt`` adds to a conversation;
* the tool-call format is the text the template wraps around a call's JSON (Qwen and ChatML:
  ``<tool_call>`` … ``</tool_call>``), see :attr:`Tokenizer.tool_call_format`.

Every probe renders messages in the Hugging Face convention (``axrl.tokenizer.template_probe``);
a template that cannot render one of its shapes is refused here, naming the shape.
"""

from __future__ import annotations

import json
import os
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from axrl.tokenizer import chat_template as _ct
from axrl.tokenizer import template_probe as _probe
from axrl.tokenizer.reasoning import THINK_START, detect_reasoning_parser, split_reasoning
from axrl.tokenizer.tool_calls import ToolCallFormat, hf_tool_call, parse_with_format
from axrl.tokenizer.tool_parsers import ToolParser, detect_tool_parser, get_tool_parser

Message = dict[str, Any]

# Special-token strings transformers exposes to chat templates (`bos_token`, `eos_token`, …).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
_MARK = "\x00"  # a character no template emits on its own

class Tokenizer:
    """Byte-level BPE tokenizer with special-token ids and chat-template rendering.

    ``encode`` never adds special tokens but recognises them in the text; ``decode`` keeps
    them unless asked otherwise, so ``decode(encode(text)) == text`` for any string.
    """

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any], *, eos_token_ids: list[int] | None = None,
                 pad_token_id: int | None = None, source: str = "tokenizer", tool_parser: str | None = None) -> None:
        """Wrap a loaded ``tokenizers.Tokenizer`` and its ``tokenizer_config.json`` dict.

        ``eos_token_ids`` / ``pad_token_id``: what ``generation_config.json`` or ``config.json`` of
        a model directory say (they complement the config's ``eos_token`` / ``pad_token``).
        ``source`` names the directory in error messages. ``tool_parser``: a name of
        :data:`axrl.tokenizer.tool_parsers.PARSERS` (``model.tool_parser``), else read off the template.
        """
        self._tok = tokenizer
        self.config = dict(config)
        self.source = source
        # transformers' list form holds named templates; `tool_use` renders whenever tools are given.
        self.chat_templates: dict[str, str] = _pick_templates(self.config.get("chat_template"), source)
        self.chat_template: str = self.chat_templates.get("default") or next(iter(self.chat_templates.values()))
        self.fold_system = False  # set by the probes: AxRL folds the system prompt for templates without one
        # True when the template writes no token after a reply: the next turn's opening ends it (GLM-4.5).
        self.turn_end_implicit = False
        # transformers renders templates with the special-token strings of the config.
        self.template_tokens = {k: v for k in TEMPLATE_TOKENS if (v := _token_str(self.config.get(k)))}
        shapes = _probe.check_shapes(lambda m, **kw: self.apply_chat_template(m, tokenize=False, **kw), source,
                                     "\n".join(self.chat_templates.values()))
        self.fold_system, self.tool_free = shapes.fold_system, shapes.tool_free
        self.arguments_form: str = shapes.form or "mapping"
        self._generation_prompt = self._generation_prompt_text()
        self.eos_token_id: int = self._turn_end_id()
        self.eos_token: str = self._tok.id_to_token(self.eos_token_id)
        named = {self._require_id(t) for k in ("eos_token",) if (t := self.template_tokens.get(k))}
        declared = named | set(eos_token_ids or [])
        if declared and self.eos_token_id not in declared:
            raise ValueError(f"{source}: the chat template ends an assistant turn with {self.eos_token!r} "
                             f"(id {self.eos_token_id}), which is not one of the eos tokens the directory declares "
                             f"({sorted(declared)}: tokenizer_config.json eos_token, generation_config.json / "
                             "config.json eos_token_id); generation would not stop at the end of a turn")
        self.stop_token_ids: list[int] = sorted(declared | {self.eos_token_id})
        # What may close a turn: the turn end first, then the other stop tokens (gpt-oss closes a
        # call's turn with <|call|> and a final answer with <|return|>).
        self.turn_ends: tuple[str, ...] = (self.eos_token, *(
            t for i in self.stop_token_ids if (t := self._tok.id_to_token(i)) and t != self.eos_token))
        pad = self.template_tokens.get("pad_token")
        self.pad_token_id: int = self._require_id(pad) if pad else pad_token_id if pad_token_id is not None \
            else self.eos_token_id
        self.pad_token: str = self._tok.id_to_token(self.pad_token_id)
        # ChatML markers, when the vocabulary has them (None otherwise).
        self.im_start_id: int | None = self._tok.token_to_id(_ct.IM_START)
        self.im_end_id: int | None = self._tok.token_to_id(_ct.IM_END)
        self._read_tool_format(shapes.form, tool_parser)

    def _read_tool_format(self, form: str | None, tool_parser: str | None) -> None:
        """The tool-call and reasoning parsers: the family's (``model.tool_parser``, else the one
        whose format the template writes), and the learned :class:`ToolCallFormat` for templates
        of no known family."""
        render = lambda m, **kw: self._render(m, **kw)  # noqa: E731
        # A call's turn may end with another stop token than a final answer's (gpt-oss: <|call|>).
        ends = self.turn_ends
        self.tool_call_format: ToolCallFormat | None = (
            _probe.tool_call_format(render, form, ends, self.turn_end_implicit) if form else None)
        body = _probe.call_body(render, form, ends, self.turn_end_implicit) if form else None
        name = tool_parser or (detect_tool_parser(body) if body else None)
        self.tool_parser: ToolParser | None = get_tool_parser(name) if name else None
        gen = self._generation_prompt
        self.reasoning_parser: str | None = detect_reasoning_parser("\n".join(self.chat_templates.values()), gen)
        # R1 distills end the generation prompt inside an open <think> block: replies start in it.
        self.reasoning_opened = gen.rstrip().endswith(THINK_START)
        # The tagged formats (Qwen, ChatML): what streaming replies watch for.
        self.tool_call_tags: tuple[str, str] | None = self.tool_call_format.tags if self.tool_call_format else None
        self.reply_close_ids: frozenset[int] = self._reply_close_ids()

    def _reply_close_ids(self) -> frozenset[int]:
        """Stop tokens that end a reply where the template itself ends one: the turn end and the close
        of a call's turn (gpt-oss: ``<|call|>``); every stop token where no token closes a reply
        (GLM-4.5: the next turn's ``<|user|>`` / ``<|observation|>``). Other stop tokens (Qwen's
        ``<|endoftext|>``) stop generation but leave the turn unclosed: the agent loop then appends
        the template's close, masked."""
        if self.turn_end_implicit:
            return frozenset(self.stop_token_ids)
        ids = {self.eos_token_id}
        if self.tool_call_format is not None or self.tool_parser is not None:
            try:
                ids.add(self.reply_end_id({"role": "assistant", "content": "", "tool_calls": [
                    self.tool_call_message(_probe.PROBE_TOOL["function"]["name"], _probe.PROBE_ARGS, 1)]}))
            except ValueError:  # the template cannot render a call alone: the turn end is its close
                pass
        return frozenset(i for i in ids if i in self.stop_token_ids)

    # -- loading / saving ---------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, tool_parser: str | None = None) -> Tokenizer:
        """Load a tokenizer directory or a Hugging Face model directory: ``tokenizer.json`` (the
        `tokenizers` library's format) + ``tokenizer_config.json``, ``chat_template.jinja`` /
        ``chat_template.json``, ``generation_config.json`` and ``config.json`` when present."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: AxRL reads fast tokenizers (tokenizer.json); write one "
                                    "with transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exceptions for bad files
            raise ValueError(f"{tok_file}: not a readable tokenizers file ({e})") from None
        config = _read_json(path / "tokenizer_config.json")
        # transformers >= 4.43 saves the template as a separate file, which then takes precedence.
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            config["chat_template"] = jinja_file.read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            config["chat_template"] = _read_json(path / "chat_template.json").get("chat_template")
        # transformers 5 saves named templates (Hermes-3's `tool_use`) as additional_chat_templates/NAME.jinja.
        extra = sorted((path / "additional_chat_templates").glob("*.jinja"))
        if extra and isinstance(config.get("chat_template"), str):
            config["chat_template"] = [{"name": "default", "template": config["chat_template"]}] + [
                {"name": f.stem, "template": f.read_text(encoding="utf-8")} for f in extra]
        for key, value in _read_json(path / "special_tokens_map.json").items():
            config.setdefault(key, value)
        eos: list[int] = []
        pad = None
        for name in ("generation_config.json", "config.json"):
            meta = _read_json(path / name)
            ids = meta.get("eos_token_id")
            eos += [int(i) for i in (ids if isinstance(ids, list) else [ids]) if isinstance(i, int)]
            if pad is None and isinstance(meta.get("pad_token_id"), int):
                pad = int(meta["pad_token_id"])
        return cls(tok, config, eos_token_ids=eos, pad_token_id=pad, source=str(path), tool_parser=tool_parser)

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
        template: Any = self.chat_template if len(self.chat_templates) == 1 else \
            [{"name": k, "template": v} for k, v in self.chat_templates.items()]
        config = {**self.config, "chat_template": template}
        special = {**self.template_tokens, "pad_token": self.pad_token}
        (path / "tokenizer.json").write_text(self._tok.to_str(pretty=True) + "\n", encoding="utf-8")
        (path / "tokenizer_config.json").write_text(dump_json(config), encoding="utf-8")
        (path / "special_tokens_map.json").write_text(dump_json(special), encoding="utf-8")
        return path

    # -- what the template implies ------------------------------------------------------

    def _render(self, messages: list[Message], **kw: Any) -> str:
        try:
            return self.apply_chat_template(messages, tokenize=False, **kw)  # type: ignore[return-value]
        except Exception as e:  # a template that cannot render the basic shapes is unusable here
            raise ValueError(f"{self.source}: the chat template cannot render {messages!r}: {e}") from None

    def _turn_end_id(self) -> int:
        # After a user turn: templates that check role alternation (Mistral) refuse a lone reply.
        user = {"role": "user", "content": "u"}
        text = self._render([user, {"role": "assistant", "content": _MARK}])
        after = self.encode(text[text.rindex(_MARK) + 1:])
        if not after:
            # GLM-4.5 writes nothing after a reply: the model ends its turn by generating the next
            # turn's opening (<|user|>, <|observation|>), which generation_config lists as eos.
            text = self._render([user, {"role": "assistant", "content": _MARK}, user])
            after = self.encode(text[text.rindex(_MARK) + 1:])
            self.turn_end_implicit = bool(after) and after[0] in self.special_token_ids
        if not after or after[0] not in self.special_token_ids:
            raise ValueError(f"{self.source}: the chat template does not close an assistant message with a special "
                             f"token (it writes {text[text.rindex(_MARK) + 1:]!r} after the text); the agent loop "
                             "needs one to know where a turn ends")
        return after[0]

    def continuation_ids(self, history: list[Message], new_messages: list[Message],
                         tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Ids the template writes after the *text* of ``history``'s last message (an assistant
        reply): its close (the end-of-turn token first), ``new_messages``, then the generation
        prompt — what the agent loop appends after a reply.

        The whole conversation is rendered (with the reply's text replaced by a marker), so
        templates that render a message depending on its neighbours (Qwen merges consecutive tool
        results, Llama opens the conversation with a system header) are followed exactly; what
        the template would render differently *before* the reply is drift (``axrl.core.token_stream.drift_tokens``).
        """
        marked = [*history[:-1], {"role": "assistant", "content": _MARK}, *new_messages]
        try:
            text = self._render(marked, tools=tools, add_generation_prompt=add_generation_prompt)
        except ValueError:
            # The template needs the reply's calls to render what follows (gpt-oss names a tool
            # result after the call it answers): render the reply itself and cut after its close.
            return self._continuation_after_reply(history, new_messages, tools, add_generation_prompt)
        return self.encode(text[text.rindex(_MARK) + 1:])

    def _continuation_after_reply(self, history: list[Message], new_messages: list[Message],
                                  tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> list[int]:
        """:meth:`continuation_ids` with the reply rendered as it is: the reply's close, then what
        the whole conversation renders after the part it shares with the history alone."""
        head = self._render(history, tools=tools)
        full = self._render([*history, *new_messages], tools=tools, add_generation_prompt=add_generation_prompt)
        at, end = _probe.turn_end_at(head, 0, self.turn_ends)
        shared = len(os.path.commonprefix([head, full]))
        rest = full[max(shared, at + len(end)) if at >= 0 else shared:]
        return [self._require_id(end) if end else self.eos_token_id] + self.encode(rest)

    def episode_ids(self, conversation: list[Message],
                    tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """``conversation`` as the agent loop streams it, and its loss mask: the messages before
        the first reply rendered once with the generation prompt; each reply as the text the
        model generates for it (:meth:`reply_text`) and the end-of-turn token, mask 1; after
        it, :meth:`continuation_ids` (the messages up to the next reply and its opening; after
        the last reply only its close). What the supervised warm-up trains on."""
        turns = [i for i, m in enumerate(conversation) if m.get("role") == "assistant"]
        if not turns:
            ids = list(self.apply_chat_template(conversation, tools=tools, add_generation_prompt=True))
            return ids, [0] * len(ids)
        ids = list(self.apply_chat_template(conversation[:turns[0]], tools=tools, add_generation_prompt=True))
        mask = [0] * len(ids)
        for i, nxt in zip(turns, turns[1:] + [len(conversation)]):
            glue = self.continuation_ids(conversation[:i + 1], conversation[i + 1:nxt], tools,
                                         add_generation_prompt=nxt > i + 1 or i != turns[-1])
            # Where the next turn's opening ends a reply (GLM-4.5), the close is that opening.
            end = glue[0] if self.turn_end_implicit and glue else self.reply_end_id(conversation[i])
            reply, after = self.encode(self.reply_text(conversation[i])) + [end], glue[1:]
            ids += reply + after
            mask += [1] * len(reply) + [0] * len(after)
        return ids, mask

    def incremental_mismatch(self, conversation: list[Message], tools: list[dict[str, Any]] | None = None) -> str | None:
        """Where the token stream the agent loop builds for ``conversation`` (:meth:`episode_ids`)
        differs from rendering the conversation whole; None when they agree. A difference is
        drift: the template re-renders history (e.g. strips reasoning from earlier turns)."""
        parts, _ = self.episode_ids(conversation, tools)
        ends_with_reply = bool(conversation) and conversation[-1].get("role") == "assistant"
        whole = list(self.apply_chat_template(conversation, tools=tools, add_generation_prompt=not ends_with_reply))
        if parts == whole:
            return None
        k = next((i for i, (a, b) in enumerate(zip(parts, whole)) if a != b), min(len(parts), len(whole)))
        return (f"token {k}: the agent loop's stream has {self.decode(parts[k:k + 8])!r}, "
                f"the whole conversation {self.decode(whole[k:k + 8])!r}")

    def check_incremental(self) -> None:
        """Warn when the template renders an agent-shaped conversation differently from the
        token stream the agent loop builds for it: that difference is drift (recorded per sample,
        never trained on), and serving the same chat would show the model other tokens."""
        if self.tool_call_format is None and self.tool_parser is None:
            conversation = [m for m in _probe.episode(self.arguments_form) if m["role"] in ("system", "user")] + \
                [{"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}, {"role": "assistant",
                                                                                         "content": "b"}]
        else:
            conversation = _probe.episode(self.arguments_form)
        problem = self.incremental_mismatch(conversation, tools=[_probe.PROBE_TOOL])
        if problem:
            warnings.warn(f"{self.source}: the chat template re-renders history ({problem}); AxRL trains "
                          "on the generated ids and records the difference as drift", stacklevel=2)

    def reply_text(self, message: Message) -> str:
        """The text the model generates for an assistant ``message``: its content and its
        structured ``tool_calls`` as this template writes them, without the end-of-turn token."""
        user = {"role": "user", "content": _MARK}
        tools = [_probe.PROBE_TOOL] if message.get("tool_calls") else None
        before = self._render([user], tools=tools, add_generation_prompt=True)
        text = self._render([user, message], tools=tools)
        # A generation prompt that opens a block (R1's `<think>\n`, which history never shows) is
        # left out: the reply is what follows the part both renderings share.
        opening = len(_probe.whole_markers(os.path.commonprefix([before, text])))
        stop, _ = _probe.turn_end_at(text, opening, self.turn_ends)
        stop = len(text) if stop < 0 and self.turn_end_implicit else stop  # the reply is all that follows
        if opening < len(before) - len(self.generation_prompt_text()) or stop < 0:
            raise ValueError(f"{self.source}: cannot isolate the text of assistant message {message!r}: the template "
                             f"renders the conversation before it differently once the reply is added (with the "
                             f"generation prompt: {before[-60:]!r}; with the reply: {text[:len(before)][-60:]!r}); "
                             "such a template re-renders history on every turn, which AxRL cannot stream")
        return text[opening:stop]

    def reply_end_id(self, message: Message) -> int:
        """The token that closes assistant ``message`` as the template writes it: the turn end,
        or the stop token the template puts there instead (gpt-oss closes a call with <|call|>)."""
        user = {"role": "user", "content": _MARK}
        tools = [_probe.PROBE_TOOL] if message.get("tool_calls") else None
        before = self._render([user], tools=tools, add_generation_prompt=True)
        text = self._render([user, message], tools=tools)
        _, end = _probe.turn_end_at(text, len(_probe.whole_markers(os.path.commonprefix([before, text]))),
                                    self.turn_ends)
        return self._require_id(end) if end else self.eos_token_id

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
            raise ValueError(f"{self.source}: token {token!r} missing from the vocabulary")
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
        template = self.chat_templates.get("tool_use", self.chat_template) if tools is not None else self.chat_template
        if self.fold_system:
            messages = fold_system(messages)
        text = _ct.render(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                          **self.template_tokens)
        return self.encode(text) if tokenize else text

    def encode_message(self, message: Message, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of one message as it appears inside a rendered conversation.

        Concatenating ``encode_message`` over a conversation, then ``generation_prompt_ids()``,
        equals ``apply_chat_template(messages, tools, add_generation_prompt=True)`` when every
        message renders on its own (the shipped ChatML does; Llama's system header, Qwen's merged
        tool results do not — the agent loop uses :meth:`continuation_ids`, which follows them).
        Pass ``tools`` with the first message only: the tools block is rendered in front of it.
        """
        return self.apply_chat_template([message], tools=tools)

    def generation_prompt_text(self) -> str:
        """Text that opens an assistant turn (ChatML: ``<|im_start|>assistant\\n``; "" when nothing
        does, as in Mistral's format, where the reply follows ``[/INST]``)."""
        return self._generation_prompt

    def _generation_prompt_text(self) -> str:
        # What add_generation_prompt appends to a conversation: templates may not render an empty one.
        probe = [{"role": "user", "content": _MARK}]
        with_prompt, without = self._render(probe, add_generation_prompt=True), self._render(probe)
        if not with_prompt.startswith(without):
            raise ValueError(f"{self.source}: the chat template renders a conversation differently with "
                             "add_generation_prompt (it must only append an assistant opening, if any); AxRL "
                             "renders the prompt once and appends replies to it")
        return with_prompt[len(without):]  # "" for templates where nothing opens a reply (Mistral)

    def generation_prompt_ids(self) -> list[int]:
        """Ids that open an assistant turn (``<|im_start|>assistant\\n``)."""
        return self.encode(self.generation_prompt_text())

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """(reasoning, the rest) of a reply, by the family's reasoning parser (:attr:`reasoning_parser`:
        ``<think>`` blocks, harmony's analysis channel); ("", text) for templates without reasoning."""
        return split_reasoning(text, self.reasoning_parser, opened=self.reasoning_opened)

    def parse_tool_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The tool calls in assistant ``text``, after its reasoning, by the family's parser
        (:attr:`tool_parser`), else in the format read off the template (:attr:`tool_call_format`;
        ``<tool_call>`` blocks when it has none). ``tools`` (the request's schemas) type the values
        of XML formats (Qwen3-Coder, GLM-4.5): a ``string`` parameter "95" stays a string. Never
        raises: a malformed call is an entry with ``error`` set."""
        _, rest = self.split_reasoning(text)
        if self.tool_parser is not None:
            return self.tool_parser.parse_calls(rest, tools)
        return parse_with_format(rest, self.tool_call_format)

    def reply_message(self, text: str) -> Message:
        """The assistant message of a generated reply for the conversation the agent loop keeps:
        with a family parser and well-formed calls, the prose before them and structured
        ``tool_calls`` (templates that check roles, like Mistral's, refuse calls written as plain
        text); otherwise the text as it is. Where the template writes the calls differently from
        the model, the difference is drift."""
        calls = self.parse_tool_calls(text) if self.tool_parser is not None else []
        if self.reasoning_parser == "openai":
            return self._harmony_message(text, calls)
        if not calls or any(c["error"] for c in calls):
            return {"role": "assistant", "content": text}
        start = self.tool_call_start
        prose = text.split(start, 1)[0].strip() if start else ""
        return {"role": "assistant", "content": prose,
                "tool_calls": [self.tool_call_message(c["name"], c["arguments"], k + 1) for k, c in enumerate(calls)]}

    def _harmony_message(self, text: str, calls: list[dict[str, Any]]) -> Message:
        """A gpt-oss reply as its template reads it: the analysis channel as ``thinking``, the
        final channel as ``content`` (the published template refuses ``<|channel|>`` in either)."""
        thinking, final = self.split_reasoning(text)
        message: Message = {"role": "assistant", "content": "" if calls else final}
        if thinking:
            message["thinking"] = thinking
        if calls and not any(c["error"] for c in calls):
            message["tool_calls"] = [self.tool_call_message(c["name"], c["arguments"], k + 1) for k, c in enumerate(calls)]
        elif calls:  # malformed: kept as text the template can render
            message["content"] = final
        return message

    def template_facts(self) -> dict[str, Any]:
        """What AxRL chose for this chat template, for the run's manifest: the tool-call and reasoning
        parsers, the arguments form, whether AxRL folds the system prompt (the template has no
        system role), whether the template is tool-free, and its named templates."""
        return {"tool_parser": self.tool_parser.name if self.tool_parser else None,
                "reasoning_parser": self.reasoning_parser, "arguments": self.arguments_form,
                "system_folded_by_axrl": self.fold_system, "tool_free": bool(self.tool_free),
                "templates": sorted(self.chat_templates)}

    @property
    def tool_call_start(self) -> str:
        """The text that opens the first tool call of a reply ("" for bare JSON / pythonic calls)."""
        if self.tool_parser is not None:
            return self.tool_parser.start
        return self.tool_call_format.start if self.tool_call_format else "<tool_call>"

    def tool_call_message(self, name: str, arguments: dict[str, Any], index: int) -> Message:
        """An assistant tool call as this template wants it: ``arguments`` as the wire's JSON string
        or as a mapping (:attr:`arguments_form`)."""
        call = hf_tool_call(name, json.dumps(arguments) if self.arguments_form == "string" else arguments, index)
        if self.tool_parser is not None and self.tool_parser.name == "kimi_k2":
            call["id"] = f"functions.{name}:{index - 1}"  # Kimi writes the id, and so the name, verbatim
        return call

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, pad={self.pad_token!r})"


def _pick_templates(template: Any, source: str) -> dict[str, str]:
    """The chat templates of a config by name: a string is ``default``; transformers' list form
    (Hermes-3: ``default`` and ``tool_use``) keeps its names."""
    if isinstance(template, dict):
        template = [{"name": k, "template": v} for k, v in template.items()]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)} \
        if isinstance(template, list) else {"default": template}
    named = {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str) and v.strip()}
    if not named:
        raise ValueError(f"{source}: no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                         "AxRL renders every episode with the model's own template")
    return named


def fold_system(messages: list[Message]) -> list[Message]:
    """``messages`` with a leading system message folded into the first user turn (its text, a
    blank line, the user's text), as Google documents for Gemma, whose templates have no system role."""
    if not messages or messages[0].get("role") != "system":
        return messages
    rest = list(messages[1:])
    first = next((i for i, m in enumerate(rest) if m.get("role") == "user"), None)
    if first is None:
        return [{"role": "user", "content": messages[0].get("content") or ""}, *rest]
    user = rest[first]
    rest[first] = {**user, "content": f"{messages[0].get('content') or ''}\n\n{user.get('content') or ''}"}
    return rest


def _token_str(value: Any) -> str | None:
    """A special token as configured: a string or transformers' AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def dump_json(obj: Any) -> str:
    """Stable JSON text for config files: key order as given, UTF-8, trailing newline."""
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
