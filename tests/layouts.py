"""Several parallel layouts in one torchrun launch, for the test workers (parity_worker.py,
packing_worker.py, attention_worker.py, critic_worker.py): each torchrun start-up costs seconds
of imports on the CI's two cores.

    torchrun ... tests/WORKER.py BASE_FLAGS --layouts '{"tp2": ["--tp", "2"], ...}' --out R.json

runs run(parse(BASE_FLAGS + flags)) for each layout, one after the other (the worker's
init_distributed makes megatron's groups again for each), and rank 0 writes {name: result};
without --layouts, one layout from the flags and R.json holds its result alone.
"""

import json
import sys


def main(parse, run):
    import torch.distributed as dist

    from common.run.dist import destroy_distributed

    argv = sys.argv[1:]
    at = argv.index("--out")
    out, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    if "--layouts" in argv:
        at = argv.index("--layouts")
        layouts, base = json.loads(argv[at + 1]), argv[:at] + argv[at + 2 :]
        results = {name: run(parse(base + [str(f) for f in flags])) for name, flags in layouts.items()}
    else:
        results = run(parse(argv))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    # (without it a PP=2 run once aborted at exit after writing its results: "terminate called
    # without an active exception", the process group's threads still up)
    destroy_distributed()
