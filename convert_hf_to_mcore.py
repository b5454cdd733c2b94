"""Convert a HuggingFace checkpoint into a Megatron-Core dist_checkpointing checkpoint.

The output is what `GPTModel.sharded_state_dict()` saves at TP=1/PP=1 (torch_dist format,
layers stacked on a leading axis), so the training scripts load it at any TP/PP/VPP layout
(`--mcore-ckpt DIR`; common/train/checkpoint.py:load_model_checkpoint), plus
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
not bf16 arithmetic. The output only gets its final name after it passed. The file I/O (plain safetensors reads,
the streaming DCP writer) is common/run/convert_io.py.

Exit codes: 0 done, 1 --verify failed, 2 bad input or disk full (a one-paragraph message,
no traceback), 130 interrupted. Everything is written to <out>.incomplete and renamed to
<out> at the very end, so an interrupted run never leaves something that looks complete.
"""

import os
import sys
import time

import torch

from common.model.bridge import expected_hf_shape, param_rule, shard_from_hf
from common.run.cli import (
    DTYPES,
    HF_DTYPE_NAMES,
    ConversionError,
    Parser,
    check_output_dir,
    check_tool_layout,
    finish_output,
    read_hf_spec,
    run_cli,
    temporary_output,
)
from common.run.convert_io import Chunk, SafetensorsDir, check_hf_weights, lazy_dcp_save, write_megatron_files
from common.run.dist import print0
from common.run.model_checks import TOKENIZER_FILES

VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------
# The checkpoint layout (written by common/run/convert_io.py's lazy DCP save)
# ---------------------------------------------------------------------------------------
def megatron_layout(spec, dtype):
    """(tensor chunks, extra-state objects) exactly as GPTModel.sharded_state_dict() has them at
    TP=1/PP=1. Built on the meta device: shapes only, no memory. Needs megatron's parallel state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel

    from common.model.bridge import gpt_model_kwargs, transformer_config
    from common.model.gpt import decoder_spec

    # As common/model/gpt.py:build_model at TP=PP=1, minus the .cuda(): use_cpu_initialization makes
    # megatron allocate without an explicit device, so the meta context applies (also on a GPU).
    config = transformer_config(spec, params_dtype=dtype, use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec(spec, config),
            pre_process=True,
            post_process=True,
            **gpt_model_kwargs(spec, tp=1),
        )
    chunks, objects = [], []
    for param, sharded in model.sharded_state_dict().items():
        if isinstance(sharded, ShardedObject):  # `_extra_state` of each linear layer
            objects.append(sharded)
            continue
        # linear_fc1 is a factory: megatron stores [gate; up] as two chunks (mlp.py, swiglu)
        pieces = nested_values(sharded.build()) if isinstance(sharded, ShardedTensorFactory) else [sharded]
        for sh in pieces:
            assert sh.flattened_range is None
            chunks.append(
                Chunk(
                    param,
                    sh.key,
                    tuple(sh.global_offset),
                    (1,) * sh.prepend_axis_num + tuple(sh.local_shape),
                    tuple(sh.global_shape),
                    sh.dtype,
                )
            )
    return chunks, objects


def chunk_data(chunk: Chunk, files: SafetensorsDir, spec):
    """The tensor of one checkpoint chunk, built from the HF tensors it comes from."""
    kind, hf_names = param_rule(chunk.param, spec)
    if kind == "gate_up":  # each of the two fc1 chunks is exactly one HF tensor (an MLP's, an expert's)
        data = files.read(hf_names[chunk.offset[-2] // expected_hf_shape(hf_names[0], spec)[0]])
    elif kind in ("gptoss_fc1", "gptoss_fc1_bias"):  # gpt-oss: [gate; up] of one expert, as two chunks
        full = shard_from_hf(kind, hf_names, files.read, spec, tp_rank=0, tp_size=1)
        data = full.chunk(2)[chunk.offset[-2 if kind == "gptoss_fc1" else -1] // spec.moe.ffn_hidden_size]
    elif kind == "vocab":  # the chunk is the padded vocabulary: real rows read in place, the rest 0
        data = torch.empty(chunk.shape, dtype=files.tensors[hf_names[0]].dtype)  # (V_padded, h)
        files.read(hf_names[0], out=data[: spec.vocab_size])
        data[spec.vocab_size :].zero_()  # (the bridge's shard_from_hf would cat: one more copy)
    elif kind in ("gdn_in", "gdn_conv"):  # Qwen3.5's delta net: one chunk per piece (common/model/gdn.py)
        full = shard_from_hf(kind, hf_names, files.read, spec, tp_rank=0, tp_size=1)
        pieces = ["query", "key", "value", "z", "beta", "alpha"]
        sizes = spec.gdn.in_pieces(1)[: 6 if kind == "gdn_in" else 3]
        data = full.split(sizes)[pieces.index(chunk.key.rsplit(".", 1)[1])]
    else:  # the bridge's TP-rank-0-of-1 shard is the whole megatron tensor
        data = shard_from_hf(kind, hf_names, files.read, spec, tp_rank=0, tp_size=1)
    if data.numel() != torch.Size(chunk.shape).numel():  # a bridge bug, not a user error
        raise RuntimeError(f"{chunk.param}: built {tuple(data.shape)}, checkpoint chunk is {chunk.shape}")
    return data.to(chunk.dtype).reshape(chunk.shape)


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
        forward_step_func=forward_step,
        data_iterator=[iter(ids.split(1)) for _ in chunks],
        model=chunks,
        num_microbatches=num_seqs,
        seq_length=seq_len,
        micro_batch_size=1,
        forward_only=True,
    )
    return torch.cat(outputs).float().cpu() if outputs else None


def verify(
    ckpt_dir, hf_dir, spec, stored_dtypes, tp, pp, vpp, ep=1, etp=1, first_stage_layers=None, last_stage_layers=None
):
    """max |logits_megatron - logits_transformers| over fixed random sequences (every rank
    gets the number). Both sides run in fp32 on the weights as stored in the checkpoint:
    stored_dtypes maps each HF tensor name to the dtype the checkpoint keeps it in (norm
    weights may stay fp32 in a bf16 model: megatron's torch-norm fallback makes them so);
    transformers' fused expert parameters, which no checkpoint name matches, get the
    experts' dtype."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model
    from common.run.dist import init_distributed
    from common.train.checkpoint import load_model_checkpoint

    info = init_distributed(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    seq_len = min(32, spec.max_position_embeddings)
    ids = torch.randint(0, spec.vocab_size, (2 * pp, seq_len), generator=torch.Generator().manual_seed(1234))
    # megatron's MoE layers need sequence parallelism with TP (as the training scripts' --sp)
    chunks = build_model(
        spec,
        tp=tp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        dtype=torch.float32,
        sequence_parallel=spec.moe is not None and tp > 1,
    )
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
    ap.add_argument(
        "--hf",
        required=True,
        help="HF model directory: config.json + *.safetensors "
        "(+ tokenizer files, generation_config.json, copied along)",
    )
    ap.add_argument("--out", required=True, help="output checkpoint directory (new or empty; see --force)")
    ap.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="stored dtype; auto = the dtype of the HF weights (float16 becomes bf16)",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty --out that holds an earlier "
        "checkpoint of this script; it is removed only after the new one is complete",
    )
    ap.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="convert a --hf directory that has no tokenizer "
        "files (the checkpoint then carries none: training from it and merge_to_hf.py's output need "
        "them added by hand)",
    )
    ap.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not fsync the written files (faster on slow "
        "disks; a machine crash right after the run may then leave a damaged checkpoint)",
    )
    # verification
    ap.add_argument(
        "--verify",
        action="store_true",
        help="after writing, load the checkpoint at --tp/--pp/--vpp "
        "and compare logits with transformers; exit 1 above tolerance (1e-4 fp32, 2e-2 bf16)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size for --verify")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size for --verify")
    ap.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank for --verify")
    ap.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the first pipeline "
        "stage for --verify (default: even when the layers divide by pp*vpp, else automatic)",
    )
    ap.add_argument(
        "--last-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the last pipeline "
        "stage for --verify (default: automatic, no more than the other stages)",
    )
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size for --verify (MoE models)")
    ap.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size for --verify (MoE models)")
    return ap.parse_args(argv)


