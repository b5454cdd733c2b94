"""Worker of tests/test_offload.py: train a tiny model 3 steps, with and without offloading the
whole training state (params, grad buffers, optimizer) between steps; print JSON.

    python tests/offload_worker.py HF_DIR          (one process)
    torchrun --nproc_per_node 2 tests/offload_worker.py HF_DIR   (DP=2: sharded optimizer)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(hf_dir, dtype, distributed_optimizer, offload):
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import load_hf_weights
    from common.train import schedule
    from common.train.offload import Offloader
    from common.train.setup import setup_training

    spec = load_hf_spec(hf_dir)
    chunks = build_model(spec, dtype=dtype)
    load_hf_weights(chunks, spec, hf_dir)
    model, optimizer, _ = setup_training(chunks, lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    on_gpu = torch.cuda.is_available()  # on a GPU: CUDA memory -> pinned host buffers
    device = torch.device("cuda" if on_gpu else "cpu")
    model_off = Offloader.of_model(model, include_cpu=not on_gpu)
    optim_off = Offloader.of_optimizer(optimizer, model, include_cpu=not on_gpu)
    losses, moved, left, freed_gpu, intact, overlapped = [], [], [], [], [], []
    side = torch.cuda.Stream() if on_gpu else None  # the optimizer's reload copies on it, as the scripts
    if offload:  # as the scripts do: every host buffer (Adam's state created) before the first step
        optim_off.allocate(), model_off.allocate()
        buffers = {id(b) for off in (model_off, optim_off) for b in off._host.values()}
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + mpu.get_data_parallel_rank())
        tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=gen)
        mb = dict(tokens=tokens, positions=torch.arange(16).expand(2, 16), targets=tokens.roll(-1, 1))

        def loss_fn(mb, logits):
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), mb["targets"].flatten())
            return loss, {"loss": loss.detach()}

        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = schedule.run_micro_batches(model, [mb], loss_fn, forward_only=False, device=device)
        optim_off.wait()  # the scripts' before_step: the last reload's copies have landed
        optimizer.step()
        losses.append(float(out[0]["loss"]))
        if offload:
            # the order of train_grpo.py: optimizer + grads first, then the params
            allocated = torch.cuda.memory_allocated() if on_gpu else 0
            optim_off.offload()
            # the weight sync runs here in train_grpo.py: the model must still be whole
            intact.append(all(p.untyped_storage().nbytes() > 0 for p in model[0].parameters()))
            model_off.offload()
            freed_gpu.append(allocated - (torch.cuda.memory_allocated() if on_gpu else 0))
            moved.append(model_off.nbytes + optim_off.nbytes)
            state = [v for s in optimizer_states(optimizer) for v in s.values() if torch.is_tensor(v) and v.dim()]
            left.append(sum(t.untyped_storage().nbytes() for t in list(model[0].parameters()) + state))
            model_off.reload()
            optim_off.reload(stream=side)  # on a GPU: copies queued on `side`, overlapping the next forward/backward
            overlapped.append(optim_off._pending is not None)
    params = torch.cat([p.detach().float().flatten() for p in model[0].parameters()])
    # host buffers an offload had to create after allocate() (each costs a pinning on a GPU)
    late = len({id(b) for off in (model_off, optim_off) for b in off._host.values()} - buffers) if offload else 0
    return dict(
        losses=losses,
        moved=moved,
        left=left,
        params=params.cpu(),
        numel=params.numel(),
        freed_gpu=freed_gpu,
        intact=intact,
        late_buffers=late,
        overlapped=overlapped,
    )


def optimizer_states(optimizer):
    return [s for opt in getattr(optimizer, "chained_optimizers", [optimizer]) for s in opt.optimizer.state.values()]


def main():
    from common.run.dist import init_distributed

    hf_dir = sys.argv[1]
    info = init_distributed()
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        for distributed_optimizer in (True, False):
            plain = train(hf_dir, dtype, distributed_optimizer, offload=False)
            offloaded = train(hf_dir, dtype, distributed_optimizer, offload=True)
            name = f"{str(dtype).split('.')[-1]}_{'distopt' if distributed_optimizer else 'ddp'}"
            result[name] = dict(
                losses=plain["losses"],
                losses_offloaded=offloaded["losses"],
                max_param_diff=float((plain["params"] - offloaded["params"]).abs().max()),
                moved=offloaded["moved"],
                left=offloaded["left"],
                numel=offloaded["numel"],
                freed_gpu=offloaded["freed_gpu"],
                intact=offloaded["intact"],
                late_buffers=offloaded["late_buffers"],
                overlapped=offloaded["overlapped"],
            )
    result["reference"] = frozen_model_roundtrip(hf_dir)
    result["colocation"] = colocation_phases(hf_dir)
    if info.rank == 0:
        print("RESULT " + json.dumps(result))


def frozen_model_roundtrip(hf_dir):
    """A plain (not DDP-wrapped) frozen model, as train_grpo.py's reference: same logits after
    offload + reload, and its storages empty in between."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import load_hf_weights
    from common.train.offload import Offloader

    spec = load_hf_spec(hf_dir)
    chunks = build_model(spec, dtype=torch.float32)
    load_hf_weights(chunks, spec, hf_dir)
    device = next(chunks[0].parameters()).device
    tokens = torch.arange(16, device=device)[None] % spec.vocab_size
    positions = torch.arange(16, device=device)[None]
    with torch.no_grad():
        before = chunks[0](tokens, positions, None)
        off = Offloader.of_model(chunks, include_cpu=not torch.cuda.is_available())
        off.offload()
        left = sum(p.untyped_storage().nbytes() for p in chunks[0].parameters())
        off.reload()
        after = chunks[0](tokens, positions, None)
    return dict(
        equal=bool(torch.equal(before, after)),
        left=left,
        moved=off.nbytes,
        param_bytes=sum(p.numel() * p.element_size() for p in chunks[0].parameters()),
    )


