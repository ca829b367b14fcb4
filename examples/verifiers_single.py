"""A single-turn `verifiers` (0.4) environment, written with the library's own classes only.

Addition questions; the rubric is two `@vf.reward` components (a correct sum, weight 1; a short
reply, weight 0.1) and one `@vf.metric`. Nothing here knows AxRL: `vf-eval`-style evaluation and
AxRL's training (examples/verifiers_single.yaml) load the same `load_environment()`.

verifiers imports a taskset by its top-level module name, so this file's folder must be on the
import path (AxRL puts it there for `data.task_args.environment: examples/verifiers_single.py:...`).
"""

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: int


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply's last number is the sum."""
        words = [w.strip(".,!?") for w in (trace.last_reply or "").split()]
        numbers = [w for w in words if w.lstrip("-").isdigit()]
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        """A small bonus for a reply of at most 8 words."""
        return float(len((trace.last_reply or "").split()) <= 8)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 24
    max_operand: int = 9


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        n, hi = self.config.num_tasks, self.config.max_operand + 1
        return [AdditionTask(AdditionData(idx=i, prompt=f"What is {i % hi} + {i // hi % hi}?",
                                          system_prompt="Answer with the number only.",
                                          answer=i % hi + i // hi % hi), self.config.task)
                for i in range(n)]


__all__ = ["AdditionTaskset", "load_environment"]


def load_environment(num_tasks: int = 24) -> vf.Env:
    """The environment: this taskset, one agent on the tool-less chat harness in a local subprocess."""
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig.model_validate({
        "taskset": {"id": __name__, "num_tasks": num_tasks},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    }))
