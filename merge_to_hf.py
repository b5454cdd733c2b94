"""Merge a Megatron-Core checkpoint back into a HuggingFace model directory.

--ckpt accepts a checkpoint written by convert_hf_to_mcore.py, a training checkpoint step
(<run>/checkpoints/step_000100; only its model part is read, never the optimizer state) or
a training checkpoint root (<run>/checkpoints: the step its `latest` file names). The output:
  model-0000i-of-0000n.safetensors   shards of at most --max-shard-size
  model.safetensors.index.json
  config.json                        the source's, with the dtype set to the one written
                                     (by default the source's own: --dtype)
  generation_config.json, tokenizer files
It loads unchanged with transformers `from_pretrained` and with vLLM. HF -> mcore -> HF is
bit-exact for every tensor (same dtype).

How: the checkpoint is loaded into a GPTModel at --tp/--pp (dist_checkpointing reshards to
any layout), then common/model/weights.py:export_hf_weights streams full HF tensors (TP shards
all-gathered, PP stages broadcast, in buckets); rank 0 writes each shard file as soon as it
is full. Host memory: this rank's part of the model + one shard + two export buckets.

  python merge_to_hf.py --ckpt /ckpt/qwen2-7b-mcore --out /models/qwen2-7b-rl             # 1 CPU
  python merge_to_hf.py --ckpt runs/grpo-Qwen2-7B/checkpoints --out /models/grpo-latest --dtype bf16
  torchrun --nproc_per_node 8 merge_to_hf.py --ckpt DIR --out DIR --tp 8                   # big models
  sbatch launch/slurm.sh merge_to_hf.py --ckpt DIR --out DIR --tp 8

The HF side files (config.json, tokenizer, generation_config.json) come from the first of:
--hf-files DIR, <ckpt>/hf, <ckpt>/../hf, <ckpt>/../../hf (the run directory of a training step).

A vision-language source (Qwen3.5 as released) is written as the text CausalLM it trained, or with
--vision-from SOURCE_DIR as the vision-language checkpoint: the language model under model.language_model.
beside SOURCE_DIR's vision tower (copied, untrained) and its config.json, which vLLM 0.26 serves (it has no
text-only Qwen3.5) and transformers loads as the ForConditionalGeneration.

A LoRA run's checkpoint (--lora-rank) holds the adapters alone and names its base in rl_meta.json: the
base is loaded from there (or --lora-base DIR), the adapters on it, and --lora merged (default) writes the
merged model (W + alpha/r B A), --lora peft a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors, PEFT's names) that peft and vLLM load on the base (docs/lora.md).

Exit codes: 0 done, 2 bad input or disk full (a one-paragraph message, no traceback), 130
interrupted. The output is written to <out>.incomplete and renamed to <out> at the end.
"""

import json
import os
import shutil
import sys

import torch

from common.model.bridge_vl import checkpoint_name
from common.run.cli import (
    DTYPES,
    HF_DTYPE_NAMES,
    ConversionError,
    Parser,
    check_output_dir,
    check_tool_layout,
    finish_output,
    read_hf_spec,
    root_cause,
    run_cli,
    temporary_output,
)
from common.run.dist import print0
from common.run.lora_export import load_lora_base, lora_settings, write_peft_adapter
from common.run.vl_export import vision_source, vl_config

SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def resolve_checkpoint(path):
    """The model checkpoint directory --ckpt means, or a ConversionError saying why it is none."""
    from common.train.checkpoint import is_model_checkpoint
    from common.train.resume import check_step_dir

    path = os.path.abspath(path)
    latest = os.path.join(path, "latest")
    if not is_model_checkpoint(path) and os.path.isfile(latest):  # a training checkpoint root
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    if not is_model_checkpoint(path):
        raise ConversionError(
            f"--ckpt {path} is not a checkpoint (no metadata.json). Pass a directory written by "
            "convert_hf_to_mcore.py, a training checkpoint step (.../checkpoints/step_000100) or the "
            "checkpoints directory holding `latest`."
        )
    if os.path.isfile(os.path.join(path, "train_state.json")):  # a training step: is it complete?
        problem = check_step_dir(path)
        if problem:
            raise ConversionError(
                f"training checkpoint {path} is damaged or incomplete: {problem}. Merge an older step instead."
            )
    return path


