"""The disk side of convert_hf_to_mcore.py: HF safetensors read with plain file I/O, and a
Megatron-Core torch_dist checkpoint written through PyTorch DCP one tensor at a time.

  SafetensorsDir(hf_dir)        every tensor header of a checkpoint dir, validated; .read(name, ...)
  check_hf_weights(files, spec, hf_dir)   every tensor config.json implies, with its shape (headers only)
  Chunk                         one tensor chunk of the megatron checkpoint (key, offset, shape)
  lazy_dcp_save(dir, chunks, objects, make_tensor)   the save, asking make_tensor(chunk) per chunk
  write_megatron_files(dir)     metadata.json and common.pt, as megatron's save writes them
"""

import io
import json
import math
import os
from dataclasses import dataclass

import torch

from common.model.bridge import expected_hf_names, expected_hf_shape
from common.run.cli import ConversionError

# ---------------------------------------------------------------------------------------
# HF safetensors, read with plain file I/O
# ---------------------------------------------------------------------------------------
# safetensors' safe_open maps each file into memory: every page read would then count in
# this process's RSS until the file is closed, i.e. the whole model. Plain reads into a
# fresh tensor keep the footprint at the tensors alive right now.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class HFTensor:
    path: str
    dtype: torch.dtype
    shape: tuple
    start: int  # absolute byte offset of the data in the file


class SafetensorsDir:
    """Every tensor header of an HF checkpoint directory (one file or index + shards).
    Validates each file against its header up front: a missing or truncated shard is named."""

    def __init__(self, hf_dir):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            weight_map = None
        else:
            raise ConversionError(
                f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json "
                "(only safetensors checkpoints are supported)."
            )
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.tensors = {}
        for filename in files:
            self.tensors.update(self._read_header(os.path.join(hf_dir, filename)))
        for name, filename in (weight_map or {}).items():
            if self.tensors.get(name) is None or os.path.basename(self.tensors[name].path) != filename:
                raise ConversionError(f"{index} lists {name!r} in {filename}, but that file does not contain it.")

    def as_text_model(self, spec):
        """For a vision-language checkpoint (common/model/bridge_vl.py): key the tensors by the text
        model's names (a fused expert tensor's rows of each expert, contiguous, as a tensor of its
        own), the vision tower and MTP head dropped. Returns the notice line saying so, or None."""
        from common.model.bridge_vl import checkpoint_aliases, not_trained_notice

        if not spec.vision_language:
            return None
        stored, self.tensors = self.tensors, {}
        for name, (source, expert, row0) in checkpoint_aliases(stored, spec).items():
            t = stored[source]
            if expert is None:
                self.tensors[name] = t
                continue
            rows = t.shape[1] // 2 if source.endswith("gate_up_proj") else t.shape[1]
            row_bytes = math.prod(t.shape[2:]) * t.dtype.itemsize
            start = t.start + (expert * t.shape[1] + row0) * row_bytes
            self.tensors[name] = HFTensor(t.path, t.dtype, (rows,) + t.shape[2:], start)
        return not_trained_notice(stored)

    @staticmethod
    def _read_header(path):
        if not os.path.isfile(path):
            raise ConversionError(
                f"checkpoint shard {path} is missing (listed in the index). Copy or download it again."
            )
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if size < 8 or header_len > size - 8:
                    raise ValueError("header length beyond the end of the file")
                header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            data_start = 8 + header_len
            for name, h in header.items():
                if h["dtype"] not in SAFETENSORS_DTYPES:
                    raise ConversionError(
                        f"tensor {name!r} in {path} has dtype {h['dtype']}, which the converter "
                        f"does not read (supported: {', '.join(SAFETENSORS_DTYPES)})."
                    )
            tensors = {
                name: HFTensor(
                    path, SAFETENSORS_DTYPES[h["dtype"]], tuple(h["shape"]), data_start + h["data_offsets"][0]
                )
                for name, h in header.items()
            }
            data_end = max((h["data_offsets"][1] for h in header.values()), default=0)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(
                f"checkpoint shard {path} is damaged (cannot parse its header: {e}). Copy or download it again."
            ) from None
        if size != data_start + data_end:
            what = "truncated" if size < data_start + data_end else "damaged (longer than its header says)"
            raise ConversionError(
                f"checkpoint shard {path} is {what}: its header describes "
                f"{data_start + data_end} bytes, the file has {size}. Copy or download it again."
            )
        return tensors

    def read(self, name, row_slice=None, col_slice=None, out=None):
        """The tensor (or a range of its rows), read into fresh memory, or into `out` (contiguous,
        same dtype); read(name, row_slice, col_slice) is what the bridge's shard_from_hf calls."""
        t = self.tensors[name]
        rows = range(t.shape[0])[row_slice] if row_slice is not None else range(t.shape[0] if t.shape else 1)
        shape = ((len(rows),) + t.shape[1:]) if t.shape else ()
        if out is None:
            out = torch.empty(shape, dtype=t.dtype)
        assert out.shape == shape and out.dtype == t.dtype and out.is_contiguous()
        row_bytes = out[0].numel() * out.element_size() if t.shape else out.element_size()
        if out.numel():
            buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
            with open(t.path, "rb", buffering=0) as f:
                f.seek(t.start + rows.start * row_bytes)
                done = 0
                while done < len(buffer):  # one read() returns at most ~2 GB on Linux
                    n = f.readinto(buffer[done:])
                    if not n:
                        raise ConversionError(f"{t.path} ended while reading {name!r} (truncated?)")
                    done += n
        if col_slice is not None and range(out.shape[1])[col_slice] != range(out.shape[1]):
            out = out[:, col_slice].contiguous()  # never at TP=1, kept for completeness
        return out


