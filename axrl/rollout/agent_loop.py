"""The white-box agent loop: one multi-turn episode as one incrementally built token stream.

The stream is never re-tokenised: the prompt is rendered once, each assistant turn is the
engine's own output ids, and everything in between is the chat template's rendering of the new
messages only (what the template writes after the reply's text, see
:meth:`~axrl.tokenizer.Tokenizer.continuation_ids`). So the ids the trainer sees are exactly the
ids the policy conditioned on. Where the template would render the finished conversation
differently (Qwen3 strips ``<think>`` from earlier turns, Llama trims replies), the difference is
counted in ``Trajectory.drift_tokens`` (recorded, never trained on).

Layout of a trajectory (``turn`` index in brackets, ``*`` = generated, loss_mask 1)::

    [0] prompt messages + <|im_start|>assistant\\n
    [1]* assistant text ... <|im_end|>
    [1] \\n  + observation messages + <|im_start|>assistant\\n      (the env's answer to turn 1)
    [2]* assistant text ... <|im_end|>
    ...

Turn ``i`` is the i-th assistant action followed by the env's reaction to it (turn 0 is the
reset). The stream ends with the last generated token: glue and observations after the final
turn are never appended, since no model reads them.

Finish reasons (``Trajectory.finish_reason``, one of ``axrl.core.outcomes.FINISH_REASONS``):

* ``stop``: the env ended the episode after a complete assistant turn.
* ``length``: the env ended the episode after a turn that hit the per-turn token limit. A
  truncated turn the env does *not* end is closed with a masked ``<|im_end|>`` (the model did
  not generate it) and the episode goes on: the env decides what a cut-off turn is worth.
* ``context``: the stream reached ``max_context_len``; the next segment (glue + observation +
  generation prompt) is appended only whole and only if at least one token of room is left
  for the next turn, so the stream never exceeds the limit and never ends in partial glue.
  A prompt that alone does not fit is cut at the limit (``info["prompt_truncated"]``).
* ``max_turns``: ``max_turns`` assistant turns were generated and the env had not ended.
* ``abort``: the engine aborted a request; the partial turn is kept, the env is not stepped.
* ``failed``: the env raised (in reset, step or as a malformed observation): ``status`` is
  "failed", ``error`` holds the traceback tail, ``reward`` is 0. The trajectory is still
  returned; env errors never propagate. Engine errors do (a broken engine is not an episode
  outcome).
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Callable

import numpy as np

from axrl.agents.env import Env, Message, Prompt, env_action
from axrl.core.token_stream import (append_generated, assistant_close_ids, drift_tokens, reply_glue, routing_rows,
                                    token_versions)
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from axrl.inference.sampling import derive_seed
from axrl.tokenizer import Tokenizer

ERROR_TAIL_CHARS = 2000  # enough for the failing frames, small enough for a trace attribute


async def run_episode(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    env: Env,
    prompt: Prompt,
    *,
    sample_id: int,
    group_id: int,
    sampling: SamplingParams,
    max_turns: int,
    max_context_len: int,
    return_routing: bool = False,
) -> Trajectory:
    """Run one episode of ``env`` on ``prompt`` with ``engine`` and return its trajectory.

    ``sampling.max_new_tokens`` is the per-turn limit; each request asks for
    ``min(per-turn limit, room left in max_context_len)``. ``sampling.seed`` is the sample's
    seed; turn ``i`` samples with a seed derived from it and ``i`` (see :func:`turn_seed`).
    With ``return_routing`` the trajectory's ``routed_experts`` has one row per token (rows the
    model never computed, i.e. the last token and anything after the last request, are zeros);
    it stays None for a dense model or when no request ran. The reward is the sum of the env's
    step rewards. See the module docstring for the layout and the finish reasons.
    """
    if max_turns < 1 or max_context_len < 1 or sampling.max_new_tokens < 1:
        raise ValueError(f"need max_turns >= 1, max_context_len >= 1 and max_new_tokens >= 1; got "
                         f"{max_turns}, {max_context_len}, {sampling.max_new_tokens}")
    traj = Trajectory(sample_id=sample_id, group_id=group_id, prompt_id=prompt.prompt_id)
    routing: list[np.ndarray] = []  # row chunks in stream order; their total = rows already held
    reward = 0.0
    try:
        conversation, prompt_ids = opening(tokenizer, env, prompt)
    except Exception as exc:
        return _failed(traj, exc, routing, [])
    traj.info["messages"] = conversation
    if not _append_prompt(traj, prompt_ids, max_context_len):
        return _finish(traj, "context", 0.0, routing)  # no reply: nothing can drift
    _check_close(tokenizer)
    tools = env.tools or None

    def drift() -> int:  # what the template would render for the finished chat, against the stream
        rendered = tokenizer.apply_chat_template(conversation, tools=tools)
        return drift_tokens(traj.token_ids.tolist(), list(rendered))

    for turn in range(1, max_turns + 1):
        request = _turn_request(traj, routing, sampling, turn, max_context_len=max_context_len,
                                return_routing=return_routing, sticky_key=f"{group_id}:{sample_id}")
        result = await engine.generate(request)
        # Resumed after weight updates (partial_rollout: recompute), see axrl.rollout.episode_engine.
        traj.continuations += int(result.meta.get("continuations", 0))
        _append_generated(traj, result, turn)
        _collect_routing(routing, request, result)
        traj.num_turns = turn
        if result.finish_type == "abort":
            return _finish(traj, "abort", reward, routing)  # the partial reply is in no message

        text, closed = _reply(traj, tokenizer, conversation, result.output_ids)
        truncated = result.finish_type == "length"
        try:
            outcome = env.step(env_action(tokenizer, text))
            reward += float(outcome.reward)
            traj.turn_rewards.append(float(outcome.reward))  # kept per turn for algo.credit: turn
            traj.info["env_info"] = outcome.info
            if outcome.done:
                # A turn cut by the context limit filled the stream exactly.
                reason = ("context" if traj.num_tokens >= max_context_len else "length") if truncated else "stop"
                return _finish(traj, reason, reward, routing, drift)
            segment = _observation_segment(tokenizer, conversation, outcome.observation, tools, closed)
        except Exception as exc:
            return _failed(traj, exc, routing, conversation)
        if turn == max_turns:
            return _finish(traj, "max_turns", reward, routing, drift)
        if traj.num_tokens + len(segment) >= max_context_len:
            return _finish(traj, "context", reward, routing, drift)
        traj.append(segment, generated=False, turn=turn)
        conversation.extend(outcome.observation)
    raise AssertionError("unreachable: the last turn returns max_turns")


def _reply(traj: Trajectory, tokenizer: Tokenizer, conversation: list[Message], out: list[int]) -> tuple[str, bool]:
    """The turn's reply as text (and whether the model closed its own turn), appended to the
    conversation with its calls structured as the template writes them; its reasoning (the
    family's parser: `<think>`, harmony's analysis channel) kept per turn in `traj.info`.

    The model closed its turn when its last id is a stop token the template ends replies with
    (`Tokenizer.reply_close_ids`: `<|im_end|>`; gpt-oss's `<|call|>`; GLM-4.5's next-turn
    `<|user|>` / `<|observation|>`); a stop token the template never writes there (Qwen's
    `<|endoftext|>`) leaves the turn open, and the template's close is appended masked."""
    closed = bool(out) and out[-1] in tokenizer.reply_close_ids
    text = tokenizer.decode(out[:-1] if closed else out)  # keep <tool_call> tags
    conversation.append(tokenizer.reply_message(text))
    traj.info.setdefault("reasoning", []).append(tokenizer.split_reasoning(text)[0])
    return text, closed


