"""A verifiers 0.4 taskset (``verifiers.v1``) for examples/rl_verifiers_env.yaml: write digits; the rubric
rewards the share of digits in the reply. Any installed verifiers taskset module works the same way
(``--env.id gsm8k_v1``)."""

import verifiers.v1 as vf


class DigitTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, task, trace) -> float:
        text = trace.last_reply.strip()
        return sum(c.isdigit() for c in text) / max(len(text), 1)


class DigitTaskset(vf.Taskset[DigitTask, vf.TasksetConfig]):
    def load(self):
        for i in range(64):
            yield DigitTask(vf.TaskData(prompt=f"Write some digits ({i}).", name=f"digits-{i}"), self.config.task)


__all__ = ["DigitTaskset"]
