"""Convert a HuggingFace checkpoint into a Megatron-Core dist_checkpointing checkpoint.

The output is what `GPTModel.sharded_state_dict()` saves at TP=1/PP=1 (torch_dist format,
layers stacked on a leading axis), so the training scripts load it at any TP/PP/VPP layout
(`--mcore-ckpt DIR`; common/checkpoint.py:load_model_checkpoint), plus
  rl_meta.json   architecture, source, dtype, versions
  hf/            config.json, generation_config.json and tokenizer files of the source
merge_to_hf.py turns it (or any training checkpoint step) back into an HF directory.

How it streams: no model is ever materialised. A GPTModel built on the `meta` device gives
the exact checkpoint keys, shapes and chunks; a PyTorch-DCP save planner hands the writer
one tensor at a time, read from the safetensors files (plain reads, no mmap) and laid out
for megatron (fused qkv per query group, [gate; up], vocabulary padded) only when the
writer asks for it. Peak host memory: the Python/torch/megatron baseline (~0.4 GB) plus one
copy of the largest tensor (1.5 when --dtype halves it), whatever the model size. With N
processes (torchrun) every rank converts a disjoint, contiguous range of the tensors into
its own file.

  python convert_hf_to_mcore.py --hf /models/Qwen2-7B --out /ckpt/qwen2-7b-mcore            # 1 CPU
  python convert_hf_to_mcore.py --hf DIR --out DIR --dtype fp32 --verify                     # + check
  torchrun --nproc_per_node 8 convert_hf_to_mcore.py --hf DIR --out DIR                      # 8 writers
  torchrun --nproc_per_node 8 convert_hf_to_mcore.py --hf DIR --out DIR --verify --tp 4 --pp 2
  sbatch launch/slurm.sh convert_hf_to_mcore.py --hf DIR --out DIR                           # slurm

--verify loads the written checkpoint into a GPTModel at --tp/--pp/--vpp (under torchrun
when tp*pp > 1), runs a few fixed random sequences through it and through transformers,
prints `max_abs_diff=<float>` and exits 1 above tolerance (1e-4 fp32, 2e-2 bf16). Both
sides compute in fp32 with the weights as stored, so the number measures the conversion,
not bf16 arithmetic. The output only gets its final name after it passed.

Exit codes: 0 done, 1 --verify failed, 2 bad input or disk full (a one-paragraph message,
no traceback), 130 interrupted. Everything is written to <out>.incomplete and renamed to
<out> at the very end, so an interrupted run never leaves something that looks complete.
"""
import io
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from common.cli import (DTYPES, HF_DTYPE_NAMES, ConversionError, Parser, check_output_dir, check_tool_layout,
                        finish_output, read_hf_spec, run_cli, temporary_output)
from common.preflight import TOKENIZER_FILES
from common.dist import print0
from common.bridge import expected_hf_names, expected_hf_shape, param_rule, shard_from_hf

VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------
# HF safetensors, read with plain file I/O
# ---------------------------------------------------------------------------------------
# safetensors' safe_open maps each file into memory: every page read would then count in
# this process's RSS until the file is closed, i.e. the whole model. Plain reads into a
# fresh tensor keep the footprint at the tensors alive right now.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


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
            raise ConversionError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json "
                                  "(only safetensors checkpoints are supported).")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.tensors = {}
        for filename in files:
            self.tensors.update(self._read_header(os.path.join(hf_dir, filename)))
        for name, filename in (weight_map or {}).items():
            if self.tensors.get(name) is None or os.path.basename(self.tensors[name].path) != filename:
                raise ConversionError(f"{index} lists {name!r} in {filename}, but that file does not contain it.")

    @staticmethod
    def _read_header(path):
        if not os.path.isfile(path):
            raise ConversionError(f"checkpoint shard {path} is missing (listed in the index). Copy or "
                                  "download it again.")
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
                    raise ConversionError(f"tensor {name!r} in {path} has dtype {h['dtype']}, which the converter "
                                          f"does not read (supported: {', '.join(SAFETENSORS_DTYPES)}).")
            tensors = {name: HFTensor(path, SAFETENSORS_DTYPES[h["dtype"]], tuple(h["shape"]),
                                      data_start + h["data_offsets"][0]) for name, h in header.items()}
            data_end = max((h["data_offsets"][1] for h in header.values()), default=0)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"checkpoint shard {path} is damaged (cannot parse its header: {e}). "
                                  "Copy or download it again.") from None
        if size != data_start + data_end:
            what = "truncated" if size < data_start + data_end else "damaged (longer than its header says)"
            raise ConversionError(f"checkpoint shard {path} is {what}: its header describes "
                                  f"{data_start + data_end} bytes, the file has {size}. Copy or download it again.")
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




