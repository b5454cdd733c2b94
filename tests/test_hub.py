"""Hub names (common/run/hub.py): `--model ORG/NAME`, `--data ORG/NAME`, resolved through the
HuggingFace cache. These machines have no hub access, so everything runs offline
(HF_HUB_OFFLINE=1) against a cache laid out as huggingface_hub lays it out
(<HF_HOME>/hub/{models,datasets}--ORG--NAME/{refs/main, snapshots/<commit>/ -> blobs/}).

    .venv/bin/python -m pytest -q tests/test_hub.py
"""

import hashlib
import json
import os
import shutil

import pytest

from tests.conftest import read_metrics, run_script

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(hf_home, repo_type, repo_id, files):
    """files {relative path: source file} -> the cache entry of repo_id at COMMIT (blobs named
    by content hash, snapshot entries symlinked to them, refs/main naming the commit)."""
    entry = os.path.join(hf_home, "hub", f"{repo_type}s--{repo_id.replace('/', '--')}")
    snapshot = os.path.join(entry, "snapshots", COMMIT)
    os.makedirs(os.path.join(entry, "refs"), exist_ok=True)
    os.makedirs(os.path.join(entry, "blobs"), exist_ok=True)
    with open(os.path.join(entry, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for rel, source in files.items():
        data = open(source, "rb").read()
        blob = os.path.join(entry, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """An offline cache with the embedded model as org/tiny and a gsm8k-like dataset repo
    org/tiny-math with two configs (main, other) and train/test splits in parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.run.embedded import write_embedded_model

    root = tmp_path_factory.mktemp("hub")
    model = write_embedded_model(str(root / "src_model"))
    model_snapshot = put_in_cache(
        root / "home",
        "model",
        "org/tiny",
        {name: os.path.join(model, name) for name in os.listdir(model) if os.path.isfile(os.path.join(model, name))},
    )
    src = root / "src_data"
    src.mkdir()
    for config, n in (("main", 6), ("other", 2)):
        for split in ("train", "test"):
            rows = [{"question": f"{i}=", "answer": f"repeat it #### {i}"} for i in range(n if split == "train" else 3)]
            pq.write_table(pa.Table.from_pylist(rows), src / f"{config}-{split}.parquet")
    # the README's YAML header names the configs and their files, as on the hub (gsm8k's does)
    (src / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
            f"  - split: test\n    path: {c}/test-*\n"
            for c in ("main", "other")
        )
        + "---\n"
    )
    data_snapshot = put_in_cache(
        root / "home",
        "dataset",
        "org/tiny-math",
        {
            "README.md": src / "README.md",
            **{
                f"{c}/{s}-00000-of-00001.parquet": src / f"{c}-{s}.parquet"
                for c in ("main", "other")
                for s in ("train", "test")
            },
        },
    )
    return dict(root=root, home=str(root / "home"), model_snapshot=model_snapshot, data_snapshot=data_snapshot)


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """This process offline against the fixture's cache (huggingface_hub reads its constants at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(hub_cache["home"], "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", hub_cache["home"])
    monkeypatch.setenv("HF_DATASETS_CACHE", os.path.join(hub_cache["root"], "datasets_cache"))
    return hub_cache


def test_resolve(offline, tmp_path):
    from common.run.hub import resolve
    from common.train.guard import UsageError

    assert resolve(None, "--model") is None
    assert resolve(str(tmp_path), "--model") == str(tmp_path)  # a local path: as it is
    assert resolve("org/tiny", "--model") == offline["model_snapshot"]
    assert resolve("org/tiny-math", "--data", repo_type="dataset") == offline["data_snapshot"]
    with pytest.raises(UsageError, match=r"--model org/missing: not in the HuggingFace cache .*HF_HUB_OFFLINE"):
        resolve("org/missing", "--model")
    with pytest.raises(
        UsageError,
        match=r"--model Qwen2-7B: no such file or directory, and not a hub id "
        r"\(ORG/NAME\); did you mean Qwen/Qwen2-7B\?",
    ):
        resolve("Qwen2-7B", "--model")
    with pytest.raises(UsageError, match=r"--data data/train.jsonl: no such file"):
        resolve("data/train.jsonl", "--data", repo_type="dataset")


def test_hub_dataset_configs_and_splits(offline):
    from common.run.data import load_prompts

    snapshot = offline["data_snapshot"]
    train = load_prompts(snapshot, config="main")
    assert [it["prompt"] for it in train] == [f"{i}=" for i in range(6)]
    assert [it["answer"] for it in load_prompts(snapshot, config="other", split="test")] == [
        f"repeat it #### {i}" for i in range(3)
    ]
    with pytest.raises(ValueError, match=r"--data-config"):  # two configs, none chosen
        load_prompts(snapshot)
    with pytest.raises(ValueError, match=r"--data-split"):
        load_prompts(snapshot, config="main", split="validation")


def test_train_grpo_with_hub_names(hub_cache, tmp_path):
    """The whole script offline on hub names: they resolve to the cached snapshots (printed,
    and recorded in config.json), one step trains; a name not in the cache is one line, exit 2."""
    env = dict(HF_HOME=hub_cache["home"], HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "dcache"))
    out = tmp_path / "run"
    proc = run_script(
        "train_grpo.py",
        "--model",
        "org/tiny",
        "--data",
        "org/tiny-math",
        "--data-config",
        "main",
        "--raw-prompts",
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--samples-per-prompt",
        "2",
        "--micro-batch-size",
        "4",
        "--max-new-tokens",
        "2",
        "--out",
        out,
        env=env,
    )
    assert f"--model org/tiny: {hub_cache['model_snapshot']}" in proc.stdout
    config = json.load(open(out / "config.json"))
    assert config["args"]["model"] == hub_cache["model_snapshot"]
    assert config["args"]["data"] == hub_cache["data_snapshot"]
    assert len(read_metrics(out)) == 1
    shutil.rmtree(out)
    proc = run_script("train_grpo.py", "--model", "org/absent", "--out", out, env=env, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "train_grpo.py: error: --model org/absent: not in the HuggingFace cache "
        + os.path.join(hub_cache["home"], "hub")
        + " and HF_HUB_OFFLINE is set: download it where there is network (hf download org/absent) into that cache, "
        "or pass a local directory (see --help)"
    )
