"""Hugging Face checkpoints written by `transformers` itself, for the "bring your own model" tests.

Nothing is downloaded: a tiny random-init Qwen3 / Qwen3-MoE from a config, and a tokenizer trained
here with the `tokenizers` library that differs from AxRL's shipped one on purpose — another
vocabulary size, no one-digit-per-token rule, special tokens at the *end* of the vocabulary (as in
Qwen checkpoints, so their ids differ from AxRL's 0..6), a model vocabulary padded past the
tokenizer's, eos ids in generation_config.json — and a Qwen-style chat template (tools in the
system block, `<tool_call>` JSON blocks, consecutive tool results merged into one user block,
reasoning stripped from earlier turns).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from axrl.tokenizer import corpus

BPE_VOCAB = 420          # learned tokens; the special tokens come after them
MODEL_VOCAB = 448        # padded, as Qwen pads 151 669 tokens to 151 936 rows
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<think>", "</think>")

# Modelled on Qwen3's template (structure, tags and whitespace), without its date/ multimodal parts.
QWEN_STYLE_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def train_tokenizer(specials: tuple[str, ...] = SPECIALS) -> Tokenizer:
    """A byte-level BPE unlike AxRL's: GPT-2 style pre-tokenisation, ``specials`` appended last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.generate(3000, seed=7), trainer=trainer, length=3000)
    tok.add_special_tokens(list(specials))
    return tok


def write_model(path: Path, *, moe: bool, seed: int, eos_token_id: int, pad_token_id: int,
                generation_eos: list[int]) -> None:
    """`save_pretrained` of a random-init Qwen3(-MoE) (config.json, weights, generation_config.json)."""
    import transformers

    common = dict(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)
    if moe:
        config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(tie_word_embeddings=True, **common)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=generation_eos, pad_token_id=pad_token_id)
    model.save_pretrained(path)


def write_checkpoint(path: Path, *, moe: bool = True, seed: int = 0) -> Path:
    """`save_pretrained` of a random-init Qwen3(-MoE) and of its tokenizer, into ``path``."""
    import transformers

    tok = train_tokenizer()
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    write_model(path, moe=moe, seed=seed, eos_token_id=im_end, pad_token_id=eot, generation_eos=[im_end, eot])
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>", chat_template=QWEN_STYLE_TEMPLATE)
    hf_tok.save_pretrained(path)
    return path


if __name__ == "__main__":  # python tests/hf_checkpoint.py DIR [--dense]: a checkpoint to try things on
    import sys

    out = write_checkpoint(Path(sys.argv[1]), moe="--dense" not in sys.argv[2:])
    print(f"wrote a random-init {'Qwen3' if '--dense' in sys.argv[2:] else 'Qwen3-MoE'} checkpoint to {out}")
