"""Worker of tests/test_offload.py: train a tiny model 3 steps, with and without offloading the
whole training state (params, grad buffers, optimizer) between steps; print JSON.

    python tests/offload_worker.py HF_DIR          (one process)
    torchrun --nproc_per_node 2 tests/offload_worker.py HF_DIR   (DP=2: sharded optimizer)
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(hf_dir, dtype, distributed_optimizer, offload):
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.train import schedule
    from common.train.host_pool import HostPool
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
    losses, moved, left, freed_gpu, intact, overlapped, kept = [], [], [], [], [], [], []
    side = torch.cuda.Stream() if on_gpu else None  # the optimizer's reload copies on it, as the scripts
    pool, planned = None, None
    if offload:  # as the scripts do: one pool, every host buffer carved before the first step
        planned = {key: n for off in (model_off, optim_off) for key, n in off.planned()}  # Adam's moments to come
        pool = HostPool(model_off.host_bytes() + optim_off.host_bytes(), pin=on_gpu)
        optim_off.allocate(pool), model_off.allocate(pool)
        buffers = {id(b) for off in (model_off, optim_off) for b in off._host.values()}
    state_before_step = sum(len(s) for s in optimizer_states(optimizer))  # sizing created no Adam state
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
            kept.append(model_off.kept + optim_off.kept)
            state = [v for s in optimizer_states(optimizer) for v in s.values() if torch.is_tensor(v) and v.dim()]
            left.append(sum(t.untyped_storage().nbytes() for t in list(model[0].parameters()) + state))
            model_off.reload()
            optim_off.reload(stream=side)  # on a GPU: copies queued on `side`, overlapping the next forward/backward
            overlapped.append(optim_off._pending is not None)
    params = torch.cat([p.detach().float().flatten() for p in model[0].parameters()])
    # host buffers an offload had to create after allocate() (each costs a pinning on a GPU)
    late = len({id(b) for off in (model_off, optim_off) for b in off._host.values()} - buffers) if offload else 0
    hosts = [b for off in (model_off, optim_off) for b in off._host.values()]
    return dict(
        planned=sum(planned.values()) if offload else None,
        kept=kept,
        state_before_step=state_before_step,
        in_pool=all(pool.contains(b) for b in hosts) if offload else None,
        pool_extra=pool.extra_count if offload else None,
        pool_exact=pool.nbytes == HostPool.size_for(planned.values()) if offload else None,
        pinned=pool.pinned if offload else None,
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


def optimizer_step(chunks, optimizer, spec, seed, value_head=False):
    """One forward/backward and optimizer step on a random batch (a value head: regress V onto 0)."""
    from megatron.core import parallel_state as mpu

    from common.train import schedule

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(100 * seed + mpu.get_data_parallel_rank())
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=gen)
    mb = dict(tokens=tokens, positions=torch.arange(16).expand(2, 16), targets=tokens.roll(-1, 1))

    def loss_fn(mb, output):
        if value_head:
            loss = output.float().pow(2).mean()
        else:
            loss = torch.nn.functional.cross_entropy(output.float().flatten(0, 1), mb["targets"].flatten())
        return loss, {"loss": loss.detach()}

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    schedule.run_micro_batches(chunks, [mb], loss_fn, forward_only=False, device=device)
    optimizer.step()


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
                planned=offloaded["planned"],
                kept=offloaded["kept"],
                state_before_step=offloaded["state_before_step"],
                in_pool=offloaded["in_pool"],
                pool_extra=offloaded["pool_extra"],
                pool_exact=offloaded["pool_exact"],
                pinned=offloaded["pinned"],
            )
    result["reference"] = frozen_model_roundtrip(hf_dir)
    result["colocation"] = colocation_phases(hf_dir)
    result["shared"] = shared_staging(
        hf_dir, os.path.join(os.path.dirname(os.path.abspath(hf_dir)), f"shared_ckpt_{info.world_size}")
    )
    result["turns"] = turns(hf_dir, os.path.join(os.path.dirname(os.path.abspath(hf_dir)), f"turns_{info.world_size}"))
    if info.rank == 0:
        print("RESULT " + json.dumps(result))


def frozen_model_roundtrip(hf_dir):
    """A plain (not DDP-wrapped) frozen model, as train_grpo.py's reference: same logits after
    offload + reload, and its storages empty in between."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
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
    """common/train/colocation.Colocation as the scripts drive it (a policy with Adam, PPO's critic as the
    idle model, a frozen reference; a recording engine): what is on the device in each phase,
    and every tensor the same after its round trip."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.train.colocation import Colocation, Timer
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
    seen["host_bytes"] = colo.host_bytes()  # arithmetic, Adam's moments to come included
    colo.allocate()  # the pool; creates no Adam state
    seen["reference_after_allocate"] = resident(params(reference))
    seen["adam_after_allocate"] = len(adam_state())
    seen["pool"] = dict(nbytes=colo.pool.nbytes, used=colo.pool.used, extra=colo.pool.extra_count)
    for chunks, opt in ((policy, optimizer), (critic, critic_optimizer)):  # Adam's first steps create its state
        optimizer_step(chunks, opt, spec, seed=0)
    seen["pool_after_step"] = dict(used=colo.pool.used, extra=colo.pool.extra_count)
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
    seen["adam_tensors"] = len(before["adam"])
    seen["pool_at_end"] = dict(used=colo.pool.used, extra=colo.pool.extra_count)
    return seen


class NoMemory:
    def start(self):
        pass

    def end(self, name):
        pass


def checkpointed_state(models):
    """Copies of everything a training checkpoint holds of (chunks, optimizer) pairs, in a fixed
    order: parameters, then per torch Adam parameter its main param and both moments."""
    from common.train.setup import torch_adams

    out = []
    for chunks, optimizer in models:
        out += [p.detach().clone() for chunk in chunks for p in chunk.parameters()]
        for adam in torch_adams(optimizer):
            for group in adam.param_groups:
                for p in group["params"]:
                    state = adam.state.get(p, {})  # none before Adam's first step
                    out += [p.detach().clone()] + [state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def policy_and_critic(spec, hf_dir):
    """((policy, optimizer, scheduler), (critic, ...)) of train_ppo.py, bf16, from hf_dir's weights."""
    from common.model.critic import build_critic, load_critic_weights
    from common.model.gpt import build_model
    from common.model.weights_load import load_hf_weights
    from common.train.setup import setup_training

    policy_chunks = build_model(spec, dtype=torch.bfloat16)
    load_hf_weights(policy_chunks, spec, hf_dir)
    critic_chunks = build_critic(spec, dtype=torch.bfloat16)
    load_critic_weights(critic_chunks, spec, hf_dir)
    return setup_training(policy_chunks, lr=1e-2), setup_training(critic_chunks, lr=1e-2)


