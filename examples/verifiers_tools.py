"""A multi-turn tool-using `verifiers` (0.4) environment, written with the library's own classes only.

The model may call the `calc_add` tool (a `vf.Toolset` served over MCP, shared by the taskset's
rollouts) as often as it likes, then answers; the chat harness loops while the model calls tools.
The rubric: a correct final answer (weight 1) and `used_tool` (weight 0.2, the trace shows a tool
call). `@vf.stop` ends an episode after 4 model turns. Nothing here knows AxRL.

Run as `python -m verifiers_tools` the module serves the toolset (how verifiers starts it).
"""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(int(a) + int(b))


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or "").split())

    @vf.reward(weight=0.2)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.tool_calls for m in trace.assistant_messages))

    @vf.stop
    async def four_turns(self, trace: vf.Trace) -> bool:
        return len(trace.assistant_messages) >= 4


class SumConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        triples = [(a, b, c) for a in range(2, 6) for b in range(3, 7) for c in (1, 4)]
        return [SumTask(SumData(idx=i, prompt=f"Use the add tool to compute {a} + {b} + {c}, then reply with the sum.",
                                answer=a + b + c), self.config.task)
                for i, (a, b, c) in enumerate(triples)]

    @classmethod
    def toolsets(cls, config: SumConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]


__all__ = ["SumTaskset", "load_environment"]


def load_environment() -> vf.Env:
    """The environment: this taskset, one agent on the chat harness (tools over MCP), locally."""
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig.model_validate({
        "taskset": {"id": __name__},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    }))


if __name__ == "__main__":
    AddToolset.run()