def opening(tokenizer: Tokenizer, env: Env, prompt: Prompt) -> tuple[list[Message], list[int]]:
    """An episode's start: `env`'s reset messages for `prompt` and their rendering, up to the
    assistant's generation prompt (what the first request sends)."""
    conversation = list(env.reset(prompt))
    return conversation, list(tokenizer.apply_chat_template(conversation, tools=env.tools or None,
                                                            add_generation_prompt=True))


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Sampling seed of turn ``turn`` (1-based) of a sample seeded ``seed``; None stays None.

    Distinct turns must not share a seed (a repeated seed on similar logits repeats tokens), and
    samples must not collide on nearby turns, hence a real mix (the engine's splitmix64) rather
    than seed + turn.
    """
    return None if seed is None else derive_seed(int(seed), int(turn))


def _append_prompt(traj: Trajectory, prompt_ids: list[int], max_context_len: int) -> bool:
    """Append the rendered prompt as turn 0; False when it leaves no room to generate (it is then
    cut at the limit, ``info["prompt_truncated"]`` says whether anything was cut)."""
    if len(prompt_ids) >= max_context_len:  # not even one token of room to generate
        traj.append(prompt_ids[:max_context_len], generated=False, turn=0)
        traj.prompt_len = traj.num_tokens
        traj.info["prompt_truncated"] = len(prompt_ids) > max_context_len
        return False
    traj.append(prompt_ids, generated=False, turn=0)
    traj.prompt_len = len(prompt_ids)
    return True


def _check_close(tokenizer: Tokenizer) -> None:
    """The template must end an assistant message with a stop token, or write nothing after it and
    let the next turn's opening (a stop token: GLM-4.5's `<|user|>`) end it: the loop tells a turn
    the model ended itself by its last id, and closes a cut one with that id, masked."""
    ids = assistant_close_ids(tokenizer) or [tokenizer.eos_token_id]
    if ids[0] not in tokenizer.stop_token_ids:
        raise ValueError("chat template must close an assistant message with a stop token (it writes "
                         f"{tokenizer.decode(ids[:8])!r})")


def _observation_segment(tokenizer: Tokenizer, conversation: list[Message], observation: list[Message],
                         tools: list[dict] | None, closed: bool) -> list[int]:
    """What follows a reply in the stream: its close (the end-of-turn token only when the model did
    not write it, ``closed``), the observation and the next generation prompt, as the template
    renders them after the reply's text in the whole conversation."""
    continuation = tokenizer.continuation_ids(conversation, list(observation), tools)
    # The close is a special token (the turn end; gpt-oss's <|end|> in history; GLM's <|observation|>):
    # a model's close stands in for it, so only a special token may be dropped.
    if not continuation or continuation[0] not in tokenizer.special_token_ids:
        raise ValueError("the chat template does not close a reply followed by this observation with a "
                         f"special token (it writes {tokenizer.decode(continuation[:8])!r})")
    return reply_glue(continuation, closed)