def check_hf_weights(files: SafetensorsDir, spec, hf_dir):
    """Every tensor config.json implies is present with the implied shape (headers only)."""
    for name in expected_hf_names(spec):
        if name not in files.tensors:
            raise ConversionError(
                f"tensor {name!r} is missing from the weights in {hf_dir}, but config.json "
                f"({spec.architecture}, {spec.num_layers} layers, tie_word_embeddings="
                f"{spec.tie_word_embeddings}) requires it: config.json does not match the weights.")
        shape, expected = files.tensors[name].shape, expected_hf_shape(name, spec)
        if shape != expected:
            raise ConversionError(
                f"tensor {name!r} in {files.tensors[name].path} has shape {list(shape)} but config.json "
                f"implies {list(expected)}: config.json does not match the weights. Use the config.json "
                "that came with these weights.")
    return sorted(set(files.tensors) - set(expected_hf_names(spec)))  # ignored extras


# ---------------------------------------------------------------------------------------
# The checkpoint layout and the lazy DCP save
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


def megatron_layout(spec, dtype):
    """(tensor chunks, extra-state objects) exactly as GPTModel.sharded_state_dict() has them at
    TP=1/PP=1. Built on the meta device: shapes only, no memory. Needs megatron's parallel state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel

    from common.bridge import gpt_model_kwargs, transformer_config
    from common.model import decoder_spec

    # As common/model.py:build_model at TP=PP=1, minus the .cuda(): use_cpu_initialization makes
    # megatron allocate without an explicit device, so the meta context applies (also on a GPU).
    config = transformer_config(spec, params_dtype=dtype, use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        model = GPTModel(config=config, transformer_layer_spec=decoder_spec(spec, config), pre_process=True,
                         post_process=True, **gpt_model_kwargs(spec, tp=1))
    chunks, objects = [], []
    for param, sharded in model.sharded_state_dict().items():
        if isinstance(sharded, ShardedObject):  # `_extra_state` of each linear layer
            objects.append(sharded)
            continue
        # linear_fc1 is a factory: megatron stores [gate; up] as two chunks (mlp.py, swiglu)
        pieces = nested_values(sharded.build()) if isinstance(sharded, ShardedTensorFactory) else [sharded]
        for sh in pieces:
            assert sh.flattened_range is None
            chunks.append(Chunk(param, sh.key, tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape),
                                tuple(sh.global_shape), sh.dtype))
    return chunks, objects


def chunk_data(chunk: Chunk, files: SafetensorsDir, spec):
    """The tensor of one checkpoint chunk, built from the HF tensors it comes from."""
    kind, hf_names = param_rule(chunk.param, spec)
    if kind == "gate_up":  # each of the two fc1 chunks is exactly one HF tensor (an MLP's, an expert's)
        data = files.read(hf_names[chunk.offset[-2] // expected_hf_shape(hf_names[0], spec)[0]])
    elif kind == "vocab":  # the chunk is the padded vocabulary: real rows read in place, the rest 0
        data = torch.empty(chunk.shape, dtype=files.tensors[hf_names[0]].dtype)  # (V_padded, h)
        files.read(hf_names[0], out=data[: spec.vocab_size])
        data[spec.vocab_size:].zero_()  # (the bridge's shard_from_hf would cat: one more copy)
    else:  # the bridge's TP-rank-0-of-1 shard is the whole megatron tensor
        data = shard_from_hf(kind, hf_names, files.read, spec, tp_rank=0, tp_size=1)
    if data.numel() != torch.Size(chunk.shape).numel():  # a bridge bug, not a user error
        raise RuntimeError(f"{chunk.param}: built {tuple(data.shape)}, checkpoint chunk is {chunk.shape}")
    return data.to(chunk.dtype).reshape(chunk.shape)


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
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)),
            properties=TensorProperties(dtype=c.dtype), size=torch.Size(c.global_shape))))
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
                    results.append(WriteResult(index=item.index, size_in_bytes=f.tell() - start,
                                               storage_data=_StorageInfo(file_name, start, f.tell() - start)))
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


def my_share(chunks, rank, world_size):
    """A contiguous run of chunks holding about 1/world_size of the bytes (sequential reads)."""
    total, start, mine = max(sum(c.nbytes for c in chunks), 1), 0, []
    for c in chunks:
        if min(start * world_size // total, world_size - 1) == rank:
            mine.append(c)
        start += c.nbytes
    return mine


# ---------------------------------------------------------------------------------------
# --verify: the checkpoint at a parallel layout vs transformers
# ---------------------------------------------------------------------------------------
def megatron_logits(chunks, ids):
    """(B, T, V_padded) full-vocabulary logits on the last pipeline stage, None elsewhere.
    Runs megatron's pipeline schedule, one sequence per micro-batch. All ranks call this."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    num_seqs, seq_len = ids.shape
    positions = torch.arange(seq_len, device=ids.device).unsqueeze(0)
    outputs = []

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        logits = model(tokens, positions, None)  # (1, T, V/tp) on the last stage

        def collect(output):
            outputs.append(gather_from_tensor_model_parallel_region(output))  # (1, T, V)
            return output.sum() * 0, {}

        return logits, collect

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(ids.split(1)) for _ in chunks], model=chunks,
        num_microbatches=num_seqs, seq_length=seq_len, micro_batch_size=1, forward_only=True)
    return torch.cat(outputs).float().cpu() if outputs else None


