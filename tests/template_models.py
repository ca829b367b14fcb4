"""Model directories in the chat-template conventions AxRL follows, made the way users make them:
`transformers`' `save_pretrained` of a tiny random-init Qwen3 and of a `PreTrainedTokenizerFast`
that holds the template's special tokens, with one of the templates in tests/templates/ (written
for these tests after each family's published convention). Nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hf_checkpoint import train_tokenizer, write_model

TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class Convention:
    """One family's chat format: its template file, special tokens and which of them the
    tokenizer config names (bos / eos / pad) and generation_config lists as eos."""

    name: str
    specials: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    stop: tuple[str, ...] = ()  # generation_config.json eos_token_id besides `eos`
    turn_end: str = ""          # the token that ends an assistant turn ("" = `eos`)
    extra: dict = field(default_factory=dict)
    named: tuple[str, ...] = ()  # further named templates, in tests/templates/{name}_{named}.jinja

    @property
    def template(self) -> str:
        return (TEMPLATES / f"{self.name}.jinja").read_text(encoding="utf-8")

    @property
    def templates(self) -> str | dict[str, str]:
        """The template, or transformers' named templates (``default`` and the others)."""
        if not self.named:
            return self.template
        return {"default": self.template, **{n: (TEMPLATES / f"{self.name}_{n}.jinja").read_text(encoding="utf-8")
                                             for n in self.named}}


CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                   "<tool_response>", "</tool_response>")
DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<｜▁pad▁｜>")
CONVENTIONS = {c.name: c for c in (
    Convention("qwen3", CHATML_SPECIALS + ("<think>", "</think>"), eos="<|im_end|>", pad="<|endoftext|>",
               stop=("<|endoftext|>",)),
    Convention("chatml", CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>"),
    Convention("llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
               eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
               stop=("<|end_of_text|>", "<|eom_id|>")),
    Convention("mistral", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
               eos="</s>", pad="<unk>", bos="<s>"),
    Convention("deepseek_v3", ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                               "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                               "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                               "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                               "<｜▁pad▁｜>"),
               eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>", bos="<｜begin▁of▁sentence｜>"),
    # Gemma's tokenizer names <eos> as eos; the turn ends with <end_of_turn>, which generation_config lists.
    Convention("gemma", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
               eos="<eos>", pad="<pad>", bos="<bos>", stop=("<end_of_turn>",), turn_end="<end_of_turn>"),
    Convention("deepseek_v31", DEEPSEEK_SPECIALS + ("<think>", "</think>"), eos="<｜end▁of▁sentence｜>",
               pad="<｜▁pad▁｜>", bos="<｜begin▁of▁sentence｜>"),
    Convention("r1_distill", DEEPSEEK_SPECIALS + ("<think>", "</think>"), eos="<｜end▁of▁sentence｜>",
               pad="<｜▁pad▁｜>", bos="<｜begin▁of▁sentence｜>"),
    Convention("qwen3_coder", CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", stop=("<|endoftext|>",)),
    Convention("kimi_k2", ("[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                           "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[PAD]"),
               eos="<|im_end|>", pad="[PAD]", stop=("[EOS]",)),
    # gpt-oss (harmony): <|return|> ends a final answer, <|call|> a call's turn; both are eos in generation_config.
    Convention("gpt_oss", ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                           "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
               eos="<|return|>", pad="<|endoftext|>", bos="<|startoftext|>", stop=("<|endoftext|>", "<|call|>")),
    # GLM-4.5: nothing closes a reply; the model generates the next turn's <|user|> / <|observation|>.
    Convention("glm45", ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                         "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                         "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"),
               eos="<|endoftext|>", pad="<|endoftext|>", stop=("<|user|>", "<|observation|>")),
    # Gemma 4: <turn|> ends a turn (generation_config lists it beside <eos>); <|"|> delimits strings in calls.
    Convention("gemma4", ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                          "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
                          "<|think|>"),
               eos="<eos>", pad="<pad>", bos="<bos>", stop=("<turn|>",), turn_end="<turn|>"),
    # Hermes-3 ships named templates: `default` (no tools) and `tool_use`.
    Convention("hermes3", CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", named=("tool_use",)),
)}


def write_convention_dir(path: Path, convention: Convention, *, seed: int = 0) -> Path:
    """`save_pretrained` of a random-init dense Qwen3 and of a tokenizer in ``convention``."""
    import transformers

    tok = train_tokenizer(convention.specials)
    ids = {t: tok.token_to_id(t) for t in convention.specials}
    write_model(path, moe=False, seed=seed, eos_token_id=ids[convention.eos], pad_token_id=ids[convention.pad],
                generation_eos=[ids[convention.eos]] + [ids[t] for t in convention.stop])
    special = {"eos_token": convention.eos, "pad_token": convention.pad}
    if convention.bos:
        special["bos_token"] = convention.bos
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=convention.templates,
                                                  **special)
    hf_tok.save_pretrained(path)
    return path


if __name__ == "__main__":  # python tests/template_models.py CONVENTION DIR: a directory to try check-template on
    import sys

    out = write_convention_dir(Path(sys.argv[2]), CONVENTIONS[sys.argv[1]])
    print(f"wrote a random-init Qwen3 with a {sys.argv[1]}-convention tokenizer and chat template to {out}")