def _turn_request(traj: Trajectory, routing: list[np.ndarray], sampling: SamplingParams, turn: int, *,
                  max_context_len: int, return_routing: bool, sticky_key: str) -> GenerateRequest:
    """The request of turn ``turn``: the whole stream so far, asking for at most the room left."""
    room = max_context_len - traj.num_tokens  # >= 1: segments are appended only if they leave room
    return GenerateRequest(
        input_ids=traj.token_ids.tolist(),  # whole stream: the engine keeps no prefix cache
        sampling_params=dataclasses.replace(
            sampling, max_new_tokens=min(sampling.max_new_tokens, room),
            seed=turn_seed(sampling.seed, turn)),
        return_logprob=True,
        return_routed_experts=return_routing,
        routed_experts_start_len=sum(len(chunk) for chunk in routing),
        sticky_key=sticky_key,  # one server per episode: its prefix stays cached
    )


def _append_generated(traj: Trajectory, result: GenerateResult, turn: int) -> None:
    """Append one turn's output with its logprobs and per-token weight versions (these differ
    within a turn when weights were updated mid-request)."""
    ids, logprobs = list(result.output_ids), list(result.output_logprobs)
    if len(logprobs) != len(ids):
        raise RuntimeError(f"engine returned {len(logprobs)} logprobs for {len(ids)} output tokens "
                           f"(request {result.rid})")
    versions = token_versions(result.output_weight_versions, result.weight_version, len(ids))
    append_generated(traj, ids, logprobs, versions, turn=turn)


def _collect_routing(routing: list[np.ndarray], request: GenerateRequest, result: GenerateResult) -> None:
    """Keep the new routing rows; check they continue exactly where the held rows stop."""
    rows, held = result.routed_experts, request.routed_experts_start_len
    if not request.return_routed_experts or rows is None:
        return
    expected = len(request.input_ids) + len(result.output_ids) - 1 - held
    if rows.shape[0] != expected:
        raise RuntimeError(f"engine returned {rows.shape[0]} routing rows, expected {expected} "
                           f"(request {result.rid}, start_len {held})")
    if routing and rows.shape[1:] != routing[0].shape[1:]:
        raise RuntimeError(f"routing shape changed from {routing[0].shape[1:]} to {rows.shape[1:]}")
    routing.append(np.asarray(rows, dtype=np.int32))


def _finish(traj: Trajectory, reason: str, reward: float, routing: list[np.ndarray],
            drift: Callable[[], int] | None = None) -> Trajectory:
    if drift is not None:
        traj.drift_tokens = drift()
    traj.finish_reason = reason
    traj.reward = reward
    if routing:
        traj.routed_experts = routing_rows(routing, traj.num_tokens)
    traj.check()
    return traj


def _failed(traj: Trajectory, exc: BaseException, routing: list[np.ndarray],
            conversation: list[Message]) -> Trajectory:
    traj.status = "failed"
    # The first line survives even when the traceback tail is cut.
    tail = "".join(traceback.format_exception(exc))[-ERROR_TAIL_CHARS:]
    traj.error = f"{type(exc).__name__}: {exc}\n{tail}"
    traj.info["messages"] = conversation
    traj.turn_rewards = []   # a failed episode is scored 0, per turn too
    return _finish(traj, "failed", 0.0, routing)