def find_hf_files(ckpt, explicit):
    candidates = (
        [explicit]
        if explicit
        else [os.path.join(ckpt, "hf"), os.path.join(ckpt, "..", "hf"), os.path.join(ckpt, "..", "..", "hf")]
    )
    for d in candidates:
        if os.path.isfile(os.path.join(d, "config.json")):
            return os.path.abspath(d)
    raise ConversionError(
        f"cannot find the HF config.json for {ckpt}: looked in {', '.join(map(os.path.abspath, candidates))}. "
        "Pass --hf-files DIR (the source HF model directory, or any directory with its config.json "
        "and tokenizer files)."
    )


def stored_dtype(ckpt):
    """The dtype the checkpoint stores the model in (read from DCP's .metadata; a LoRA checkpoint's:
    its adapters', the base's own)."""
    from torch.distributed.checkpoint import FileSystemReader

    from common.model.lora import is_adapter

    tensors = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    adapters = [meta for name, meta in tensors.items() if is_adapter(name)]
    if adapters and "embedding.word_embeddings.weight" not in tensors:
        return adapters[0].properties.dtype
    if "embedding.word_embeddings.weight" not in tensors:
        raise ConversionError(f"--ckpt {ckpt} holds no GPT model weights (no embedding.word_embeddings.weight).")
    return tensors["embedding.word_embeddings.weight"].properties.dtype


def source_dtype(hf_config):
    """The dtype the source model was published in (config.json's torch_dtype, `dtype` in
    transformers 5) when it is one this tool writes (bfloat16, float32), else None."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(name)


def parse_size(text):
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20 (the units transformers' max_shard_size accepts)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


def write_safetensors(path, tensors):
    """A .safetensors file from a dict of CPU tensors, written with plain file I/O (so a full
    disk is an OSError like any other write, and no serialised copy is made in memory)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to a multiple of 8 bytes
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def parse_args(argv=None):
    ap = Parser(description=__doc__)
    # input / output
    ap.add_argument(
        "--ckpt",
        required=True,
        help="converted checkpoint, training checkpoint step, or "
        "training checkpoint root (the step named by its `latest` file)",
    )
    ap.add_argument("--out", required=True, help="output HF directory (new or empty; see --force)")
    ap.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (a single larger tensor gets a file of its own)",
    )
    ap.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help=(
            "dtype written; auto = the source model's (torch_dtype of the config.json found with the HF files: "
            "bfloat16 or float32), else the dtype the checkpoint stores"
        ),
    )
    ap.add_argument(
        "--hf-files",
        default=None,
        help="directory with the HF config.json / tokenizer / "
        "generation_config.json (default: the checkpoint's hf/ or its run's hf/)",
    )
    ap.add_argument(
        "--vision-from",
        default=None,
        help=(
            "a vision-language source's HF directory (Qwen3.5 as released): write the vision-language checkpoint, "
            "the trained language model beside its vision tower (default: the text CausalLM)"
        ),
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty --out that holds an earlier "
        "HF export; it is removed only after the new one is complete",
    )
    # parallel layout to load at (torchrun with tp*pp processes, or a multiple)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load the checkpoint at")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load the checkpoint at")
    ap.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the first pipeline stage (default: even when the layers divide by pp, else automatic)",
    )
    ap.add_argument(
        "--last-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the last pipeline stage (default: automatic, no more than the other stages)",
    )
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size to load the checkpoint at (MoE models)")
    ap.add_argument(
        "--etp", type=int, default=1, help="expert tensor-parallel size to load the checkpoint at (MoE models)"
    )
    ap.add_argument("--bucket-mb", type=int, default=256, help="export bucket size (MB of full tensors)")
    ap.add_argument(
        "--lora",
        choices=["merged", "peft"],
        default="merged",
        help=(
            "a LoRA checkpoint: merged = the base with W + alpha/r B A written as a full HF model; peft = a PEFT "
            "adapter directory (adapter_config.json, adapter_model.safetensors) for peft / vLLM on the base"
        ),
    )
    ap.add_argument(
        "--lora-base",
        default=None,
        help=(
            "a LoRA checkpoint's base model: HF dir or converted megatron checkpoint (default: the one its "
            "rl_meta.json names)"
        ),
    )
    return ap.parse_args(argv)


