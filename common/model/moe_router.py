"""The MoE router without TransformerEngine: megatron's TopKRouter, its gating and routing made
to run on the local spec and fast on a GPU, and a per-expert token count.

  Router   the TopKRouter of every MoE layer (common/model/gpt.py's layer spec)

megatron-core 0.16.1's gating calls `te_general_gemm`, a name its moe_utils.py defines only when
TE imports (without TE the first MoE forward dies with a NameError): here a plain matmul. Its
routing (top-k over softmax/sigmoid scores, the scores and load-balancing loss of the aux loss)
is ~90 small eager kernels per layer and pass without TE's fused router kernels; here the same
megatron functions run inside three compiled functions on a GPU (eager, thus megatron's own
code, elsewhere). Router settings this does not cover (sinkhorn, token capacity, TE's router
fusion) keep megatron's routing. Under routing replay (common/model/routing_replay.py) megatron's
routing runs with its RouterReplay, and the Router fills the tokens without a recorded route with
its own top-k and counts how often its own top-k differs from the replayed one.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from common.rl.fused import on_gpu_compiled


class Router(TopKRouter):
    """TopKRouter with a TE-free gating, compiled routing and a per-expert token count: it counts
    the tokens routed to each expert during updates, for the expert-load metrics
    (common/model/moe.py step_metrics), the padding left out (common/model/moe.py moe_padding_mask)."""

    compiled = True  # False: megatron's routing as it is (bench/train.py --ab compiled-router)
    tokens_per_expert = None  # (E,) float32, summed over the update passes since the last read
    passes = 0  # update (grad-enabled) forward passes since the last read
    # routing replay, training-mode passes since the last read: (4,) float32 on the device, the tokens
    # with a replayed route and those of them whose own top-k differs, in forward-only passes, then
    # in passes with a backward (common/model/moe.py step_metrics)
    replay_counts = None

    def gating(self, input):
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)  # (S, B, E) logits

    def routing(self, logits, padding_mask=None):
        action = None if self.router_replay is None else self.router_replay.router_replay_action
        if action is RouterReplayAction.REPLAY_FORWARD:
            probs, routing_map = self._replayed_routing(logits, padding_mask)
        elif self.compiled and action is None and self._plain_topk():
            probs, routing_map = self._topk_routing(logits, padding_mask)
        else:
            probs, routing_map = super().routing(logits, padding_mask=padding_mask)  # routing_map: (tokens, E) bool
        if torch.is_grad_enabled():  # the update's passes, not the logprob passes
            counts = real_token_counts(routing_map, padding_mask)
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
            self.passes += 1
        return probs, routing_map

    def _plain_topk(self):
        config = self.config
        return (
            self.routing_type != "sinkhorn"
            and config.moe_expert_capacity_factor is None
            and not config.moe_router_fusion
        )

    def _replayed_routing(self, logits, padding_mask):
        """megatron's routing to the target experts of RouterReplay (common/model/routing_replay.py):
        the target's -1 rows (no recorded route) take this router's own top-k, and in training-mode
        passes the real tokens whose own top-k differs are counted. A recomputation inside the
        backward (activation checkpointing; the autograd engine runs it) takes the next target of
        RouterReplay's backward queue instead: the same tensor, already filled."""
        replayer = self.router_replay
        if torch._C._current_graph_task_id() != -1:  # inside a backward
            replayer.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            try:
                return super().routing(logits, padding_mask=padding_mask)
            finally:
                replayer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        target = replayer.target_topk_idx  # (tokens, k) int64, -1 where none was recorded
        num_experts = self.config.num_moe_experts
        if target.shape != (logits.numel() // num_experts, self.topk):
            raise ValueError(
                f"replayed routes {tuple(target.shape)} for {logits.numel() // num_experts} tokens x top-{self.topk}"
            )
        with torch.no_grad():
            _, own = topk_routing(
                logits.reshape(-1, num_experts).detach(),
                self.expert_bias,
                self.topk,
                self.config.moe_router_pre_softmax,
                self.config.moe_router_num_groups,
                self.config.moe_router_group_topk,
                self.config.moe_router_topk_scaling_factor,
                self.score_function,
            )  # (tokens, E) bool: this router's own choice
            known = target[:, 0] >= 0  # (tokens,) a token's k routes are all recorded or none
            target.copy_(torch.where(known[:, None], target, own.float().topk(self.topk, dim=1).indices))
        if self.training:  # the policy's and critic's passes (the frozen reference is in eval mode)
            update = torch.is_grad_enabled()
            with torch.no_grad():
                chosen = torch.zeros_like(own).scatter_(1, target, True)
                real = known if padding_mask is None else known & ~padding_mask.reshape(-1)
                counts = torch.zeros(4, device=logits.device)
                counts[2 * update] = real.sum()
                counts[2 * update + 1] = ((chosen != own).any(1) & real).sum()
            self.replay_counts = counts if self.replay_counts is None else self.replay_counts + counts
        return super().routing(logits, padding_mask=padding_mask)

    def _topk_routing(self, logits, padding_mask):
        """megatron-core 0.16.1's TopKRouter.routing for top-k routing without token capacity,
        its two score computations and the plain load-balancing loss compiled on a GPU."""
        config = self.config
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = topk_routing(
            logits,
            self.expert_bias,
            self.topk,
            config.moe_router_pre_softmax,
            config.moe_router_num_groups,
            config.moe_router_group_topk,
            config.moe_router_topk_scaling_factor,
            self.score_function,
        )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, scores = aux_loss_scores(logits, padding_mask, self.topk, self.score_function)
            masked = padding_mask is not None
            probs = self._load_balancing_loss(probs, scores, aux_map, masked)
            probs = self._apply_seq_aux_loss(probs, scores, aux_map, seq_length, bsz, with_padding_mask=masked)
            probs = self._apply_global_aux_loss(probs, scores, aux_map, with_padding_mask=masked)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map

    def _load_balancing_loss(self, probs, scores, aux_map, masked):
        """megatron's _apply_aux_loss ("aux_loss"), its token counts and loss in one compiled call
        where no TP x CP peer's counts are summed in (else megatron's own, with its all-reduce)."""
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0 or self.tp_cp_group.size() > 1:
            return self._apply_aux_loss(probs, scores, aux_map, with_padding_mask=masked)
        loss, valid_tokens = load_balancing_loss(scores, aux_map, self.topk, self.config.num_moe_experts, coeff, masked)
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            loss,
            "load_balancing_loss",
            self.tp_cp_group,
            valid_token_count=valid_tokens if masked else aux_map.shape[0],
        )

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        """megatron's count of routed tokens for the router-bias update (update passes only),
        without the padding. megatron-core 0.16.1's own ands the (tokens, E) routing map with
        the (tokens,) padding mask, which does not broadcast (a RuntimeError in its compiled
        function)."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            self.local_tokens_per_expert += real_token_counts(routing_map, padding_mask)


@on_gpu_compiled
def topk_routing(logits, expert_bias, topk, pre_softmax, num_groups, group_topk, scaling_factor, score_function):
    """megatron's topk_routing_with_score_function: (probs, routing_map), both (tokens, E)."""
    return moe_utils.topk_routing_with_score_function(
        logits,
        topk,
        use_pre_softmax=pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        expert_bias=expert_bias,
    )


