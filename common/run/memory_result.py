"""What a memory plan is (common/run/memory_plan.py makes it): items x phases, per pipeline stage, and its
verdicts against the GPU and the node (problems, host_problems), which common/run/memory_check.py prints and
refuses on."""

from dataclasses import dataclass, field

GB = 1e9
WARN_AT = 0.95  # a phase above this share of the GPU is warned about; above 1.0 refused
# Host memory of a process besides the pinned buffers (python, torch, CUDA's host side, vLLM):
# an estimate, counted in the node's total but not in what is refused.
PROCESS_HOST = 3.0 * GB


@dataclass
class Item:
    """One line of the plan: bytes on the device per phase, pinned host bytes (held in every
    phase), host bytes only while a checkpoint is being saved. torch: allocated through torch's
    caching allocator (the fragmentation slack applies), not the engine's own or fixed memory."""

    name: str
    device: dict = field(default_factory=dict)
    host: float = 0.0
    host_save: float = 0.0
    torch: bool = True


@dataclass
class StagePlan:
    stage: int
    items: list

    def total(self, phase):
        return sum(item.device.get(phase, 0) for item in self.items)

    @property
    def host(self):
        return sum(item.host for item in self.items)

    @property
    def host_save(self):
        return sum(item.host_save for item in self.items)


@dataclass
class Plan:
    """A run's memory per rank (the fullest pipeline stage's in `shown`, every stage's in
    `stages`), the device and node it is planned for, and what was derived."""

    stages: list
    phases: tuple  # PHASES, or TURN_PHASES (PPO's critic and actor updating in turn)
    device_bytes: float | None  # per GPU; None: a CPU run (the phases are then host memory)
    node_bytes: float | None  # host memory per node; None: unknown
    ranks_per_node: int
    engine_share: float | None  # the engine's fraction of the GPU (given or derived), None: no vLLM engine
    engine_share_derived: bool
    kv_tokens: int  # tokens the engine's KV cache holds on one rank (0: none)
    max_model_len: int

    @property
    def on_gpu(self):
        return self.device_bytes is not None

    @property
    def capacity(self):
        """What each phase must fit in: a GPU, or for a CPU run the node's memory over its ranks (0: unknown)."""
        return self.device_bytes if self.on_gpu else (self.node_bytes or 0) / self.ranks_per_node

    @property
    def shown(self):
        return max(self.stages, key=lambda s: max(s.total(p) for p in self.phases))

    def total(self, phase):
        return self.shown.total(phase)

    @property
    def host_stage(self):
        """The pipeline stage that pins the most host memory (at a save included): the host checks count
        every rank of a node as this one (the stages a node holds are not known from the flags)."""
        return max(self.stages, key=lambda s: (s.host + s.host_save, s.host))

    def host_parts(self):
        """This rank's pinned host memory in common/run/host_memory.py check_host_memory's form."""
        items = self.host_stage.items
        staging = sum(i.host for i in items if i.name.startswith("checkpoint staging"))
        return {"offload buffers": sum(i.host for i in items) - staging, "checkpoint staging": staging}

    def problems(self):
        """[(level, phase, the fullest stage in it)]: "refuse" where a phase is over the device (a CPU
        run: over a node's memory / its ranks) or the engine's KV cache cannot hold one sequence
        ("kv cache"), "warn" above WARN_AT of the device."""
        found, capacity = [], self.capacity
        if capacity:
            for phase in self.phases:
                stage = max(self.stages, key=lambda s: s.total(phase))
                need = stage.total(phase)
                if need > capacity or need > WARN_AT * capacity:
                    found.append(("refuse" if need > capacity else "warn", phase, stage))
        if self.engine_share is not None and self.kv_tokens < self.max_model_len:  # not one sequence's KV cache
            found.append(("refuse", "kv cache", self.shown))
        return found

    def host_problems(self):
        """[(level, what, need, have)] for a node: pinned memory (and at a save the optimizer gather)
        against its RAM (refused as the run would be killed), with the processes' own (warned)."""
        if not self.on_gpu or self.node_bytes is None:
            return []
        n, have = self.ranks_per_node, self.node_bytes
        stage = self.host_stage
        pinned, at_save = n * stage.host, n * (stage.host + stage.host_save)
        everything = at_save + n * PROCESS_HOST
        if pinned > have:
            return [("refuse", "pinned", pinned, have)]
        if at_save > have:
            return [("refuse", "save", at_save, have)]
        if everything > WARN_AT * have:
            return [("warn", "processes", everything, have)]
        return []