def ppo_colocation(policy, optimizer, critic, critic_optimizer, include_cpu):
    """train_ppo.py's Colocation of these models, its engine a RecordingEngine that syncs nothing."""
    from common.train.colocation import Colocation

    return Colocation(
        RecordingEngine(lambda weights: None),
        policy,
        [(optimizer, policy), (critic_optimizer, critic)],
        idle=[critic],
        weights=lambda: iter(()),
        include_cpu=include_cpu,
    )


def shared_staging(hf_dir, root):
    """A background save (policy + PPO's critic, as train_ppo.py) staged through the offload's host
    buffers (common/train/offload.py SharedHostBuffers), its writer held (a slow disk) across the
    next two steps: the next offload copies nothing it staged and the reload is exact; the offload
    after it (which writes the buffers) waits for the writer; the checkpoint loads bit-exact."""
    import threading
    import time

    from megatron.core import parallel_state as mpu

    from common.model.gpt import load_hf_spec
    from common.train.colocation import Timer
    from common.train.resume import load_training_checkpoint
    from common.train.save import CheckpointWriter
    from tests.checkpoint_worker import HELD, hold_writers

    spec = load_hf_spec(hf_dir)
    include_cpu = not torch.cuda.is_available()

    def build():
        return policy_and_critic(spec, hf_dir)

    (policy, optimizer, scheduler), (critic, critic_optimizer, critic_scheduler) = build()
    models = [(policy, optimizer), (critic, critic_optimizer)]
    colo = ppo_colocation(policy, optimizer, critic, critic_optimizer, include_cpu)
    seen = dict(staging_reserve=CheckpointWriter.host_bytes(models, colo.host_buffers))
    colo.allocate()
    writer = CheckpointWriter(models=models, shared=colo.host_buffers)
    seen["state_before_step"] = sum(len(s) for _, opt in models for s in optimizer_states(opt))
    offloaders = colo.optimizers + [colo.policy, *colo.idle]

    def step(index):
        """One step as the scripts run it; returns (kept, copied) bytes of its offloads, and seconds offloading."""
        started = time.perf_counter()
        with colo.rollout(Timer({}), NoMemory()):
            pass
        offload_s = time.perf_counter() - started
        colo.reload_idle()
        colo.reload_optimizers(Timer({}))
        colo.wait_optimizers(Timer({}))
        after_reload = checkpointed_state(models)
        optimizer_step(policy, optimizer, spec, seed=index)
        optimizer_step(critic, critic_optimizer, spec, seed=index, value_head=True)
        return sum(off.kept for off in offloaders), sum(off.copied for off in offloaders), offload_s, after_reload

    step(1)
    saved = checkpointed_state(models)  # what the checkpoint of step 1 must hold
    HELD.clear()
    threading.settrace(hold_writers)  # the last rank's writer threads wait for HELD
    writer.save(
        root,
        1,
        policy,
        optimizer,
        scheduler,
        extra={"step": 1},
        extra_models={"critic": (critic, critic_optimizer, critic_scheduler)},
        optimizer_sharding="fully_reshardable" if mpu.get_data_parallel_world_size() == 1 else "dp_reshardable",
    )
    threading.settrace(None)
    staging = writer.staging
    seen["save"] = dict(own=staging.used, overflow=staging.overflow_bytes, shared=staging.shared_bytes)
    kept, copied, _, reloaded = step(2)  # its offload: nothing the save staged is copied again
    seen["step2"] = dict(kept=kept, copied=copied, reload_exact=all(map(torch.equal, reloaded, saved)))
    last = dist.get_rank() == dist.get_world_size() - 1
    releaser = threading.Timer(2.0, HELD.set)  # the slow disk finishes 2 s from now
    releaser.start()
    kept, copied, offload_s, _ = step(3)  # its offload writes into the buffers: waits for the writer first
    releaser.join()
    seen["step3"] = dict(kept=kept, copied=copied, waited=offload_s >= 1.5 if last else None)
    seen["published"] = writer.wait()
    (policy2, optimizer2, scheduler2), (critic2, critic_optimizer2, critic_scheduler2) = build()
    load_training_checkpoint(
        root, policy2, optimizer2, scheduler2, extra_models={"critic": (critic2, critic_optimizer2, critic_scheduler2)}
    )
    loaded = checkpointed_state([(policy2, optimizer2), (critic2, critic_optimizer2)])
    seen["loaded_exact"] = len(loaded) == len(saved) and all(map(torch.equal, loaded, saved))
    seen["tensors"] = len(saved)
    seen["pool"] = dict(extra=colo.pool.extra_count)
    return seen


