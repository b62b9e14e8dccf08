"""Trained models out of a job as Hugging Face folders: Hugging Face's own transformers loads them
and computes what our models compute; the manifest lists every file with its hash and a folder is
replaced whole; a job's DCP checkpoint exports on one process; bad input names the field."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from typer.testing import CliRunner

from nereus.cli import app
from runtime import files
from runtime.planner.catalog import LLAMA_3_1_ROPE, ModelConfig, RopeScaling, default_catalog
from runtime.ppo import export
from runtime.ppo.model import build_model
from runtime.ppo.weights import read_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = default_catalog().model("tiny-sft")
CONFIGS = [
    TINY,  # a Llama
    dataclasses.replace(TINY, name="tiny-tied", tie_embeddings=True, num_kv_heads=2),
    dataclasses.replace(TINY, name="tiny-qkv-bias", qkv_bias=True),  # a Qwen2 there
    dataclasses.replace(TINY, name="tiny-llama3-rope", rope_theta=500_000.0, rms_norm_eps=1e-6),
    # Llama 3.1's RoPE scaling, its band moved down to the test's positions so that frequencies
    # fall in all three of its parts (stretched, blended, kept) and rotate visibly within them.
    dataclasses.replace(
        TINY,
        name="tiny-llama3.1-rope-scaling",
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
]


def _tokens(config: ModelConfig, seed: int = 0, length: int = 13) -> torch.Tensor:
    return torch.randint(
        4, config.vocab_size, (3, length), generator=torch.Generator().manual_seed(seed)
    )


def _with_random_biases(model) -> None:
    """Seeded init zeroes biases; random ones show that they land where transformers reads them."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_transformers_loads_an_exported_actor_and_computes_the_same_logits(tmp_path, config):
    model = build_model(config, scalar_head=False, seed=3)
    _with_random_biases(model)
    folder = export.write_hf_folder(tmp_path / "actor", config, model.state_dict(), dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected
    tokens = _tokens(config, length=40)
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    if config.rope_scaling is not None:  # the scaling is in the folder and changes the logits
        assert theirs.config.rope_scaling["rope_type"] == "llama3"
        unscaled = build_model(
            dataclasses.replace(config, rope_scaling=None), scalar_head=False, seed=3
        )
        _with_random_biases(unscaled)
        with torch.no_grad():
            assert not torch.allclose(unscaled(tokens), model(tokens), rtol=1e-3, atol=1e-3)


def test_transformers_loads_an_exported_critic_as_a_one_label_sequence_classifier(tmp_path):
    model = build_model(TINY, scalar_head=True, seed=4)
    folder = export.write_hf_folder(
        tmp_path / "critic",
        TINY,
        model.state_dict(),
        scalar_head=True,
        dtype="float32",
        pad_token_id=0,
    )
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    )
    tokens = _tokens(TINY, seed=1)  # no padding: the score is the last token's
    with torch.no_grad():
        ours = model.last_token_score(tokens, torch.ones_like(tokens, dtype=torch.bool))
        torch.testing.assert_close(theirs(tokens).logits.squeeze(-1), ours, rtol=1e-5, atol=1e-5)


def test_the_manifest_lists_every_file_and_a_folder_is_replaced_whole(tmp_path):
    first = build_model(TINY, scalar_head=False, seed=1).state_dict()
    second = build_model(TINY, scalar_head=False, seed=2).state_dict()
    folder = export.write_hf_folder(
        tmp_path / "export" / "actor",
        TINY,
        first,
        source={"step": 4},
        generation={"eos_token_id": 2},
    )
    manifest = export.read_manifest(folder)
    assert {f["name"] for f in manifest["files"]} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }
    for entry in manifest["files"]:
        assert (folder / entry["name"]).stat().st_size == entry["bytes"]
        assert export._sha256(folder / entry["name"]) == entry["sha256"]
    assert manifest["source"] == {"step": 4} and manifest["dtype"] == "bfloat16"
    export.write_hf_folder(folder, TINY, second, source={"step": 8})
    weights = read_state_dict(folder)
    for key, tensor in second.items():
        assert torch.equal(weights[key], tensor.to(torch.bfloat16)), key
    # Nothing of the first export or of the writing is left beside it.
    assert sorted(p.name for p in folder.parent.iterdir()) == ["actor"]
    # A folder without a manifest (an export being written) or with a broken one is not offered.
    (tmp_path / "export" / "critic").mkdir()
    (tmp_path / "export" / "critic" / "config.json").write_text("{}")
    (tmp_path / "export" / "broken").mkdir()
    (tmp_path / "export" / "broken" / "manifest.json").write_text('{"files": [{"name": 1}]}')
    shutil.copytree(folder, tmp_path / "export" / "a name with spaces")  # not a URL segment
    shutil.copytree(folder, tmp_path / "export" / "actor-step-4")  # nereus export's, say
    assert list(export.artifacts(tmp_path / "export")) == ["actor", "actor-step-4"]