class RecordingEngine:
    """A rollout engine that only records its calls; update_weights consumes the weights."""

    expert_blocks = False

    def __init__(self, on_sync):
        self.calls, self.on_sync = [], on_sync

    def wake_weights(self):
        self.calls.append("wake_weights")

    def update_weights(self, weights):
        self.calls.append("update_weights")
        self.on_sync(list(weights))

    def wake_kv_cache(self):
        self.calls.append("wake_kv_cache")

    def sleep(self):
        self.calls.append("sleep")


def colocation_phases(hf_dir):
    """common/offload.Colocation as the scripts drive it (a policy with Adam, PPO's critic as the
    idle model, a frozen reference; a recording engine): what is on the device in each phase,
    and every tensor the same after its round trip."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import load_hf_weights
    from common.train.offload import Colocation, Timer
    from common.train.setup import setup_training

    spec = load_hf_spec(hf_dir)

    def load():
        chunks = build_model(spec, dtype=torch.bfloat16)
        load_hf_weights(chunks, spec, hf_dir)
        return chunks

    policy, optimizer, _ = setup_training(load(), lr=1e-2)
    critic, critic_optimizer, _ = setup_training(load(), lr=1e-2)
    reference = load()

    def params(chunks):
        return [p for chunk in chunks for p in chunk.parameters()]

    def resident(tensors):  # every storage there (True), none (False), or some (None)
        sizes = [t.untyped_storage().nbytes() > 0 for t in tensors]
        return True if all(sizes) else False if not any(sizes) else None

    def adam_state():
        return [
            v
            for s in optimizer_states(optimizer) + optimizer_states(critic_optimizer)
            for v in s.values()
            if torch.is_tensor(v) and v.dim()
        ]

    seen = {}

    def on_sync(weights):  # the export reads the policy: whole then, the optimizer state already out
        seen.update(policy_at_sync=resident(params(policy)), adam_at_sync=resident(adam_state()), synced=len(weights))

    engine = RecordingEngine(on_sync)
    colo = Colocation(
        engine,
        policy,
        [(optimizer, policy), (critic_optimizer, critic)],
        idle=[critic],
        frozen=[reference],
        weights=lambda: ((f"w{i}", p.detach()) for i, p in enumerate(params(policy))),
        include_cpu=True,
    )
    seen["reference_at_start"] = resident(params(reference))
    colo.allocate()  # creates Adam's state (zeros), as the first step would
    with colo.frozen_model(reference):  # (reading an offloaded tensor's emptied storage would crash)
        before = {
            name: [t.detach().clone() for t in tensors]
            for name, tensors in dict(
                policy=params(policy), critic=params(critic), reference=params(reference), adam=adam_state()
            ).items()
        }
    times = {}

    class Memory:
        def start(self):
            seen.setdefault("memory", []).append("start")

        def end(self, name):
            seen.setdefault("memory", []).append(name)

    with colo.rollout(Timer(times), Memory()):
        seen.update(
            policy_in_rollout=resident(params(policy)),
            critic_in_rollout=resident(params(critic)),
            adam_in_rollout=resident(adam_state()),
            calls_in_rollout=list(engine.calls),
        )
    seen.update(
        policy_after=resident(params(policy)),
        critic_after=resident(params(critic)),
        adam_after=resident(adam_state()),
        calls_after=list(engine.calls),
    )
    with colo.frozen_model(reference):
        seen["reference_in_block"] = resident(params(reference))
    seen["reference_after_block"] = resident(params(reference))
    colo.reload_idle()
    colo.reload_optimizers(Timer(times))
    seen["overlapped"] = [off._pending is not None for off in colo.optimizers]  # copies still queued (GPU)
    colo.wait_optimizers(Timer(times))  # the scripts' before_step
    seen["waited"] = [off._pending is None for off in colo.optimizers]
    after = dict(policy=params(policy), critic=params(critic), reference=params(reference), adam=adam_state())
    with colo.frozen_model(reference):
        seen["same"] = {name: all(torch.equal(a, b) for a, b in zip(before[name], after[name])) for name in before}
    seen["timed"] = sorted(times)
    return seen


if __name__ == "__main__":
    main()