@on_gpu_compiled
def aux_loss_scores(logits, padding_mask, topk, score_function):
    """megatron's compute_routing_scores_for_aux_loss: (routing_map, scores) of the aux losses."""
    return moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function, padding_mask=padding_mask)


@on_gpu_compiled
def load_balancing_loss(scores, routing_map, topk, num_experts, coeff, masked):
    """megatron's switch load-balancing loss of one rank's tokens (get_tokens_per_expert_and_token_count
    with a group of one, then switch_load_balancing_loss_func): (loss, the valid tokens' count,
    a tensor, used where masked)."""
    tokens_per_expert = routing_map.sum(dim=0)
    valid_tokens = tokens_per_expert.sum() / topk
    total = valid_tokens if masked else routing_map.shape[0]
    return moe_utils.switch_load_balancing_loss_func(
        scores, tokens_per_expert, total, topk, num_experts, coeff
    ), valid_tokens


def real_token_counts(routing_map, padding_mask=None):
    """(E,) float32: how many of the (tokens, E) routing map's tokens each expert got, the
    padding (padding_mask (tokens,) or its (B, S) shape, True = padding) left out."""
    with torch.no_grad():
        if padding_mask is not None:
            routing_map = routing_map & ~padding_mask.reshape(-1, 1)
        return routing_map.sum(0, dtype=torch.float32)