def check_hf_weights(files: SafetensorsDir, spec, hf_dir, skip=()):
    """Every tensor config.json implies is present with the implied shape (headers only); names
    starting with one of `skip` need not be there. Returns the names present but not used."""
    expected = expected_hf_names(spec)
    for name in expected:
        if name.startswith(tuple(skip)) and name not in files.tensors:
            continue
        if name not in files.tensors:
            raise ConversionError(
                f"tensor {name!r} is missing from the weights in {hf_dir}, but config.json "
                f"({spec.architecture}, {spec.num_layers} layers, tie_word_embeddings="
                f"{spec.tie_word_embeddings}) requires it: config.json does not match the weights."
            )
        shape, implied = files.tensors[name].shape, expected_hf_shape(name, spec)
        if shape != implied:
            raise ConversionError(
                f"tensor {name!r} in {files.tensors[name].path} has shape {list(shape)} but config.json "
                f"implies {list(implied)}: config.json does not match the weights. Use the config.json "
                "that came with these weights."
            )
    return sorted(set(files.tensors) - set(expected))  # ignored extras


# ---------------------------------------------------------------------------------------
# The megatron checkpoint: chunks and the lazy DCP save
# ---------------------------------------------------------------------------------------
@dataclass
class Chunk:
    param: str  # megatron parameter name, global layer index: decoder.layers.3.mlp.linear_fc1.weight
    key: str  # checkpoint key, layers stacked on axis 0: decoder.layers.mlp.linear_fc1.weight
    offset: tuple  # where the chunk sits in the global tensor
    shape: tuple  # chunk shape, including the size-1 stacked-layer axis
    global_shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self):
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def lazy_dcp_save(ckpt_dir, chunks, objects, make_tensor, fsync=True, progress=None):
    """Save through PyTorch DCP (megatron's torch_dist backend underneath) without a state dict:
    the planner lists the chunks as write items, the writer asks for one tensor at a time.
    All ranks call this; each passes only its own chunks (and objects)."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # the reader's index entry
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    by_index = {}
    items = []
    for c in chunks:
        index = MetadataIndex(c.key, torch.Size(c.offset))
        by_index[index] = c
        items.append(
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
        )
    for obj in objects:  # serialised as megatron does (strategies/torch.py, _mcore_to_torch_sharded_object)
        index = MetadataIndex(obj.unique_key)
        by_index[index] = obj
        items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))

    class LazyPlanner(DefaultSavePlanner):
        def create_local_plan(self):
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            entry = by_index[write_item.index]
            if isinstance(entry, Chunk):
                return make_tensor(entry)
            data = io.BytesIO()
            torch.save([entry.data], data)
            return data

    class StreamingWriter(FileSystemWriter):
        """One file per rank (__<rank>_0.distcp, as megatron names them), one tensor in memory at
        a time. torch's own write loop keeps every written tensor referenced until the file is
        closed, so this short loop replaces it; the format (torch.save per item) is the same."""

        def write_data(self, plan, planner):
            file_name = f"{plan.storage_data.prefix}0.distcp"
            results = []
            with open(os.path.join(self.path, file_name), "wb") as f:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    start = f.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        f.write(data.getbuffer())
                    else:
                        torch.save(data, f)
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=f.tell() - start,
                            storage_data=_StorageInfo(file_name, start, f.tell() - start),
                        )
                    )
                    if progress is not None and item.type != WriteItemType.BYTE_IO:
                        progress.update(data.numel() * data.element_size())
                    del data
                if self.sync_files:
                    f.flush()
                    os.fsync(f.fileno())
            future = torch.futures.Future()
            future.set_result(results)
            return future

    planner = LazyPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    # torch.save's zip records carry a CRC32 that torch.load never checks; computing it halves
    # the write speed (measured: 2.0 vs 3.3 GB/s), so it is off for this save only.
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        save({}, storage_writer=StreamingWriter(ckpt_dir, sync_files=fsync), planner=planner)
    finally:
        torch.serialization.set_crc32_options(crc32)


def write_megatron_files(ckpt_dir):
    """metadata.json and common.pt, as megatron's dist_checkpointing.save writes them."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    strategy = get_default_save_sharded_strategy()  # torch_dist, version 1
    torch.save({}, os.path.join(ckpt_dir, COMMON_STATE_FNAME))  # a model-only checkpoint has no common state
    save_config(CheckpointingConfig(strategy.backend, strategy.version), ckpt_dir)
