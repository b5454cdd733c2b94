"""Worker of tests/test_routing_replay.py: MoE routing replay in one process (world of one).

    python tests/routing_replay_worker.py MODELS_DIR NAME[,NAME...]

For each tiny MoE model of tests/tiny_models.py saved under MODELS_DIR/NAME: the CPU engine
(common/rollout/hf_engine.py) samples responses and records their routes; the trainer's Megatron
model (built with routing replay, no aux loss) scores them at temperature 1 with its router
perturbed (DeepSeek-V3: its score-correction bias, which moves the choice of experts and not their
gating weights; the others: their router weight), and reports per case the largest
|trainer - engine| logprob over the response tokens and the route_mismatch metric:
  exact          unperturbed, routes replayed (padded micro-batches of 2 rows)
  perturbed      the router perturbed, no replay
  replayed       the router perturbed, routes replayed, padded micro-batches of 2 rows
  replayed_packed  the same, packed passes of at most 24 tokens
  recorded       the perturbed model's own routes recorded in packed passes (--routing-replay
                 old), replayed in padded ones: against its own unreplayed logprobs
and the router gradient under replay of one router (random hidden states and targets) against
the hand-derived gradient; for the first model, an update's gradients under replay with
activation recomputation (full, and selective of the MoE layers) against none. Prints
RESULT {json} per model.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU = torch.device("cpu")


def perturb(model, spec):
    """The routers of the trainer's model moved (seeded): DeepSeek-V3's score-correction bias (the
    choice of experts moves, their gating weights do not), else the router weight."""
    from common.model import moe

    torch.manual_seed(1)
    with torch.no_grad():
        for _, router in moe.routers(model):
            if spec.moe.expert_bias:
                router.expert_bias.add_(torch.randn_like(router.expert_bias) * 0.5)
            else:
                router.weight.add_(torch.randn_like(router.weight) * 0.002)


def update_gradients(spec, hf_dir, mbs, recompute):
    """All gradients of one update (-logprob mean of the response tokens) over the micro-batches
    (replayed where they carry routes) with the router perturbed, at --recompute `recompute`:
    megatron re-runs the layers (full) or the MoE layers (selective "moe") inside the backward,
    where each router takes its micro-batch's targets from RouterReplay's backward queue."""
    from common.model.bridge_layout import recompute_config
    from common.model.gpt import build_model
    from common.model.weights_load import load_hf_weights
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss
    from common.train import schedule
    from common.train.setup import setup_training

    layout = recompute_config(recompute, ("moe",), 1)
    chunks = build_model(spec, moe_enable_routing_replay=True, moe_aux_loss_coef=0.0, **layout)
    load_hf_weights(chunks, spec, hf_dir)
    perturb(chunks, spec)
    model, _, _ = setup_training(chunks, lr=0.0, use_distributed_optimizer=False)
    num_tokens = sum(mb["mask"].sum() for mb in mbs)

    def loss_fn(mb, logits):
        logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
        return aggregate_loss(-logprobs, mb["mask"], "token_mean", num_tokens=num_tokens) * len(mbs), {}

    for chunk in model:
        chunk.zero_grad_buffer()
    schedule.run_micro_batches(model, mbs, loss_fn, forward_only=False, device=CPU)
    return torch.cat([p.main_grad.flatten().clone() for p in model[0].parameters()])


def trainer_logprobs(model, spec, batch, mbs, record=None):
    """Forward-only logprobs (N, T) of the micro-batches at temperature 1."""
    from common.rl import batch as B
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.train import schedule

    store = torch.zeros(batch["tokens"].shape[0] + 1, batch["tokens"].shape[1])

    def loss_fn(mb, logits):
        logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
        B.scatter_tokens(store, mb, logprobs.detach())
        return logprobs.sum() * 0, {}

    with torch.no_grad():
        schedule.run_micro_batches(model, mbs, loss_fn, forward_only=True, device=CPU, record_routes=record)
    return store[:-1]


def router_gradient(router, score_function, scaling):
    """One router under replay: max |autograd - hand-derived| gradient of its weight for
    loss = sum(probs * c), and the gradient's size."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    gen = torch.Generator().manual_seed(3)
    tokens, experts, k = 10, router.config.num_moe_experts, router.topk
    x = torch.randn(5, 2, router.weight.shape[1], generator=gen)  # (S, B, H): 10 tokens
    target = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])  # (tokens, k)
    c = torch.randn(tokens, experts, generator=gen)
    router.weight.grad = None
    router.router_replay.target_topk_idx = target.clone()
    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, routing_map = router(x)
    router.router_replay.clear_router_replay_action()
    (probs * c).sum().backward()
    # by hand: logits l = x W^T; the chosen logits/scores of each token's replayed experts
    x2 = x.reshape(tokens, -1)
    chosen = (x2 @ router.weight.detach().T).gather(1, target)  # (tokens, k)
    cs = c.gather(1, target)
    if score_function == "softmax" and router.config.moe_router_pre_softmax:
        # Qwen2-MoE, not renormalised: p = softmax(l) over all experts, the chosen ones kept:
        # dL/dl_i = p_i (c_i [i chosen] - sum_chosen p c)
        p = (x2 @ router.weight.detach().T).softmax(-1)
        kept = torch.zeros(tokens, experts).scatter(1, target, cs)
        grad_logits = p * (kept - (p * kept).sum(-1, keepdim=True))
        return _result(router, grad_logits.T @ x2, routing_map, target)
    if score_function == "softmax":  # renormalised: p = softmax(l_chosen), dL/dl = p (c - sum p c)
        p = chosen.softmax(-1)
        grad_chosen = p * (cs - (p * cs).sum(-1, keepdim=True))
    else:  # s = sigmoid(l), p = scale s / sum s: dL/ds = scale (c / S - sum c s / S^2), ds/dl = s (1 - s)
        s = chosen.sigmoid()
        total = s.sum(-1, keepdim=True)
        grad_s = scaling * (cs / total - (cs * s).sum(-1, keepdim=True) / total**2)
        grad_chosen = grad_s * s * (1 - s)
    grad_logits = torch.zeros(tokens, experts).scatter(1, target, grad_chosen)
    return _result(router, grad_logits.T @ x2, routing_map, target)


