"""Check AxRL against vendors' published chat templates, which the repository does not hold.

    python bench/check_published_templates.py DIR

DIR holds the templates as published (e.g. copies of llama.cpp's models/templates/ or of the
vendors' tokenizer_config.json "chat_template"), one per file, named FAMILY.jinja or
FAMILY--ANYTHING.jinja, FAMILY being a convention of tests/template_models.py (qwen3_coder,
deepseek_v3, kimi_k2, gemma4, glm45, …: it gives the special tokens the template's tokenizer
holds). For each template this builds a random-init model directory with that tokenizer and the
published template, and checks, with `transformers`' `apply_chat_template` as the oracle:

- load: AxRL loads the directory (or refuses it, quoting why), and what it read off the template;
- render: the same text and ids for conversations with and without tools, calls, results,
  reasoning and a new question, with and without the generation prompt;
- parse: a reply with N calls, as the template writes it, parses back to the same N calls (two,
  or one where the template allows one); a call after a reasoning block parses as one call; a
  call with boolean, object, integer, array and numeric-looking string values parses back to the
  same values, typed by the tool's schema;
- tools_shown: whether the tools' schemas reach the prompt at all;
- stream: whether the agent loop's token stream (each reply, then the template's continuation for
  the observation) is the template's rendering of the whole conversation ("exact"), or where the
  template re-renders history (recorded as drift in a run);
- check-template: `axrl model check-template` exits 0 or 2, never with a traceback.

It prints one line per template and ends with one JSON line
{"templates": N, "loaded": N, "render_equal": N, "parse_ok": N, "check_template_ok": N, "failures": [...]}.
Nothing is downloaded; the templates' text is never copied into the repository.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the conventions' special tokens and directory writer
sys.path.insert(0, str(ROOT))

from template_models import CONVENTIONS, write_convention_dir  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ARGS = [{"expression": "37 + 58"}, {"expression": "2 * 3"}]
RESULTS = ["95", "6"]
# Values of every JSON kind: a template that writes them its own way (Qwen3-Coder's Python `str`)
# must still parse back to the same arguments, typed by this schema.
TYPED = {"expression": "95", "exact": True, "options": {"digits": 2, "mode": "x"}, "n": 3, "xs": [1, "x"]}
TYPED_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}, "exact": {"type": "boolean"},
                                     "options": {"type": "object"}, "n": {"type": "integer"}, "xs": {"type": "array"}}}}}]


def build(template: Path, family: str, out: Path) -> Path:
    """A model directory in ``family``'s convention whose chat template is ``template`` as published."""
    d = write_convention_dir(out, CONVENTIONS[family])
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in ("chat_template.json",):
        (d / extra).unlink(missing_ok=True)
    shutil.rmtree(d / "additional_chat_templates", ignore_errors=True)
    (d / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    return d


def conversations(tok: Any, n: int) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(messages, tools) to render: a plain chat, an agent episode with ``n`` calls and results, a
    reasoning answer and a new question, and its prefixes."""
    plain = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi ✓"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"}]
    out: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [(plain, None), (plain[:2], None)]
    if n:
        call = {"role": "assistant", "content": "",
                "tool_calls": [tok.tool_call_message("calculator", a, k + 1) for k, a in enumerate(ARGS[:n])]}
        results = [{"role": "tool", "tool_call_id": c.get("id", f"call_{k + 1}"), "content": RESULTS[k]}
                   for k, c in enumerate(call["tool_calls"])]
        episode = [plain[0], {"role": "user", "content": "What is 37 + 58?"}, call, *results,
                   {"role": "assistant", "content": "<think>\nadd\n</think>\n\nThe answer is 95."},
                   {"role": "user", "content": "And 1 + 1?"}]
        out += [(episode, TOOLS), (episode[:3 + n], TOOLS), (episode[:2], TOOLS)]
    return out


def render_equal(tok: Any, hf: Any, cases: list) -> str | None:
    """None when AxRL renders every case as transformers does (text and ids), else the first difference."""
    for messages, tools in cases:
        for gen in (False, True):
            try:
                theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
            except Exception as e:  # noqa: BLE001 — the template refuses this shape: AxRL must too
                theirs = f"<raises {type(e).__name__}>"
            try:
                ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
            except Exception as e:  # noqa: BLE001
                ours = f"<raises {type(e).__name__}>"
            if ours != theirs:
                k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                return f"{len(messages)} messages, gen={gen}: AxRL {ours[k:k + 40]!r} vs {theirs[k:k + 40]!r}"
            if not ours.startswith("<raises") and tok.encode(ours) != hf.encode(theirs, add_special_tokens=False):
                return f"{len(messages)} messages, gen={gen}: same text, different ids"
    return None


def parse_ok(tok: Any, n: int) -> str | None:
    """None when a reply with ``n`` calls (and a call after reasoning) parses back, else what broke."""
    if not n:
        return None
    message = {"role": "assistant", "content": "",
               "tool_calls": [tok.tool_call_message("calculator", a, k + 1) for k, a in enumerate(ARGS[:n])]}
    text = tok.reply_text(message)
    got = [(c["name"], c["arguments"], c["error"]) for c in tok.parse_tool_calls(text)]
    if got != [("calculator", a, None) for a in ARGS[:n]]:
        return f"{n} calls written as {text!r} parse as {got}"
    if tok.reasoning_parser == "think":
        one = tok.reply_text({**message, "tool_calls": message["tool_calls"][:1]})
        after = "<think>\nI add them.\n</think>\n\n" + one.split("</think>")[-1].lstrip("\n")
        got = [(c["name"], c["arguments"]) for c in tok.parse_tool_calls(after)]
        if got != [("calculator", ARGS[0])]:
            return f"a call after reasoning {after!r} parses as {got}"
    typed = tok.reply_text({**message, "tool_calls": [tok.tool_call_message("calculator", TYPED, 1)]})
    got = [(c["name"], c["arguments"]) for c in tok.parse_tool_calls(typed, tools=TYPED_TOOLS)]
    if got != [("calculator", TYPED)]:
        return f"typed values written as {typed!r} parse as {got}"
    return None


def calls_per_turn(tok: Any) -> int:
    """2 where the template renders two calls in one turn, 1 where it refuses that, 0 when tool-free."""
    if tok.tool_free or (tok.tool_parser is None and tok.tool_call_format is None):
        return 0
    two = {"role": "assistant", "content": "",
           "tool_calls": [tok.tool_call_message("calculator", a, k + 1) for k, a in enumerate(ARGS)]}
    try:
        tok.apply_chat_template([{"role": "user", "content": "q"}, two], tools=TOOLS, tokenize=False)
    except Exception:  # noqa: BLE001 — "only supports single tool-calls"
        return 1
    return 2


def check(template: Path, work: Path) -> dict[str, Any]:
    """Every check on one published template; the row printed for it."""
    import transformers

    from axrl.tokenizer import load_tokenizer

    family = template.stem.split("--")[0]
    row: dict[str, Any] = {"template": template.name, "family": family}
    d = build(template, family, work / template.stem)
    try:
        with warnings.catch_warnings(record=True) as caught:  # the loader's incremental-rendering check
            warnings.simplefilter("always")
            tok = load_tokenizer(d)
    except ValueError as e:
        row["load"] = f"refused: {e}"
        return row
    # "exact": the agent loop's stream (reply, then each observation's continuation) is the template's
    # own rendering of the whole conversation; otherwise the loader's warning says where it re-renders.
    drift = [str(w.message).split(": ", 1)[-1] for w in caught if "re-renders history" in str(w.message)]
    n = calls_per_turn(tok)
    row.update(load="ok", turn_end=tok.eos_token, tool_parser=tok.tool_parser.name if tok.tool_parser else None,
               reasoning_parser=tok.reasoning_parser, arguments=tok.arguments_form, calls_per_turn=n,
               stream="exact" if not drift else f"drift ({drift[0][:160]})")
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    row["tools_shown"] = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False) != \
        tok.apply_chat_template(chat, tokenize=False)  # DeepSeek-V3's templates never render `tools`
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    row["render"] = render_equal(tok, hf, conversations(tok, n)) or "equal"
    try:
        row["parse"] = parse_ok(tok, n) or ("ok" if n else "tool-free")
    except Exception as e:  # noqa: BLE001 — reported, the check goes on
        row["parse"] = f"{type(e).__name__}: {e}"
    proc = subprocess.run([sys.executable, "-m", "axrl.cli", "model", "check-template", str(d)],
                          capture_output=True, text=True, cwd=ROOT)
    out = proc.stdout + proc.stderr
    row["check_template"] = f"exit {proc.returncode}" + (" TRACEBACK" if "Traceback" in out else "")
    row["verdict"] = out.strip().splitlines()[0] if out.strip() else ""
    return row


def main() -> None:
    """Check every template in the directory given on the command line."""
    templates = sorted(Path(sys.argv[1]).glob("*.jinja"))
    unknown = [t.name for t in templates if t.stem.split("--")[0] not in CONVENTIONS]
    if unknown or not templates:
        sys.exit(f"name templates FAMILY.jinja or FAMILY--NAME.jinja, FAMILY one of {sorted(CONVENTIONS)} "
                 f"(got {unknown or 'none'})")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for t in templates:
            row = check(t, Path(work))
            rows.append(row)
            print(" | ".join(f"{k}: {v}" for k, v in row.items()), flush=True)
    ok = [r for r in rows if r.get("load") == "ok"]
    failures = [r["template"] for r in rows if r.get("load") != "ok" or r.get("render") != "equal"
                or r.get("parse") not in ("ok", "tool-free") or r.get("check_template") not in ("exit 0", "exit 2")]
    print(json.dumps({"templates": len(rows), "loaded": len(ok), "render_equal": sum(r["render"] == "equal" for r in ok),
                      "parse_ok": sum(r["parse"] in ("ok", "tool-free") for r in ok),
                      "check_template_ok": sum(r.get("check_template") in ("exit 0", "exit 2") for r in rows),
                      "failures": failures}))


if __name__ == "__main__":
    main()
