"""merge_to_hf.py's side of a vision-language source (Qwen3.5 as released, common/model/bridge_vl.py): the
trained language model written back as the vision-language checkpoint, beside the source's vision tower.

    source = vision_source(src_dir, spec)     the source's config.json and vision-tower tensor names, checked
    checkpoint_name(name)                     (common/model/bridge_vl.py) a text tensor's name in it
    config, notes = vl_config(source)         the config.json to write (merge_to_hf.py sets its dtype), notes

Why: vLLM 0.26 registers Qwen3.5 only as its vision-language architectures, so the text CausalLM that
merge_to_hf.py writes by default loads in transformers but not in vLLM; this layout loads in both (and
serves images again: the vision tower is the source's, untrained).
"""

import json
import os
from dataclasses import dataclass

from common.model.bridge_vl import text_config
from common.model.weights_load import HFCheckpointReader
from common.run.cli import ConversionError

VISION_PREFIX = "model.visual."


@dataclass
class VisionSource:
    src_dir: str
    config: dict  # the source's whole config.json (text_config, vision_config, ...)
    reader: HFCheckpointReader  # its safetensors, read by their stored names
    names: list  # the vision tower's tensor names (model.visual.*), in order


def vision_source(src_dir, spec):
    """The checked vision-language source of --vision-from: its config.json must be a vision-language one
    whose language model is the checkpoint's (architecture, width, depth, vocabulary), and its safetensors
    must hold the vision tower. ConversionError (one paragraph) otherwise."""
    path = os.path.join(src_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"--vision-from {src_dir}: no config.json there (pass the source HF model directory)")
    with open(path) as f:
        config = json.load(f)
    text, is_vl = text_config(config)
    if not is_vl:
        raise ConversionError(
            f"--vision-from {src_dir} is not a vision-language checkpoint (architectures {config.get('architectures')}"
            "): pass the released Qwen3.5 directory the run started from, or leave --vision-from out to write the "
            "text model"
        )
    mine = (spec.architecture, spec.hidden_size, spec.num_layers, spec.vocab_size)
    theirs = (text["architectures"][0], text.get("hidden_size"), text.get("num_hidden_layers"), text.get("vocab_size"))
    if theirs != mine:
        raise ConversionError(
            f"--vision-from {src_dir}: its language model (architecture, hidden size, layers, vocabulary) is "
            f"{theirs}, the checkpoint's is {mine}: pass the model the run started from"
        )
    try:
        reader = HFCheckpointReader(src_dir)
    except (FileNotFoundError, OSError) as e:
        raise ConversionError(f"--vision-from {src_dir}: {e}") from None
    names = [name for name in reader.names() if name.startswith(VISION_PREFIX)]
    if not names:
        raise ConversionError(f"--vision-from {src_dir}: its safetensors hold no vision tower ({VISION_PREFIX}*)")
    return VisionSource(src_dir, config, reader, names)


def vl_config(source):
    """(config.json to write: a copy of the source's, notes to print). The source's multi-token-prediction
    layers are not trained and not written: the config says 0 of them."""
    config, notes = json.loads(json.dumps(source.config)), []
    mtp = config["text_config"].get("mtp_num_hidden_layers")
    if mtp:
        config["text_config"]["mtp_num_hidden_layers"] = 0
        notes.append(
            f"note: the source's {mtp} multi-token-prediction layer(s) (mtp.*) are not part of the trained model "
            "and are not written; config.json says mtp_num_hidden_layers: 0"
        )
    notes.append(
        f"note: the vision tower ({len(source.names)} tensors, {VISION_PREFIX}*) is the source's, untrained, "
        f"copied from {source.src_dir}"
    )
    return config, notes