def _result(router, by_hand, routing_map, target):
    """The gradient check's numbers: by_hand (E, H) against the router weight's gradient."""
    replayed_map = torch.zeros_like(routing_map).scatter(1, target, True)
    return dict(
        grad_diff=float((router.weight.grad - by_hand).abs().max()),
        grad_max=float(by_hand.abs().max()),
        map_is_target=bool(torch.equal(routing_map, replayed_map)),
    )


def main():
    from common.model import moe
    from common.model import routing_replay as RR
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.rl import batch as B
    from common.rollout.hf_engine import HFEngine
    from common.run.dist import init_distributed

    init_distributed()
    root, names = sys.argv[1], sys.argv[2].split(",")
    for name in names:
        hf_dir = os.path.join(root, name)
        spec = load_hf_spec(hf_dir)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 250, (2 + i % 3,), generator=gen).tolist() for i in range(4)]
        samples = HFEngine(hf_dir).generate(
            prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=1, return_routes=True
        )
        batch = B.pack_sequences(samples, pad_id=0, length_multiple=8, routes=True)
        batch["row"] = torch.arange(len(samples))
        rows = torch.arange(len(samples))
        padded = B.micro_batches(batch, rows, 2, length_multiple=8)
        packed = B.micro_batches(batch, rows, 2, length_multiple=8, max_tokens=24, pack=True)
        plain = [{k: v for k, v in mb.items() if k != "routes"} for mb in padded]
        model = build_model(spec, moe_enable_routing_replay=True, moe_aux_loss_coef=0.0)
        load_hf_weights(model, spec, hf_dir)
        mask = batch["mask"].bool()

        def diff(logprobs):
            return float((logprobs - batch["rollout_logprobs"])[mask].abs().max())

        result = {"model": name, "moe_layers": sum(spec.moe.moe_layers), "routes_shape": list(batch["routes"].shape)}
        result["routes_per_sample_ok"] = all(
            len(s.routes) == len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples
        )
        result["exact"] = diff(trainer_logprobs(model, spec, batch, padded))
        result["exact_mismatch"] = moe.step_metrics(model, spec, CPU).get("route_mismatch")
        perturb(model, spec)  # the trainer's copy only: the engine keeps its weights
        own = trainer_logprobs(model, spec, batch, plain)
        result["perturbed"] = diff(own)
        result["replayed"] = diff(trainer_logprobs(model, spec, batch, padded))
        result["replayed_mismatch"] = moe.step_metrics(model, spec, CPU).get("route_mismatch")
        result["replayed_packed"] = diff(trainer_logprobs(model, spec, batch, packed))
        moe.step_metrics(model, spec, CPU)  # (read: the next mismatch is the recorded routes' alone)
        # R2: the model's own routes recorded in packed passes, replayed in padded ones
        store = RR.route_store(*batch["tokens"].shape, spec, CPU)
        plain_packed = [{k: v for k, v in mb.items() if k != "routes"} for mb in packed]
        trainer_logprobs(model, spec, batch, plain_packed, record=store)
        recorded = dict(batch, routes=RR.gathered_routes(store))
        replay_recorded = B.micro_batches(recorded, rows, 2, length_multiple=8)
        result["recorded"] = float((trainer_logprobs(model, spec, recorded, replay_recorded) - own)[mask].abs().max())
        result["recorded_mismatch"] = moe.step_metrics(model, spec, CPU).get("route_mismatch")
        # every token a packed pass runs (up to each sample's last predicted position) was recorded
        result["recorded_where_engine_ran"] = bool((recorded["routes"][batch["routes"] >= 0] >= 0).all())
        result["engine_routes_differ_from_recorded"] = float(
            (recorded["routes"] != batch["routes"])[batch["routes"] >= 0].float().mean()
        )
        _, router = moe.routers(model)[0]
        result.update(router_gradient(router, spec.moe.score_function, spec.moe.scaling_factor or 1.0))
        if name == names[0]:  # activation recomputation inside the backward: the same gradients
            grads = {mode: update_gradients(spec, hf_dir, padded, mode) for mode in ("none", "full", "selective")}
            own_grads = update_gradients(spec, hf_dir, plain, "none")
            result["recompute_grad_diff"] = max(float((grads[m] - grads["none"]).abs().max()) for m in grads)
            result["replay_changes_grads"] = float((own_grads - grads["none"]).abs().max())
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