def run(args, created):
    """The conversion; raises on failure (main() turns known failures into messages)."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # -- cheap checks first: nothing is written and megatron is not even imported if they fail
    spec = read_hf_spec(args.hf)
    if not args.no_tokenizer and not any(os.path.isfile(os.path.join(args.hf, name)) for name in TOKENIZER_FILES):
        raise ConversionError(
            f"{args.hf} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): the checkpoint "
            "would carry none, so neither training from it nor merge_to_hf.py's output would have a "
            "tokenizer. Copy the model's tokenizer files into it, or pass --no-tokenizer."
        )
    out = check_output_dir(args.out, args.force, [args.hf], lambda d: os.path.isfile(os.path.join(d, "metadata.json")))
    files = SafetensorsDir(args.hf)
    notice = files.as_text_model(spec)  # a vision-language checkpoint: its language model
    if notice:
        print0(notice)
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
        check_tool_layout(
            spec,
            world_size,
            tp=args.tp,
            pp=args.pp,
            vpp=args.vpp,
            ep=args.ep,
            etp=args.etp,
            **split,
            flag_prefix="--verify ",
        )
    elif args.ep * args.etp > 1 or args.tp * args.pp > 1 or any(n is not None for n in split.values()):
        raise ConversionError(
            "--tp/--pp/--ep/--etp/--first-stage-layers/--last-stage-layers choose the layout "
            "--verify loads at; add --verify (the checkpoint itself loads at any layout)"
        )

    # -- the conversion: every rank writes its share of the tensors into <out>.incomplete
    import torch.distributed as dist
    from tqdm import tqdm

    from common.run.dist import init_distributed
    from common.train.checkpoint import write_meta

    init_distributed()  # world of N ranks, TP=PP=1: the layout the checkpoint is described in
    tmp = temporary_output(out, created)
    dist.barrier()
    chunks, objects = megatron_layout(spec, dtype)
    mine = my_share(chunks, rank, world_size)
    total = sum(c.nbytes for c in chunks)
    print0(
        f"converting {args.hf} ({spec.architecture}, {total / 1e9:.2f} GB as {HF_DTYPE_NAMES[dtype]}) "
        f"-> {out} with {world_size} process(es)"
    )
    start = time.time()
    with tqdm(
        total=sum(c.nbytes for c in mine), unit="B", unit_scale=True, disable=rank != 0, desc=f"rank 0 of {world_size}"
    ) as progress:
        lazy_dcp_save(
            tmp,
            mine,
            objects if rank == 0 else [],
            lambda c: chunk_data(c, files, spec),
            fsync=not args.no_fsync,
            progress=progress,
        )
    seconds = time.time() - start  # DCP's save ends in a collective: every rank is done
    print0(f"wrote {total / 1e9:.3f} GB in {seconds:.1f} s ({total / 1e9 / seconds:.2f} GB/s)")
    if rank == 0:
        write_megatron_files(tmp)
        write_meta(
            tmp,
            dict(
                kind="converted from HF",
                architecture=spec.architecture,
                dtype=HF_DTYPE_NAMES[dtype],
                source=os.path.abspath(args.hf),
                source_config=spec.hf_config,
                format="megatron-core dist_checkpointing (torch_dist)",
                command=" ".join(sys.argv),
            ),
            hf_source_dir=args.hf,
        )
    dist.barrier()

    # -- verify before the output gets its final name
    if args.verify:
        stored_dtypes = {hf_name: c.dtype for c in chunks for hf_name in param_rule(c.param, spec)[1]}
        diff = verify(tmp, args.hf, spec, stored_dtypes, args.tp, args.pp, args.vpp, args.ep, args.etp, **split)
        print0(f"max_abs_diff={diff:.3e}")
        if not diff <= VERIFY_TOLERANCE[dtype]:
            print0(
                f"verify FAILED: the checkpoint's logits differ from transformers by {diff:.3e} > "
                f"{VERIFY_TOLERANCE[dtype]:g} (tp={args.tp}, pp={args.pp}, ep={args.ep}, etp={args.etp}). It was "
                f"left in {tmp} for "
                "inspection; do not train from it."
            )
            created.clear()  # keep it
            return 1
    if rank == 0:
        finish_output(tmp, out)
    created.clear()
    dist.barrier()
    print0(f"done: {out}  (load it with --mcore-ckpt {out} at any --tp/--pp)")
    return 0


def main(argv=None):
    from common.run.console import quiet_known_warnings

    quiet_known_warnings()  # before megatron is imported: its import-time notices (common/run/console.py says why)
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
