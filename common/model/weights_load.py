"""HF weights into the model chunks common/model/gpt.py builds: each rank reads only the slices it owns.

  load_hf_weights(chunks, spec, hf_dir)   a rank's shards of every parameter, read and checked finite
  HFCheckpointReader(hf_dir)              lazy, sliced reads of safetensors checkpoints
The way back (megatron -> HF) is common/model/weights.py; the name/shape mapping itself lives in
common/model/bridge.py.
"""

import json
import os

import torch
import torch.distributed as dist

from common.model.bridge import HFModelSpec, expected_hf_shape, param_rule, shard_from_hf
from common.model.bridge_moe import expert_index
from common.model.bridge_vl import checkpoint_aliases, not_trained_notice
from common.model.chunks import named_global_tensors
from common.model.unsupported import UnsupportedModelError


class HFCheckpointReader:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index).

    read(name, row_slice, col_slice) opens only the bytes of that slice.
    """

    def __init__(self, hf_dir, spec: HFModelSpec | None = None):
        from safetensors import safe_open

        self.hf_dir, self.spec, self._open, self._files = hf_dir, spec, safe_open, {}
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.weight_map = {name: "model.safetensors" for name in self._handle("model.safetensors").keys()}
        else:
            raise FileNotFoundError(
                f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json "
                "(only safetensors checkpoints are supported)"
            )
        # a vision-language checkpoint (common/model/bridge_vl.py): the text model's names -> where it keeps each
        self.aliases = checkpoint_aliases(self.weight_map, spec) if spec is not None and spec.vision_language else {}
        self.notice = not_trained_notice(self.weight_map, vision_language=bool(self.aliases))  # vision tower, MTP
        if self.aliases:
            self.weight_map = {name: self.weight_map[stored] for name, (stored, _, _) in self.aliases.items()}

    def _handle(self, filename):
        if filename not in self._files:
            path = os.path.join(self.hf_dir, filename)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint shard {path} is missing (listed in the index)")
            try:
                self._files[filename] = self._open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise OSError(f"cannot read checkpoint shard {path}: {e} (truncated or damaged?)") from e
        return self._files[filename]

    def names(self):
        return list(self.weight_map)

    def _view(self, name):
        """(safetensors slice, its shape as the tensor `name`, (expert, first row) of a fused expert tensor)."""
        stored, expert, row0 = self.aliases.get(name, (name, None, 0))
        view = self._handle(self.weight_map[name]).get_slice(stored)
        shape = tuple(view.get_shape())
        if expert is not None:  # (E, 2I, H) [gate; up] or (E, H, I) down of every expert: one expert's part
            shape = (shape[1] // 2 if stored.endswith("gate_up_proj") else shape[1],) + shape[2:]
        return view, shape, (expert, row0)

    def shape(self, name):
        return self._view(name)[1]

    def read(self, name, row_slice=None, col_slice=None):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.hf_dir}")
        filename = self.weight_map[name]
        view, shape, (expert, row0) = self._view(name)
        if self.spec is not None:
            expected = expected_hf_shape(name, self.spec)
            if shape != expected:
                raise UnsupportedModelError(
                    f"tensor {name!r} in {filename} has shape {list(shape)} but config.json implies "
                    f"{list(expected)}: config.json does not match the weights"
                )
        index = (row_slice or slice(None),) + ((col_slice,) if col_slice is not None else ())
        if expert is not None:
            rows = range(shape[0])[index[0]]
            index = (slice(expert, expert + 1), slice(row0 + rows.start, row0 + rows.stop)) + index[1:]
        try:
            if expert is not None:
                return view[index][0]
            return view[index] if len(shape) else view[:]
        except Exception as e:
            raise OSError(
                f"cannot read {name!r} from {os.path.join(self.hf_dir, filename)}: {e} (truncated or damaged?)"
            ) from e


class WeightsError(ValueError):
    """Weights that cannot be trained from (NaN/Inf values): the user's files to fix, not a bug."""


_SAID = set()  # the notices printed by this process


def load_hf_weights(chunks, spec: HFModelSpec, hf_dir, tp_rank=None, tp_size=None, skip_prefixes=()):
    """Copy this rank's shard of every parameter from the HF checkpoint. Reads only
    owned slices, so host memory per rank ~ its shard. Returns the number of tensors set.
    Parameters whose (global) name starts with one of skip_prefixes are left as they are
    (the critic's value head, "output_layer.", has no HF counterpart in a causal LM).

    Every loaded parameter is checked for NaN/Inf (on its device, one host sync at the end):
    a WeightsError names the HF tensor and its file, raised on every rank alike when the
    process group is up (all ranks call this: one all_reduce)."""
    from megatron.core import parallel_state as mpu

    tp_rank = mpu.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp_size = mpu.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    # routed experts are split over the expert-TP group (of size etp), not the TP group
    etp_rank, etp_size = mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()
    reader = HFCheckpointReader(hf_dir, spec)
    if reader.notice and reader.notice not in _SAID and (not dist.is_initialized() or dist.get_rank() == 0):
        print(reader.notice, flush=True)
        _SAID.add(reader.notice)  # once a process: the policy and the reference load the same checkpoint
    count, finite, loaded = 0, [], []  # finite[i]: a 0-dim bool on the device, of loaded[i] = (name, hf_names)
    for chunk in chunks:
        for name, param in named_global_tensors(chunk):  # this rank's experts only
            if name.startswith(tuple(skip_prefixes)):
                continue
            kind, hf_names = param_rule(name, spec)
            expert = expert_index(name) is not None
            shard = shard_from_hf(
                kind, hf_names, reader.read, spec, etp_rank if expert else tp_rank, etp_size if expert else tp_size
            )
            if shard.shape != param.shape:  # a bridge bug, not a user error
                raise RuntimeError(f"{name}: shard {tuple(shard.shape)} != parameter {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)
                finite.append(torch.isfinite(param).all())
            loaded.append((name, hf_names))
            count += 1
    _check_loaded_finite(finite, loaded, reader)
    return count


def _check_loaded_finite(finite, loaded, reader):
    """WeightsError on every rank if any rank loaded a NaN/Inf, naming the first such HF tensor."""
    bad = [i for i, ok in enumerate(torch.stack(finite).tolist() if finite else []) if not ok]
    problem = None
    if bad:
        name, hf_names = loaded[bad[0]]
        names = [n.split("#")[0] for n in hf_names]  # (gpt-oss: an expert's row of a fused tensor, bridge_gptoss.py)
        culprit = next((n for n in names if n in reader.weight_map and not torch.isfinite(reader.read(n)).all()), None)
        if culprit is not None:
            path = os.path.join(reader.hf_dir, reader.weight_map[culprit])
            problem = f"tensor {culprit!r} in {path} holds NaN/Inf values"
        else:  # finite in the file, not after the cast to the training dtype
            path = os.path.join(reader.hf_dir, reader.weight_map[hf_names[0]])
            problem = f"tensor {hf_names[0]!r} in {path} holds values beyond the range of the training dtype"
        problem += f" ({len(bad)} of this rank's {len(loaded)} parameters are affected)"
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([float(problem is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():  # only on failure: which rank found what
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, problem)
            problem = next(p for p in every if p is not None)
    if problem is not None:
        raise WeightsError(
            f"the weights in {reader.hf_dir} cannot be trained from: {problem}. Copy or download them again"
        )
