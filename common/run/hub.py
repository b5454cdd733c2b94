"""HuggingFace Hub names for models and datasets: `--model Qwen/Qwen2-7B`, `--data openai/gsm8k`.

    path = resolve("Qwen/Qwen2-7B", "--model")                   # a local directory
    path = resolve("openai/gsm8k", "--data", repo_type="dataset")

A local path is used as it is. An ORG/NAME that is not a local path is a hub repository: its
snapshot directory in the HuggingFace cache is returned, downloaded on first use by
huggingface_hub's own machinery (snapshot_download), so its settings apply unchanged:
HF_HOME / HF_HUB_CACHE (where), HF_HUB_OFFLINE=1 (never touch the network: the cache only),
HF_TOKEN (gated models). The scripts call this in common/run/preflight.py, before anything heavy.

One download per node: every rank resolves under one file lock per repository in the cache
directory, so the first rank downloads while the others wait, then finds everything cached
(on a shared filesystem one rank of the whole job downloads). Every rank resolves the same
snapshot (the revision `main` points to when it asks).

Only what the scripts read is downloaded for a model: config, safetensors weights and their
index, tokenizer and generation config (no *.bin / *.pth / original/ duplicates).
"""

import os
import re

from common.train.guard import UsageError

MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# a bare model name -> the organisation that publishes it (for the error's suggestion)
_ORGS = {
    "qwen": "Qwen",
    "llama": "meta-llama",
    "meta-llama": "meta-llama",
    "mistral": "mistralai",
    "mixtral": "mistralai",
    "deepseek": "deepseek-ai",
    "gemma": "google",
    "phi": "microsoft",
}


def is_hub_id(name):
    """ORG/NAME, as the hub spells repository ids (no local path of that name is checked here)."""
    return bool(_HUB_ID.match(name or ""))


def suggest(name):
    """The hub id a bare model name most likely means ("Qwen2-7B" -> "Qwen/Qwen2-7B"), or None."""
    lower = name.lower()
    for prefix, org in _ORGS.items():
        if lower.startswith(prefix):
            return f"{org}/{name}"
    return None


CONFIG_FILES = ["config.json"]  # what a dry run reads of a model


def resolve(name, flag, repo_type="model", files=None):
    """The local directory (or file) that `name` stands for; UsageError (one line) if none.
    files: the patterns to download of a model (default MODEL_FILES)."""
    if name is None or os.path.exists(name):
        return name
    if repo_type == "dataset" and os.path.splitext(name)[1].lower() in (".jsonl", ".json", ".parquet"):
        raise UsageError(f"{flag} {name}: no such file")
    if not is_hub_id(name):
        hint = suggest(name) if repo_type == "model" else None
        raise UsageError(
            f"{flag} {name}: no such file or directory, and not a hub id (ORG/NAME)"
            + (f"; did you mean {hint}?" if hint else "")
        )
    import huggingface_hub
    from filelock import FileLock
    from huggingface_hub import constants, errors

    from common.run.dist import launcher_rank

    if launcher_rank() != 0:
        huggingface_hub.utils.disable_progress_bars()  # one set of download bars, from rank 0
    cache = constants.HF_HUB_CACHE
    offline = constants.HF_HUB_OFFLINE
    os.makedirs(os.path.join(cache, ".locks"), exist_ok=True)
    lock = os.path.join(cache, ".locks", f"{repo_type}s--{name.replace('/', '--')}.resolve.lock")
    try:
        with FileLock(lock):  # the first rank downloads, the others wait and find it cached
            return huggingface_hub.snapshot_download(
                name, repo_type=repo_type, allow_patterns=(files or MODEL_FILES) if repo_type == "model" else None
            )
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        if offline:
            raise UsageError(
                f"{flag} {name}: not in the HuggingFace cache {cache} and HF_HUB_OFFLINE is set: "
                f"download it where there is network (hf download {name}"
                f"{' --repo-type dataset' if repo_type == 'dataset' else ''}) into that cache, "
                "or pass a local directory"
            ) from None
        raise UsageError(
            f"{flag} {name}: cannot reach the hub and it is not cached in {cache} "
            f"({type(e).__name__}); pass a local directory"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UsageError(
            f"{flag} {name}: neither a local path nor a {repo_type} on the hub (a private one needs HF_TOKEN)"
        ) from None
    except errors.GatedRepoError:
        raise UsageError(
            f"{flag} {name}: a gated {repo_type}: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except errors.HfHubHTTPError as e:
        raise UsageError(f"{flag} {name}: the hub answered {e}") from None