def verify(ckpt_dir, hf_dir, spec, stored_dtypes, tp, pp, vpp, ep=1, etp=1, first_stage_layers=None,
           last_stage_layers=None):
    """max |logits_megatron - logits_transformers| over fixed random sequences (every rank
    gets the number). Both sides run in fp32 on the weights as stored in the checkpoint:
    stored_dtypes maps each HF tensor name to the dtype the checkpoint keeps it in (norm
    weights may stay fp32 in a bf16 model: megatron's torch-norm fallback makes them so);
    transformers' fused expert parameters, which no checkpoint name matches, get the
    experts' dtype."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from common.checkpoint import load_model_checkpoint
    from common.dist import init_distributed
    from common.model import build_model

    info = init_distributed(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    seq_len = min(32, spec.max_position_embeddings)
    ids = torch.randint(0, spec.vocab_size, (2 * pp, seq_len), generator=torch.Generator().manual_seed(1234))
    # megatron's MoE layers need sequence parallelism with TP (as the training scripts' --sp)
    chunks = build_model(spec, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first_stage_layers,
                         last_stage_layers=last_stage_layers, dtype=torch.float32,
                         sequence_parallel=spec.moe is not None and tp > 1)
    load_model_checkpoint(ckpt_dir, chunks)  # stored dtype -> fp32 is exact
    for c in chunks:
        c.eval()
    with torch.no_grad():
        logits = megatron_logits(chunks, ids.to(info.device))
    del chunks
    compare = mpu.is_pipeline_last_stage() and info.tp_rank == 0 and info.dp_rank == 0
    diff = float("nan")
    if compare:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            experts = next((d for n, d in stored_dtypes.items() if ".experts." in n), None)
            for name, p in hf.named_parameters():  # the weights as the checkpoint stores them
                p.copy_(p.to(stored_dtypes.get(name, experts)).float())
            reference = hf(input_ids=ids).logits
        diff = (logits[..., : spec.vocab_size] - reference).abs().max().item()
        del hf
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, diff if compare else None)
    return next(d for d in every if d is not None)


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = Parser(description=__doc__)
    # input / output
    ap.add_argument("--hf", required=True, help="HF model directory: config.json + *.safetensors "
                    "(+ tokenizer files, generation_config.json, copied along)")
    ap.add_argument("--out", required=True, help="output checkpoint directory (new or empty; see --force)")
    ap.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                    help="stored dtype; auto = the dtype of the HF weights (float16 becomes bf16)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out that holds an earlier "
                    "checkpoint of this script; it is removed only after the new one is complete")
    ap.add_argument("--no-tokenizer", action="store_true", help="convert a --hf directory that has no tokenizer "
                    "files (the checkpoint then carries none: training from it and merge_to_hf.py's output need "
                    "them added by hand)")
    ap.add_argument("--no-fsync", action="store_true", help="do not fsync the written files (faster on slow "
                    "disks; a machine crash right after the run may then leave a damaged checkpoint)")
    # verification
    ap.add_argument("--verify", action="store_true", help="after writing, load the checkpoint at --tp/--pp/--vpp "
                    "and compare logits with transformers; exit 1 above tolerance (1e-4 fp32, 2e-2 bf16)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size for --verify")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size for --verify")
    ap.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank for --verify")
    ap.add_argument("--first-stage-layers", type=int, default=None, help="decoder layers on the first pipeline "
                    "stage for --verify (default: even when the layers divide by pp*vpp, else automatic)")
    ap.add_argument("--last-stage-layers", type=int, default=None, help="decoder layers on the last pipeline "
                    "stage for --verify (default: automatic, no more than the other stages)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size for --verify (MoE models)")
    ap.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size for --verify (MoE models)")
    return ap.parse_args(argv)


def run(args, created):
    """The conversion; raises on failure (main() turns known failures into messages)."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # -- cheap checks first: nothing is written and megatron is not even imported if they fail
    spec = read_hf_spec(args.hf)
    if not args.no_tokenizer and not any(os.path.isfile(os.path.join(args.hf, name)) for name in TOKENIZER_FILES):
        raise ConversionError(f"{args.hf} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): the checkpoint "
                              "would carry none, so neither training from it nor merge_to_hf.py's output would have a "
                              "tokenizer. Copy the model's tokenizer files into it, or pass --no-tokenizer.")
    out = check_output_dir(args.out, args.force, [args.hf],
                           lambda d: os.path.isfile(os.path.join(d, "metadata.json")))
    files = SafetensorsDir(args.hf)
    ignored = check_hf_weights(files, spec, args.hf)
    if ignored:
        print0(f"note: ignoring {len(ignored)} tensors config.json does not use, e.g. {ignored[:3]}")
    if args.dtype == "auto":
        source = files.tensors["model.embed_tokens.weight"].dtype
        dtype = torch.float32 if source in (torch.float32, torch.float64) else torch.bfloat16
    else:
        dtype = DTYPES[args.dtype]
    split = dict(first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)
    if args.verify:
        check_tool_layout(spec, world_size, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp, **split,
                          flag_prefix="--verify ")
    elif args.ep * args.etp > 1 or args.tp * args.pp > 1 or any(n is not None for n in split.values()):
        raise ConversionError("--tp/--pp/--ep/--etp/--first-stage-layers/--last-stage-layers choose the layout "
                              "--verify loads at; add --verify (the checkpoint itself loads at any layout)")

    # -- the conversion: every rank writes its share of the tensors into <out>.incomplete
    import torch.distributed as dist
    from tqdm import tqdm

    from common.checkpoint import write_meta
    from common.dist import init_distributed

    init_distributed()  # world of N ranks, TP=PP=1: the layout the checkpoint is described in
    tmp = temporary_output(out, created)
    dist.barrier()
    chunks, objects = megatron_layout(spec, dtype)
    mine = my_share(chunks, rank, world_size)
    total = sum(c.nbytes for c in chunks)
    print0(f"converting {args.hf} ({spec.architecture}, {total / 1e9:.2f} GB as {HF_DTYPE_NAMES[dtype]}) "
           f"-> {out} with {world_size} process(es)")
    start = time.time()
    with tqdm(total=sum(c.nbytes for c in mine), unit="B", unit_scale=True, disable=rank != 0,
              desc=f"rank 0 of {world_size}") as progress:
        lazy_dcp_save(tmp, mine, objects if rank == 0 else [], lambda c: chunk_data(c, files, spec),
                      fsync=not args.no_fsync, progress=progress)
    seconds = time.time() - start  # DCP's save ends in a collective: every rank is done
    print0(f"wrote {total / 1e9:.3f} GB in {seconds:.1f} s ({total / 1e9 / seconds:.2f} GB/s)")
    if rank == 0:
        write_megatron_files(tmp)
        write_meta(tmp, dict(kind="converted from HF", architecture=spec.architecture,
                             dtype=HF_DTYPE_NAMES[dtype], source=os.path.abspath(args.hf),
                             source_config=spec.hf_config, format="megatron-core dist_checkpointing (torch_dist)",
                             command=" ".join(sys.argv)), hf_source_dir=args.hf)
    dist.barrier()

    # -- verify before the output gets its final name
    if args.verify:
        stored_dtypes = {hf_name: c.dtype for c in chunks for hf_name in param_rule(c.param, spec)[1]}
        diff = verify(tmp, args.hf, spec, stored_dtypes, args.tp, args.pp, args.vpp, args.ep, args.etp, **split)
        print0(f"max_abs_diff={diff:.3e}")
        if not diff <= VERIFY_TOLERANCE[dtype]:
            print0(f"verify FAILED: the checkpoint's logits differ from transformers by {diff:.3e} > "
                   f"{VERIFY_TOLERANCE[dtype]:g} (tp={args.tp}, pp={args.pp}, ep={args.ep}, etp={args.etp}). It was left in {tmp} for "
                   "inspection; do not train from it.")
            created.clear()  # keep it
            return 1
    if rank == 0:
        finish_output(tmp, out)
    created.clear()
    dist.barrier()
    print0(f"done: {out}  (load it with --mcore-ckpt {out} at any --tp/--pp)")
    return 0


def main(argv=None):
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
