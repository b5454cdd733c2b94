"""VLLMEngine's copies of routed experts (update_weights): straight into the slices of vLLM's fused MoE
parameters (w13_weight, w2_weight) of this vLLM TP rank, one kernel per tensor or per block of experts
instead of vLLM's loader in Python per expert tensor.

FusedExperts is a part of VLLMEngine (class VLLMEngine(RequestTurns, FusedExperts, RolloutEngine)), kept in
its own file: it uses the engine's model and the caches __init__ sets (_fused_cache).
"""

from common.model.bridge_moe import EXPERT_HALF, EXPERT_NAME


class FusedExperts:
    def _copy_experts(self, named_tensors, written):
        """Pass (name, tensor) pairs on to load_weights, except routed experts' projections
        (checkpoint names, common/rollout/engine.py's EXPERT_NAME), which are copied straight into
        their slice of the layer's fused vLLM parameters: w13_weight (E, 2 I/tp, H) holds
        [gate; up] of each expert, w2_weight (E, H, I/tp) its down projection, each vLLM TP
        rank its slice of I. vLLM's loader takes ~90 us per expert tensor in Python (0.43 s
        for Moonlight-16B-A3B's 4,992); a slice copy is one kernel. Names of the parameters
        written go into `written`. A layer whose fused parameters are not found in that form
        (another MoE backend, vLLM's own expert parallelism) goes through load_weights."""
        from common.model.weights import ExpertBlock

        def expanded():  # blocks this method cannot copy as a whole go on as per-expert tensors
            for name, tensor in named_tensors:
                if isinstance(tensor, ExpertBlock) and not self._copy_block(tensor, written):
                    yield from tensor.hf()
                elif not isinstance(tensor, ExpertBlock):
                    yield name, tensor

        for name, tensor in expanded():
            match = EXPERT_NAME.fullmatch(name)
            fused = self._fused_experts(name[: name.index(".experts.") + len(".experts")]) if match else None
            if fused is None or match[3] not in EXPERT_HALF:
                yield name, tensor
                continue
            (w13_name, w13), (w2_name, w2) = fused
            expert, half = int(match[2]), EXPERT_HALF[match[3]]
            rows, cols = w13.shape[1] // 2, w2.shape[2]  # this rank's share of I
            expected = (
                (w2.shape[1], cols * self._vllm_tp_size) if half is None else (rows * self._vllm_tp_size, w13.shape[2])
            )
            if expert >= w13.shape[0] or tuple(tensor.shape) != expected:  # not the layout assumed here
                yield name, tensor
                continue
            if half is None:  # down projection (H, I): this rank's columns
                w2[expert].copy_(tensor[:, self._vllm_tp_rank * cols : (self._vllm_tp_rank + 1) * cols])
                written.add(w2_name)
            else:  # gate (half 0) or up (1), (I, H): this rank's rows into its half of w13
                w13[expert, half * rows : (half + 1) * rows].copy_(
                    tensor[self._vllm_tp_rank * rows : (self._vllm_tp_rank + 1) * rows]
                )
                written.add(w13_name)

    def _copy_block(self, block, written):
        """Copy an ExpertBlock (experts first .. first + n - 1 of one layer, stacked) into this
        vLLM TP rank's slices of the layer's w13 / w2 in three copies; False (nothing written)
        where the fused parameters are not found in the layout _copy_experts assumes."""
        fused = self._fused_experts(block.prefix)
        if fused is None:
            return False
        (w13_name, w13), (w2_name, w2) = fused
        n, rows, cols, r = block.fc1.shape[0], w13.shape[1] // 2, w2.shape[2], self._vllm_tp_rank
        inter = block.fc1.shape[1] // 2
        if (
            inter != rows * self._vllm_tp_size
            or tuple(block.fc2.shape[1:]) != (w2.shape[1], cols * self._vllm_tp_size)
            or block.fc1.shape[2] != w13.shape[2]
            or block.first + n > w13.shape[0]
        ):
            return False
        experts = slice(block.first, block.first + n)
        w13[experts, :rows].copy_(block.fc1[:, r * rows : (r + 1) * rows])  # gate
        w13[experts, rows:].copy_(block.fc1[:, inter + r * rows : inter + (r + 1) * rows])  # up
        w2[experts].copy_(block.fc2[:, :, r * cols : (r + 1) * cols])  # down
        written.update((w13_name, w2_name))
        return True

    def _fused_experts(self, module_name):
        """((name, w13_weight), (name, w2_weight)) of vLLM's fused MoE module `module_name`
        (e.g. model.layers.3.mlp.experts), or None when it has no such single pair; cached."""
        if not self._fused_cache:  # first call: the model's modules and this rank's vLLM TP coordinates
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            self._vllm_tp_rank, self._vllm_tp_size = (
                get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(),
            )
            self._modules = dict(self.model.named_modules())
        if module_name not in self._fused_cache:
            # (vLLM's vision-language Qwen3.5 holds the text model as language_model.model.*)
            full = ("language_model." if self._vision_language else "") + module_name
            module = self._modules.get(full)
            params = [] if module is None else list(module.named_parameters())
            w13 = [(f"{full}.{n}", p) for n, p in params if n.endswith("w13_weight") and p.dim() == 3]
            w2 = [(f"{full}.{n}", p) for n, p in params if n.endswith("w2_weight") and p.dim() == 3]
            self._fused_cache[module_name] = (w13[0], w2[0]) if len(w13) == len(w2) == 1 else None
        return self._fused_cache[module_name]
