"""The local Hub emulator (tests/support/hub.py), driven only through the real huggingface_hub client and
transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .support.hub import LocalHub

TOKEN = "hf_local_test_token"
SENTENCES = [
    "the red cat sees the big dog.",
    "the small bird follows the old fish.",
    "a happy fox likes the quiet owl.",
    "the green horse chases the slow cow.",
] * 4
PROMPT = "the red cat sees the quiet owl."


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPTNeoX (safetensors) and a byte-level BPE tokenizer saved with `save_pretrained`, built offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(SENTENCES, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(out)

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=320,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    GPTNeoXForCausalLM(config).save_pretrained(out)
    assert (out / "model.safetensors").is_file()
    return out


def _logits_and_ids(model_source: str | Path, **kwargs) -> tuple[list[int], torch.Tensor]:  # noqa: F821
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_source, **kwargs).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    return ids, logits


def test_fixture_points_the_client_at_the_local_hub(local_hub: LocalHub):
    import huggingface_hub
    from huggingface_hub import constants

    # The suite sets HF_HUB_OFFLINE=1 before huggingface_hub is imported: the fixture must undo the import-time value.
    assert not huggingface_hub.is_offline_mode()
    assert constants.ENDPOINT == local_hub.endpoint
    assert huggingface_hub.hf_hub_url("me/x", "f.txt").startswith(local_hub.endpoint + "/me/x/resolve/main/")
    assert huggingface_hub.get_token() is None  # no ambient token leaks into the tests
    assert huggingface_hub.whoami(token=TOKEN)["name"] == local_hub.username
    assert local_hub.tokens_seen == {TOKEN}


def test_patch_is_undone_with_the_monkeypatch():
    import huggingface_hub.hf_api
    from huggingface_hub import constants

    before = (constants.ENDPOINT, constants.HF_HUB_OFFLINE, constants.HUGGINGFACE_CO_URL_TEMPLATE)
    assert constants.HF_HUB_OFFLINE  # read at import time from the suite's HF_HUB_OFFLINE=1
    monkeypatch = pytest.MonkeyPatch()
    with LocalHub() as hub:
        hub.patch(monkeypatch)
        assert not constants.is_offline_mode() and huggingface_hub.hf_api.api.endpoint == hub.endpoint
        monkeypatch.undo()
    assert (constants.ENDPOINT, constants.HF_HUB_OFFLINE, constants.HUGGINGFACE_CO_URL_TEMPLATE) == before
    assert huggingface_hub.hf_api.api.endpoint == before[0]


def test_private_model_round_trip_through_transformers(local_hub: LocalHub, tiny_model_dir: Path, tmp_path: Path):
    from huggingface_hub import HfApi

    api = HfApi(token=TOKEN)
    repo_url = api.create_repo("me/tiny-neox", private=True, exist_ok=True)
    assert repo_url.repo_id == "me/tiny-neox"
    assert api.create_repo("me/tiny-neox", private=True, exist_ok=True).repo_id == "me/tiny-neox"  # 409 tolerated
    info = api.upload_folder(repo_id="me/tiny-neox", folder_path=tiny_model_dir, commit_message="Add tiny model")

    repo = local_hub.repos["me/tiny-neox"]
    assert repo.private and repo.branches["main"] == info.oid
    local_files = sorted(p.name for p in tiny_model_dir.iterdir())
    assert sorted(api.list_repo_files("me/tiny-neox")) == sorted([".gitattributes", *local_files])
    assert repo.read("model.safetensors") == (tiny_model_dir / "model.safetensors").read_bytes()

    model_info = api.repo_info("me/tiny-neox", files_metadata=True)
    assert model_info.id == "me/tiny-neox" and model_info.private and model_info.sha == info.oid
    sizes = {s.rfilename: s.size for s in model_info.siblings}
    assert sizes["model.safetensors"] == (tiny_model_dir / "model.safetensors").stat().st_size
    assert api.file_exists("me/tiny-neox", "config.json") and not api.file_exists("me/tiny-neox", "nope.json")

    expected_ids, expected_logits = _logits_and_ids(tiny_model_dir)
    ids, logits = _logits_and_ids("me/tiny-neox", token=TOKEN, cache_dir=tmp_path / "fresh-cache")
    assert ids == expected_ids
    assert logits.shape == expected_logits.shape and bool((logits == expected_logits).all())
    assert (tmp_path / "fresh-cache" / "models--me--tiny-neox" / "snapshots" / info.oid / "model.safetensors").exists()
    assert local_hub.tokens_seen == {TOKEN}
    assert not local_hub.errors and not local_hub.unhandled, (local_hub.errors, local_hub.unhandled)


def test_private_repo_is_only_readable_with_a_token(local_hub: LocalHub, tmp_path: Path):
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError

    api = HfApi(token=TOKEN)
    api.create_repo("me/secret", private=True)
    api.upload_file(path_or_fileobj=b"hidden", path_in_repo="a.txt", repo_id="me/secret")

    anonymous = HfApi(token=False)
    with pytest.raises(RepositoryNotFoundError):
        anonymous.model_info("me/secret")
    assert not anonymous.file_exists("me/secret", "a.txt")
    assert not anonymous.repo_exists("me/secret")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("me/secret", "a.txt", token=False, cache_dir=tmp_path / "c1")
    path = hf_hub_download("me/secret", "a.txt", token=TOKEN, cache_dir=tmp_path / "c2")
    assert Path(path).read_bytes() == b"hidden"

    api.update_repo_settings("me/secret", private=False)
    assert anonymous.file_exists("me/secret", "a.txt")


def test_writes_without_a_token_are_refused(local_hub: LocalHub):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    anonymous = HfApi(token=False)
    with pytest.raises(HfHubHTTPError) as excinfo:
        anonymous.create_repo("me/nope")
    assert excinfo.value.response.status_code == 401
    assert local_hub.repos == {}

    HfApi(token=TOKEN).create_repo("me/public")
    before = local_hub.repos["me/public"].branches["main"]
    with pytest.raises(HfHubHTTPError) as excinfo:
        anonymous.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="me/public")
    assert excinfo.value.response.status_code == 401
    assert local_hub.repos["me/public"].branches["main"] == before
    assert local_hub.tokens_seen == {TOKEN}
    assert all(r.token is None for r in local_hub.requests if r.status == 401)


def test_upload_to_a_branch_and_read_it_back(local_hub: LocalHub, tmp_path: Path):
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RevisionNotFoundError

    api = HfApi(token=TOKEN)
    api.create_repo("me/branched")
    main_commit = api.upload_file(path_or_fileobj=b"v1", path_in_repo="weights.txt", repo_id="me/branched")

    with pytest.raises(RevisionNotFoundError):  # as on the Hub: a branch must exist before committing to it
        api.upload_file(path_or_fileobj=b"v2", path_in_repo="weights.txt", repo_id="me/branched", revision="dev")
    api.create_branch("me/branched", branch="dev")
    api.create_branch("me/branched", branch="dev", exist_ok=True)
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.txt").write_bytes(b"v2")
    (folder / "sub" / "extra.json").write_text(json.dumps({"step": 2}))
    dev_commit = api.upload_folder(repo_id="me/branched", folder_path=folder, revision="dev", commit_message="step 2")

    refs = api.list_repo_refs("me/branched")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": main_commit.oid, "dev": dev_commit.oid}
    assert api.repo_info("me/branched", revision="dev").sha == dev_commit.oid
    assert api.repo_info("me/branched").sha == main_commit.oid
    assert sorted(api.list_repo_files("me/branched", revision="dev")) == [
        ".gitattributes",
        "sub/extra.json",
        "weights.txt",
    ]
    assert [e.path for e in api.list_repo_tree("me/branched", revision="dev")] == [
        ".gitattributes",
        "sub",
        "weights.txt",
    ]
    assert [e.path for e in api.list_repo_tree("me/branched", "sub", revision="dev")] == ["sub/extra.json"]
    assert not api.file_exists("me/branched", "sub/extra.json")
    assert api.file_exists("me/branched", "sub/extra.json", revision="dev")

    cache = tmp_path / "cache"
    assert Path(hf_hub_download("me/branched", "weights.txt", revision="dev", cache_dir=cache)).read_bytes() == b"v2"
    assert Path(hf_hub_download("me/branched", "weights.txt", cache_dir=cache)).read_bytes() == b"v1"
    pinned = hf_hub_download("me/branched", "weights.txt", revision=main_commit.oid, cache_dir=cache)
    assert Path(pinned).read_bytes() == b"v1"

    commits = api.list_repo_commits("me/branched", revision="dev")
    assert [c.title for c in commits] == ["step 2", "Upload weights.txt with huggingface_hub", "initial commit"]
    assert commits[1].commit_id == main_commit.oid
    assert local_hub.repo("me/branched").files("dev")["sub/extra.json"] == b'{"step": 2}'


def test_unchanged_files_are_not_committed_again(local_hub: LocalHub, tmp_path: Path):
    from huggingface_hub import HfApi

    api = HfApi(token=TOKEN)
    api.create_repo("me/same")
    (tmp_path / "a.txt").write_text("same")
    first = api.upload_folder(repo_id="me/same", folder_path=tmp_path)
    second = api.upload_folder(repo_id="me/same", folder_path=tmp_path)  # preupload reports the same oid: no commit
    assert first.oid == second.oid
    assert len(api.list_repo_commits("me/same")) == 2


def test_deletions_tags_paths_info_and_repo_deletion(local_hub: LocalHub, tmp_path: Path):
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    api = HfApi(token=TOKEN)
    api.create_repo("me/ops")
    adds = [CommitOperationAdd(f"ckpt/{n}.txt", n.encode()) for n in ("a", "b")] + [
        CommitOperationAdd("keep.txt", b"k")
    ]
    v1 = api.create_commit("me/ops", adds, commit_message="v1")
    api.create_tag("me/ops", tag="v1")
    initial = local_hub.repo("me/ops").history()[-1].id
    with pytest.raises(HfHubHTTPError) as excinfo:  # main moved on since `parent_commit`: refused
        api.create_commit("me/ops", [CommitOperationAdd("x.txt", b"x")], commit_message="stale", parent_commit=initial)
    assert excinfo.value.response.status_code == 412
    ops = [CommitOperationDelete("ckpt/"), CommitOperationDelete("keep.txt"), CommitOperationAdd("new.txt", b"n")]
    api.create_commit("me/ops", ops, commit_message="v2", parent_commit=v1.oid)

    assert api.list_repo_files("me/ops") == [".gitattributes", "new.txt"]
    assert sorted(api.list_repo_files("me/ops", revision="v1")) == [
        ".gitattributes",
        "ckpt/a.txt",
        "ckpt/b.txt",
        "keep.txt",
    ]
    assert [t.name for t in api.list_repo_refs("me/ops").tags] == ["v1"]
    assert Path(hf_hub_download("me/ops", "ckpt/a.txt", revision="v1", cache_dir=tmp_path)).read_bytes() == b"a"
    infos = api.get_paths_info("me/ops", ["ckpt", "keep.txt", "missing"], revision="v1")
    assert [(type(i).__name__, i.path) for i in infos] == [("RepoFolder", "ckpt"), ("RepoFile", "keep.txt")]

    api.delete_tag("me/ops", tag="v1")
    assert not api.revision_exists("me/ops", "v1")
    api.delete_repo("me/ops")
    assert not api.repo_exists("me/ops") and "me/ops" not in local_hub.repos
    with pytest.raises(RepositoryNotFoundError):
        api.delete_repo("me/ops")
    api.delete_repo("me/ops", missing_ok=True)


@pytest.mark.parametrize("lfs_threshold", [None, 1024 * 1024], ids=["regular", "lfs"])
def test_a_few_megabytes_of_safetensors_upload_and_download(
    lfs_threshold, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    import torch
    from huggingface_hub import HfApi, hf_hub_download
    from safetensors.torch import save_file

    big = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(3 * 256 * 1024, dtype=torch.float32).reshape(-1, 256)}, str(big))  # 3 MiB
    with LocalHub(lfs_threshold=lfs_threshold) as hub:
        hub.patch(monkeypatch, cache_dir=tmp_path / "cache")
        api = HfApi(token=TOKEN)
        api.create_repo("me/big")
        api.upload_file(path_or_fileobj=big, path_in_repo="model.safetensors", repo_id="me/big")
        (entry,) = [e for e in api.list_repo_tree("me/big") if e.path == "model.safetensors"]
        assert entry.size == big.stat().st_size
        assert (entry.lfs is not None) == (lfs_threshold is not None)
        downloaded = Path(hf_hub_download("me/big", "model.safetensors"))
        assert downloaded.read_bytes() == big.read_bytes()
        assert any("/resolve/main/model.safetensors" in r.path and r.method == "HEAD" for r in hub.requests)
        lfs_puts = [r for r in hub.requests if r.method == "PUT" and r.path.startswith("/__lfs/upload/")]
        assert len(lfs_puts) == (1 if lfs_threshold else 0)
        assert not hub.errors and not hub.unhandled, (hub.errors, hub.unhandled)


def test_dataset_repo(local_hub: LocalHub, tmp_path: Path):
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi(token=TOKEN)
    api.create_repo("me/corpus", repo_type="dataset")
    api.upload_file(
        path_or_fileobj=b'{"text": "hi"}\n', path_in_repo="train.jsonl", repo_id="me/corpus", repo_type="dataset"
    )
    assert "datasets/me/corpus" in local_hub.repos
    assert api.list_repo_files("me/corpus", repo_type="dataset") == [".gitattributes", "train.jsonl"]
    folder = Path(snapshot_download("me/corpus", repo_type="dataset", cache_dir=tmp_path / "cache"))
    assert (folder / "train.jsonl").read_text() == '{"text": "hi"}\n'


@pytest.mark.slow
def test_a_subprocess_downloads_the_model_with_the_env_helper(
    local_hub: LocalHub, tiny_model_dir: Path, tmp_path: Path
):
    from huggingface_hub import HfApi

    api = HfApi(token=TOKEN)
    api.create_repo("me/tiny-neox", private=True)
    api.upload_folder(repo_id="me/tiny-neox", folder_path=tiny_model_dir)
    expected_ids, expected_logits = _logits_and_ids(tiny_model_dir)

    code = (
        "import json, os, sys, torch\n"
        "from huggingface_hub import snapshot_download\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "assert os.environ['HF_ENDPOINT'].startswith('http://127.0.0.1:')\n"
        "folder = snapshot_download('me/tiny-neox')\n"
        "tok = AutoTokenizer.from_pretrained('me/tiny-neox')\n"
        "model = AutoModelForCausalLM.from_pretrained('me/tiny-neox').eval()\n"
        f"ids = tok({PROMPT!r})['input_ids']\n"
        "with torch.no_grad():\n"
        "    logits = model(torch.tensor([ids])).logits\n"
        "print(json.dumps({'folder': folder, 'ids': ids, 'logits': logits.flatten().tolist()}))\n"
    )
    env = local_hub.subprocess_env(token=TOKEN, cache_dir=tmp_path / "child-cache")
    assert env["HF_HUB_OFFLINE"] == "0"  # although this test process runs with HF_HUB_OFFLINE=1
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["folder"].startswith(str(tmp_path / "child-cache"))
    assert out["ids"] == expected_ids
    assert out["logits"] == pytest.approx(expected_logits.flatten().tolist(), abs=1e-6)
    assert TOKEN in local_hub.tokens_seen