def turns(hf_dir, root):
    """PPO's update in turns (common/train/colocation.py turn, as train_ppo.py drives it): the critic's
    optimizer steps with only its optimizer state on the device, then the actor's with only its own;
    a save brings each model's state in for its part (before_model). Three steps give bit-identical
    parameters and Adam state to the same steps without any offload, the checkpoint loads bit-exact,
    and the save's turn moves the actor's just-staged state out without copying it."""
    from megatron.core import parallel_state as mpu

    from common.model.gpt import load_hf_spec
    from common.train.colocation import Timer
    from common.train.resume import load_training_checkpoint
    from common.train.save import CheckpointWriter

    spec = load_hf_spec(hf_dir)
    include_cpu = not torch.cuda.is_available()

    def build():
        return policy_and_critic(spec, hf_dir)

    def adam_tensors(opt):
        return [v for s in optimizer_states(opt) for v in s.values() if torch.is_tensor(v) and v.dim()]

    def resident(tensors):
        return all(t.untyped_storage().nbytes() > 0 for t in tensors)

    def emptied(tensors):
        return all(t.untyped_storage().nbytes() == 0 for t in tensors)

    plain_models = build()
    (policy, optimizer, scheduler), (critic, critic_optimizer, critic_scheduler) = build()
    models = [(policy, optimizer), (critic, critic_optimizer)]
    colo = ppo_colocation(policy, optimizer, critic, critic_optimizer, include_cpu)
    colo.allocate()
    writer = CheckpointWriter(models=models, shared=colo.host_buffers)
    timer, seen = Timer({}), dict(critic_turn=[], actor_turn=[])
    (plain_policy, plain_optimizer, _), (plain_critic, plain_critic_optimizer, _) = plain_models
    for index in range(1, 4):
        optimizer_step(plain_critic, plain_critic_optimizer, spec, seed=index, value_head=True)
        optimizer_step(plain_policy, plain_optimizer, spec, seed=index)
        with colo.rollout(timer, NoMemory()):
            pass
        colo.reload_idle()
        colo.turn(critic_optimizer, timer)
        colo.wait_optimizers(timer)
        if index > 1:  # (Adam's state exists from the first steps on)
            seen["critic_turn"].append(resident(adam_tensors(critic_optimizer)) and emptied(adam_tensors(optimizer)))
        optimizer_step(critic, critic_optimizer, spec, seed=index, value_head=True)
        colo.turn(optimizer, timer)
        colo.wait_optimizers(timer)
        if index > 1:
            seen["actor_turn"].append(resident(adam_tensors(optimizer)) and emptied(adam_tensors(critic_optimizer)))
        optimizer_step(policy, optimizer, spec, seed=index)
    colo.reload_optimizers(timer)  # everything on the device a moment, to read what the save must hold
    colo.wait_optimizers(timer)
    before_save = checkpointed_state(models)
    colo.turn(optimizer, timer)  # back as the update left it: the critic's state in host memory
    parts = []

    def save_turn(name):
        colo.turn(critic_optimizer if name else optimizer, timer)
        colo.wait_optimizers(timer)
        parts.append((name, colo.optimizers[0].copied if name else None))

    writer.save(
        root,
        3,
        policy,
        optimizer,
        scheduler,
        extra={"step": 3},
        extra_models={"critic": (critic, critic_optimizer, critic_scheduler)},
        optimizer_sharding="fully_reshardable" if mpu.get_data_parallel_world_size() == 1 else "dp_reshardable",
        before_model=save_turn,
    )
    seen["published"] = writer.wait()
    seen["save_parts"] = [name for name, _ in parts]
    seen["actor_out_copied"] = parts[-1][1]  # the actor's state, staged by its part, moved out without a copy
    colo.turn(optimizer, timer)
    colo.wait_optimizers(timer)
    colo.reload_optimizers(timer)  # everything on the device, to compare
    colo.wait_optimizers(timer)
    final = checkpointed_state(models)
    seen["same_as_plain"] = all(map(torch.equal, final, checkpointed_state(plain_models_pairs(plain_models))))
    seen["save_is_state"] = len(final) == len(before_save) and all(map(torch.equal, final, before_save))
    (policy2, optimizer2, scheduler2), (critic2, critic_optimizer2, critic_scheduler2) = build()
    load_training_checkpoint(
        root, policy2, optimizer2, scheduler2, extra_models={"critic": (critic2, critic_optimizer2, critic_scheduler2)}
    )
    loaded = checkpointed_state([(policy2, optimizer2), (critic2, critic_optimizer2)])
    seen["loaded_exact"] = len(loaded) == len(final) and all(map(torch.equal, loaded, final))
    return seen


def plain_models_pairs(built):
    (policy, optimizer, _), (critic, critic_optimizer, _) = built
    return [(policy, optimizer), (critic, critic_optimizer)]


if __name__ == "__main__":
    main()