def test_a_failed_write_leaves_the_previous_export_in_place(tmp_path, monkeypatch):
    folder = export.write_hf_folder(
        tmp_path / "actor", TINY, build_model(TINY, scalar_head=False, seed=1).state_dict()
    )
    before = export.read_manifest(folder)

    def full_disk(path, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_safetensors", full_disk)
    with pytest.raises(export.ExportError, match=r"out: cannot write .*No space left"):
        export.write_hf_folder(
            folder, TINY, build_model(TINY, scalar_head=False, seed=2).state_dict()
        )
    assert export.read_manifest(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]

    # A writer that may not replace it any more (its driver was taken over) leaves it too.
    monkeypatch.undo()

    def superseded():
        raise RuntimeError("another driver took the job over")

    with pytest.raises(RuntimeError, match="took the job over"):
        export.write_hf_folder(
            folder,
            TINY,
            build_model(TINY, scalar_head=False, seed=3).state_dict(),
            before_replace=superseded,
        )
    assert export.read_manifest(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


def _job_dir(tmp_path, config: ModelConfig, steps=(4, 8)) -> tuple:
    """A PPO job's working directory as its driver leaves it: ``job.json`` and committed DCP
    checkpoints of ``actor@training`` (its parameters and optimizer moments)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    export.write_job_file(job_dir, config, generation={"eos_token_id": 2}, pad_token_id=0)
    saved = {}
    for step in steps:
        state = build_model(config, scalar_head=False, seed=step).state_dict()
        moments = {f"{k}::exp_avg": torch.randn(v.shape) for k, v in state.items()}
        root = job_dir / "checkpoints" / f"step-{step:06d}"
        dcp.save({**state, **moments}, checkpoint_id=str(root / "actor_training"), no_dist=True)
        (root / "COMMITTED").write_text(json.dumps({"step": step, "units": ["actor@training"]}))
        saved[step] = state
    return job_dir, saved


def test_a_committed_checkpoint_exports_its_parameters(tmp_path):
    job_dir, saved = _job_dir(tmp_path, TINY)
    folder = export.export_job_checkpoint(job_dir, tmp_path / "out", dtype="float32")
    weights = read_state_dict(folder)
    assert weights.keys() == saved[8].keys()  # the newest, without the optimizer's moments
    assert all(torch.equal(weights[k], saved[8][k]) for k in weights)
    assert export.read_manifest(folder)["source"]["step"] == 8
    older = export.export_job_checkpoint(job_dir, tmp_path / "older", step=4, dtype="float32")
    assert torch.equal(read_state_dict(older)["lm_head.weight"], saved[4]["lm_head.weight"])
    config = json.loads((folder / "config.json").read_text())
    assert config["pad_token_id"] == 0
    assert json.loads((folder / "generation_config.json").read_text()) == {"eos_token_id": 2}


def test_bad_exports_name_the_field(tmp_path):
    job_dir, _ = _job_dir(tmp_path, TINY)
    out = tmp_path / "out"
    cases = [
        ({"role": "reward"}, "role: expected one of actor, critic"),
        ({"step": 5}, "checkpoint: no committed checkpoint at 5"),
        ({"dtype": "int8"}, "dtype: expected one of bfloat16, float32"),
    ]
    for kwargs, message in cases:
        with pytest.raises(export.ExportError, match=message):
            export.export_job_checkpoint(job_dir, out, **kwargs)
    with pytest.raises(
        export.ExportError, match=r"checkpoint: .* (holds no parameters|is not a DCP)"
    ):
        export.export_job_checkpoint(job_dir, out, role="critic")
    wrong = default_catalog().model("tiny-llama")
    export.write_job_file(job_dir, wrong)
    with pytest.raises(export.ExportError, match=r"model: model.embed_tokens.weight is \(64, 64\)"):
        export.export_job_checkpoint(job_dir, out)
    with pytest.raises(export.ExportError, match=r"job_dir: .* has no job\.json"):
        export.export_job_checkpoint(tmp_path, out)
    assert not out.exists()


def test_nereus_export_writes_a_folder_or_names_the_field(tmp_path):
    job_dir, saved = _job_dir(tmp_path, TINY)
    runner = CliRunner()
    done = runner.invoke(app, ["export", str(job_dir), "--out", str(tmp_path / "m")])
    assert done.exit_code == 0, done.output
    assert "actor exported to" in done.output
    assert read_state_dict(tmp_path / "m").keys() == saved[8].keys()
    bad = runner.invoke(app, ["export", str(job_dir), "--out", str(tmp_path / "n"), "--role", "x"])
    assert bad.exit_code == 2 and "--role: expected one of actor, critic" in bad.output
    assert not (tmp_path / "n").exists()
    # A bad --dtype is named before a checkpoint is looked for: here there is none to find.
    empty = tmp_path / "no-checkpoints"
    empty.mkdir()
    bad = runner.invoke(app, ["export", str(empty), "--out", str(tmp_path / "n"), "--dtype", "zz"])
    assert bad.exit_code == 2 and "--dtype: expected one of bfloat16, float32" in bad.output


def test_a_failed_export_at_the_end_of_a_job_is_said_and_changes_nothing_else(tmp_path):
    """The end of ``run_ppo_job``: the export's failure becomes an event; no exception reaches
    the job, whose outcome stands (its checkpoints can still be exported)."""
    from types import SimpleNamespace

    from runtime.events import ListSink
    from runtime.jobs import ppo_job

    class Job:
        def export(self, engine, role):
            raise OSError(28, "No space left on device")

    unit = SimpleNamespace(model_stage="actor@training")
    sink = ListSink()
    ppo_job._export(Job(), SimpleNamespace(engine=SimpleNamespace(units={"a": unit})), sink)
    ppo_job._export(Job(), SimpleNamespace(engine=SimpleNamespace(units={})), sink)
    assert [(e.kind, e.data["reason"]) for e in sink.events] == [
        ("job.export_failed", "OSError: [Errno 28] No space left on device"),
        ("job.export_failed", "no actor state held"),
    ]


def test_an_export_never_replaces_a_folder_that_is_not_one(tmp_path, monkeypatch):
    state = build_model(TINY, scalar_head=False, seed=1).state_dict()
    keep = tmp_path / "thesis"
    keep.mkdir()
    (keep / "thesis.tex").write_text("years of work")
    with pytest.raises(export.ExportError, match=r"out: .* exists and is not an export folder"):
        export.write_hf_folder(keep, TINY, state)
    assert (keep / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(export.ExportError, match="out: "):
        export.write_hf_folder(tmp_path / "file", TINY, state)
    # '.' (an empty working directory) is a folder like any other.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert export.write_hf_folder(".", TINY, state) == here
    assert export.read_manifest(here) is not None


def test_an_export_never_removes_what_it_did_not_write(tmp_path):
    """Found by review: a folder whose manifest listed no files counted as an earlier export,
    and replacing one took whatever else was in it (a thesis, a tokenizer put beside the
    weights) with it."""
    state = build_model(TINY, scalar_head=False, seed=1).state_dict()
    posing = tmp_path / "posing"
    posing.mkdir()
    (posing / "manifest.json").write_text(json.dumps({"files": []}))
    (posing / "thesis.tex").write_text("years of work")
    with pytest.raises(export.ExportError, match=r"out: .* is not an export folder"):
        export.write_hf_folder(posing, TINY, state)
    assert (posing / "thesis.tex").read_text() == "years of work"
    folder = export.write_hf_folder(tmp_path / "actor", TINY, state)
    (folder / "tokenizer.json").write_text("{}")
    before = export.read_manifest(folder)
    with pytest.raises(export.ExportError, match=r"holds what no export wrote \(tokenizer\.json\)"):
        export.write_hf_folder(
            folder, TINY, build_model(TINY, scalar_head=False, seed=2).state_dict()
        )
    assert export.read_manifest(folder) == before and (folder / "tokenizer.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(export.ExportError, match=r"out: cannot write beside .*file/sub"):
        export.write_hf_folder(tmp_path / "file" / "sub", TINY, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor", "file", "posing"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda unit: (unit / ".metadata").write_bytes(b""),
        lambda unit: (unit / ".metadata").write_bytes(b"not a pickle at all"),
        lambda unit: [p.write_bytes(p.read_bytes()[:100]) for p in unit.glob("*.distcp")],
        lambda unit: [p.unlink() for p in unit.glob("*.distcp")],
    ],
    ids=["empty metadata", "garbage metadata", "truncated shards", "missing shards"],
)
def test_a_damaged_checkpoint_is_named_not_a_traceback(tmp_path, damage):
    job_dir, _ = _job_dir(tmp_path, TINY, steps=(4,))
    damage(job_dir / "checkpoints" / "step-000004" / "actor_training")
    with pytest.raises(export.ExportError, match=r"checkpoint: .*actor_training"):
        export.export_job_checkpoint(job_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"generation": 5}, "generation must be an object"),
        ({"pad_token_id": "zero"}, "pad_token_id must be a token id"),
        ({"eos_token_id": True}, "eos_token_id must be a token id"),
        ({"bos_token_id": -1}, "bos_token_id must be a token id"),
    ],
)
def test_a_job_file_with_bad_fields_is_named(tmp_path, fields, message):
    job_dir, _ = _job_dir(tmp_path, TINY, steps=(4,))
    info = json.loads((job_dir / "job.json").read_text())
    (job_dir / "job.json").write_text(json.dumps({**info, **fields}))
    with pytest.raises(export.ExportError, match=rf"job_dir: .*job\.json: {message}"):
        export.export_job_checkpoint(job_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"rope_theta": 10**400}, "tiny-sft.rope_theta: too large for a number"),
        (
            {"rope_scaling": {**LLAMA_3_1_ROPE.to_hf(), "factor": 10**400}},
            "tiny-sft.rope_scaling.factor: too large for a number",
        ),
        ({"vocab_size": 10**400}, "tiny-sft.vocab_size: must be a positive integer up to"),
    ],
)
def test_a_job_file_with_a_model_number_no_float_holds_is_named(tmp_path, model, message):
    """Found by review: ``ModelConfig(**info["model"])`` raised OverflowError on these (a
    traceback from ``nereus export``), or took them and failed later."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    export.write_job_file(job_dir, TINY)
    info = json.loads((job_dir / "job.json").read_text())
    (job_dir / "job.json").write_text(json.dumps({**info, "model": {**info["model"], **model}}))
    with pytest.raises(
        export.ExportError, match=rf"^job_dir: .*job\.json is not readable \({message}"
    ):
        export.export_job_checkpoint(job_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_swap_puts_the_previous_export_back(tmp_path, monkeypatch):
    folder = export.write_hf_folder(
        tmp_path / "actor", TINY, build_model(TINY, scalar_head=False, seed=1).state_dict()
    )
    before = export.read_manifest(folder)
    rename = type(folder).rename

    def failing(self, target):
        if self.name.startswith(".actor.partial-"):
            raise OSError(116, "Stale file handle")
        return rename(self, target)

    monkeypatch.setattr(type(folder), "rename", failing)
    with pytest.raises(export.ExportError, match=r"out: cannot write .*Stale file handle"):
        export.write_hf_folder(
            folder, TINY, build_model(TINY, scalar_head=False, seed=2).state_dict()
        )
    assert export.read_manifest(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


def test_a_dead_writer_s_leftovers_go_with_the_next_write(tmp_path):
    import os
    import time

    dead = tmp_path / ".actor.partial-deadbeef"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 1000)
    old = time.time() - 2 * files.STALE_S
    os.utime(dead, (old, old))
    live = tmp_path / ".actor.partial-cafecafe"  # another writer, right now
    live.mkdir()
    export.write_hf_folder(
        tmp_path / "actor", TINY, build_model(TINY, scalar_head=False, seed=1).state_dict()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".actor.partial-cafecafe", "actor"]


@pytest.mark.parametrize(
    "entry",
    [
        {"name": "../secret", "bytes": 1, "sha256": "0" * 64},
        {"name": "a/b", "bytes": 1, "sha256": "0" * 64},
        {"name": "", "bytes": 1, "sha256": "0" * 64},
        {"name": "manifest.json", "bytes": 1, "sha256": "0" * 64},
        {"name": "x..y", "bytes": 1, "sha256": "0" * 64},
        {"name": "ok.json", "bytes": -1, "sha256": "0" * 64},
        {"name": "ok.json", "bytes": True, "sha256": "0" * 64},
        {"name": "ok.json", "bytes": 1, "sha256": "not-hex"},
    ],
)
def test_a_manifest_with_a_bad_file_entry_is_not_one(tmp_path, entry):
    (tmp_path / "manifest.json").write_text(json.dumps({"files": [entry]}))
    assert export.read_manifest(tmp_path) is None
    good = {"name": "model-00001-of-00002.safetensors", "bytes": 1, "sha256": "ab" * 32}
    (tmp_path / "manifest.json").write_text(json.dumps({"files": [good]}))
    assert export.read_manifest(tmp_path) is not None


def test_a_job_started_from_a_hugging_face_folder_runs_its_rope_numerics(tmp_path):
    """A Llama 3.1 folder's rope_theta (500000), rms_norm_eps and llama3 RoPE scaling reach the
    job's model, which then computes what transformers computes from that folder; a RoPE scaling
    the model layer does not implement is refused rather than silently dropped."""
    from runtime.ppo.job import PpoConfigError, PpoJobConfig

    llama3 = dataclasses.replace(CONFIGS[-1], rms_norm_eps=1e-6)
    source = build_model(llama3, scalar_head=False, seed=9)
    folder = export.write_hf_folder(
        tmp_path / "llama3", llama3, source.state_dict(), dtype="float32"
    )
    config = PpoJobConfig(model="tiny-sft", init_from=str(folder)).model_config()
    assert (config.rope_theta, config.rms_norm_eps) == (500_000.0, 1e-6)
    assert config.rope_scaling == llama3.rope_scaling
    ours = build_model(config, scalar_head=False, seed=0)
    ours.load_state_dict(read_state_dict(folder))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = _tokens(TINY, length=40)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
        # The default base gives other logits: the test would see a dropped rope_theta.
        assert not torch.allclose(
            build_model(TINY, scalar_head=False, seed=9)(tokens), ours(tokens)
        )
    hf = json.loads((folder / "config.json").read_text())
    for change, message in [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn'"),
        ({"rope_scaling": "llama3"}, "rope_scaling: must be a mapping"),
        ({"rope_theta": -1}, "rope_theta: must be a positive number"),
    ]:
        (folder / "config.json").write_text(json.dumps({**hf, **change}))
        with pytest.raises(PpoConfigError, match=f"init_from: .*{message}"):
            PpoJobConfig(model="tiny-sft", init_from=str(folder)).model_config()


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({"rope_theta": 10**400}, "rope_theta: too large for a number"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps: must be a finite number, got inf"),
        (
            {"rope_scaling": {**LLAMA_3_1_ROPE.to_hf(), "factor": 10**400}},
            "rope_scaling.factor: too large for a number",
        ),
    ],
)
def test_a_hugging_face_config_number_no_float_holds_is_named(tmp_path, hf, message):
    """Found by review: ``float()`` of a 401-digit ``rope_theta`` and RopeScaling's check raised
    OverflowError out of the job's configuration; an infinite epsilon (``1e400`` in the file)
    was taken."""
    from runtime.ppo.job import PpoConfigError, PpoJobConfig

    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(PpoConfigError, match=rf"^init_from: .*config\.json {message}"):
        PpoJobConfig(model="tiny-sft", init_from=str(tmp_path)).model_config()