def run(args, created):
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # -- cheap checks: nothing is written if one fails
    ckpt = resolve_checkpoint(args.ckpt)
    hf_files = find_hf_files(ckpt, args.hf_files)
    spec = read_hf_spec(hf_files)
    lora = lora_settings(ckpt, args.lora_base)  # None: a whole model
    if args.lora == "peft" and not lora:
        raise ConversionError(f"--lora peft: {ckpt} holds a whole model, not LoRA adapters; drop --lora peft")
    vision = vision_source(args.vision_from, spec) if args.vision_from else None
    out = check_output_dir(
        args.out,
        args.force,
        [ckpt, hf_files],
        lambda d: (
            os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
            or os.path.isfile(os.path.join(d, "model.safetensors"))
            or os.path.isfile(os.path.join(d, "adapter_config.json"))
        ),
    )
    max_shard_bytes = parse_size(args.max_shard_size)
    stored = stored_dtype(ckpt)
    # auto: as the source model was published (a CPU run trains a bf16 model in fp32), else as stored
    dtype = (source_dtype(spec.hf_config) or stored) if args.dtype == "auto" else DTYPES[args.dtype]
    if dtype not in SAFETENSORS_NAMES:
        raise ConversionError(f"the checkpoint stores {stored}; pass --dtype bf16 or --dtype fp32")
    split = dict(first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)
    check_tool_layout(spec, world_size, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, **split)

    # -- load the model part of the checkpoint at this layout
    import torch.distributed as dist
    from tqdm import tqdm

    from common.model.bridge import expected_hf_names, stage_layers
    from common.model.gpt import build_model
    from common.model.weights import export_hf_weights
    from common.run.dist import init_distributed
    from common.train.checkpoint import HF_SMALL_FILES, load_model_checkpoint

    init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    print0(
        f"merging {ckpt} ({spec.architecture}, stored as {HF_DTYPE_NAMES.get(stored, stored)}) -> {out} "
        f"as {HF_DTYPE_NAMES[dtype]}, tp={args.tp} pp={args.pp} ep={args.ep} etp={args.etp}"
    )
    chunks = build_model(
        spec,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        **split,
        dtype=stored,
        sequence_parallel=spec.moe is not None and args.tp > 1,
    )  # (megatron: MoE + TP needs SP)
    print0(f"layers per pipeline stage: {stage_layers(chunks[0].config)}")
    try:
        if lora:  # the base first, then the adapters on it (the checkpoint holds those alone)
            load_lora_base(chunks, spec, lora)
        load_model_checkpoint(ckpt, chunks)  # the model part only, at this layout
    except BaseException as e:  # torch's DCP wraps the loader's errors in a BaseException
        cause = root_cause(e)
        if isinstance(cause, (KeyError, RuntimeError)) or type(cause).__name__ == "CheckpointingException":
            raise ConversionError(f"{ckpt} does not match {hf_files}/config.json: {cause}") from None
        raise
    tmp = temporary_output(out, created)
    dist.barrier()
    if lora and args.lora == "peft":
        write_peft_adapter(chunks, spec, lora, tmp, dtype, rank)
        if rank == 0:
            finish_output(tmp, out)
            print0(f"done: {out}  (a PEFT adapter of rank {lora['rank']} on {lora['base']})")
        created.clear()
        dist.barrier()
        return 0

    # -- stream every HF tensor; rank 0 writes a shard whenever the next tensor would overflow it
    shard, shard_bytes, files, weight_map, total_bytes, non_finite = {}, 0, [], {}, 0, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"  # renamed to -of-N below
        write_safetensors(os.path.join(tmp, name), shard)
        files.append(name)
        weight_map.update({tensor_name: name for tensor_name in shard})
        shard.clear()

    def add(name, tensor):  # rank 0: into the shard, which is written first if the tensor would overflow it
        nonlocal shard_bytes, total_bytes
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        # yielded tensors are views into the export bucket (on the GPU, if any): copy them out
        shard[name] = tensor.to("cpu", copy=True).contiguous()
        shard_bytes += nbytes
        total_bytes += nbytes
        progress.update(1)

    total = len(expected_hf_names(spec)) + (len(vision.names) if vision else 0)
    with tqdm(total=total, unit="tensor", disable=rank != 0) as progress:
        for name, tensor in export_hf_weights(chunks, spec, dtype=dtype, bucket_mb=args.bucket_mb):
            if not torch.isfinite(tensor).all():  # every rank holds the full tensor: all refuse alike
                non_finite.append(name)
            if rank != 0 or non_finite:  # every rank consumes the generator (it runs collectives)
                continue
            add(checkpoint_name(name) if vision else name, tensor)
        for name in vision.names if vision and rank == 0 and not non_finite else []:  # the source's, untrained
            add(name, vision.reader.read(name).to(dtype))
        if rank == 0 and shard and not non_finite:
            flush()
    del chunks
    if non_finite:
        raise ConversionError(
            f"{ckpt} holds NaN/Inf values in {len(non_finite)} tensors ({', '.join(non_finite[:5])}"
            f"{', ...' if len(non_finite) > 5 else ''}); nothing was written. Such a model cannot "
            "be used: export an earlier checkpoint (the training scripts stop before a "
            "non-finite update, so their checkpoints hold none)."
        )

    # -- index, config, generation config, tokenizer, then the final name
    if rank == 0:
        names = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
        for old, new in names.items():
            os.rename(os.path.join(tmp, old), os.path.join(tmp, new))
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {k: names[v] for k, v in sorted(weight_map.items())},
        }
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        # transformers 5 writes "dtype", 4.x "torch_dtype"; vLLM reads either through transformers
        config = dict(spec.hf_config)
        if config.get("num_nextn_predict_layers"):  # DeepSeek-V3's multi-token-prediction layers
            mtp = range(spec.num_layers, spec.num_layers + config["num_nextn_predict_layers"])  # after the decoder's
            print0(
                f"note: the {len(mtp)} multi-token-prediction layer(s) of the source "
                f"({', '.join(f'model.layers.{i}.*' for i in mtp)}) are not part of the trained model and are not "
                "written; config.json says num_nextn_predict_layers: 0 (for speculative decoding copy them from the "
                "source)"
            )
            config["num_nextn_predict_layers"] = 0
        if config.get("mtp_num_hidden_layers") and not vision:  # Qwen3.5's MTP block (mtp.*); vl_config says it
            print0(
                f"note: the source's {config['mtp_num_hidden_layers']} multi-token-prediction layer(s) (mtp.*) are "
                "not part of the trained model and are not written; config.json says mtp_num_hidden_layers: 0"
            )
            config["mtp_num_hidden_layers"] = 0
        if config.pop("quantization_config", None):  # gpt-oss's MXFP4 experts, dequantised: written as --dtype
            print0(f"note: the source's quantized expert weights (MXFP4) are written dequantised in {dtype}")
        if vision:  # the source's vision-language config.json (its text_config is the trained model's)
            config, notes = vl_config(vision)
            print0("\n".join(notes))
        for key in ("dtype", "torch_dtype"):
            if key in config or key == "dtype":
                config[key] = HF_DTYPE_NAMES[dtype]
        if spec.vision_language and not vision:
            print0(
                "note: written as the text CausalLM of the vision-language source; vLLM 0.26 serves Qwen3.5 only "
                "as the vision-language model: --vision-from SOURCE_DIR writes that"
            )
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for name in HF_SMALL_FILES:
            if name != "config.json" and os.path.isfile(os.path.join(hf_files, name)):
                shutil.copy2(os.path.join(hf_files, name), os.path.join(tmp, name))
        if not os.path.isfile(os.path.join(tmp, "generation_config.json")):
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp)).save_pretrained(tmp)
        finish_output(tmp, out)
        print0(f"done: {out}  ({len(files)} safetensors file(s), {total_bytes / 1e9:.3f} GB)")
    created.clear()
    dist.barrier()
    return 0


def main(argv=None):
    from common.run.console import quiet_known_warnings

    quiet_known_warnings()  # before megatron is imported: its import-time notices (common/run/console.py says why)
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
