"""The adaptation policy of test_torch_policies: asks for 2 replicas, then for 1, then
stops training; logs what every worker saw to $LOG_DIR/<worker>.jsonl."""

import json
import os

from pollux_launch.elastic import AdaptationPolicy, PolicyContext


class Probe(AdaptationPolicy):
    def __init__(self) -> None:
        self.phase = "grow"  # grow -> shrink -> stop: travels to newcomers with the state
        self.since = 0  # the step this phase began
        path = os.path.join(os.environ["LOG_DIR"], os.environ["POLLUX_WORKER_ID"] + ".jsonl")
        self._log = open(path, "a", buffering=1)

    def _write(self, **record: object) -> None:
        self._log.write(json.dumps(record) + "\n")

    def on_rescale(self, ctx: PolicyContext) -> None:
        if ctx.detached:
            self._write(ev="detached", step=ctx.step, prev=ctx.previous_world_size)
            return
        total = ctx.allreduce(ctx.rank + 1, "sum")  # over the new group
        self._write(ev="rescale", step=ctx.step, prev=ctx.previous_world_size,
                    world=ctx.world_size, rank=ctx.rank, total=total)
        if self.phase == "grow" and ctx.world_size == 2:
            self.phase, self.since = "shrink", ctx.step
        elif self.phase == "shrink" and ctx.world_size == 1:
            self.phase, self.since = "stop", ctx.step

    def after_step(self, ctx: PolicyContext) -> None:
        self._write(ev="step", step=ctx.step, world=ctx.world_size, rank=ctx.rank,
                    batch=ctx.batch_size, phase=self.phase)
        if self.phase == "grow" and ctx.step >= 3:
            ctx.request_replicas(2)
        elif self.phase == "shrink" and ctx.step >= self.since + 8:
            ctx.request_replicas(1)
        elif self.phase == "stop" and ctx.step >= self.since + 4:
            ctx.stop()

    def state_dict(self) -> dict:
        return {"phase": self.phase, "since": self.since}

    def load_state_dict(self, state: dict) -> None:
        self.phase, self.since = state["phase"], state["since"]
