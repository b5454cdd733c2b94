"""Where a run's start-up goes: seconds per stage, said in one line before the first step.

    clock = StartupClock()
    engine = make_engine(...); clock.mark("engine")
    model = load_model(); clock.mark("policy")
    ...
    print0(clock.line())      # "start-up N s: engine .., policy .., ..." (seconds)

At 7B a start-up takes minutes (the engine's compile and CUDA graphs, reading the weights, pinning
tens of GB of host memory); the line says which part to look at.
"""

import time


class StartupClock:
    def __init__(self):
        self.started = self._last = time.time()
        self.parts = {}  # stage -> seconds, in the order first marked

    def mark(self, stage):
        """The seconds since the previous mark (or the start) belong to `stage` (added up if repeated)."""
        now = time.time()
        self.parts[stage] = self.parts.get(stage, 0.0) + now - self._last
        self._last = now

    def line(self):
        total = time.time() - self.started
        parts = ", ".join(f"{stage} {seconds:.0f}" for stage, seconds in self.parts.items() if seconds >= 0.5)
        return f"start-up {total:.0f} s" + (f": {parts}" if parts else "")
