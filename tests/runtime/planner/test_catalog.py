"""Catalogs: parameter counts derive from the configs and match the published totals; user files
extend them; bad entries name their field and list the valid choices."""

import json

import pytest

from runtime.jobs.sft import TinyDecoder
from runtime.planner.catalog import Accelerator, CatalogError, ModelConfig, default_catalog

# Totals as published (model cards; safetensors metadata where the card rounds differently).
PUBLISHED = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-32b": 32.8e9,
}


@pytest.mark.parametrize(("name", "total"), PUBLISHED.items())
def test_parameter_counts_match_published_totals(name, total):
    count = default_catalog().model(name).num_params()
    assert abs(count / total - 1) < 0.005, f"{name}: {count:,} vs {total:,.0f}"


def test_tiny_config_counts_the_demo_models_parameters():
    """The catalog's tiny-sft is the decoder the CPU demo trains: same count, from two sources."""
    cfg = default_catalog().model("tiny-sft")
    model = TinyDecoder(
        vocab_size=cfg.vocab_size,
        hidden=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
    )
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_scalar_head_replaces_the_vocabulary_head():
    cfg = default_catalog().model("llama-3.1-8b")
    lm_head, score = (
        cfg.vocab_size * cfg.hidden_size,
        cfg.hidden_size,
    )  # score: Linear(h, 1, bias=False)
    assert cfg.num_params() - cfg.num_params(scalar_head=True) == lm_head - score


def test_unknown_names_list_the_choices():
    catalog = default_catalog()
    with pytest.raises(
        CatalogError, match=r"model: unknown model 'gpt-5'; choose one of .*llama-3.1-8b"
    ):
        catalog.model("gpt-5")
    with pytest.raises(
        CatalogError, match=r"gpu: unknown accelerator 'v100'; choose one of .*h100-sxm"
    ):
        catalog.accelerator("v100")


def test_user_file_adds_entries(tmp_path):
    path = tmp_path / "extra.yaml"
    path.write_text(
        """
accelerators:
  b200:
    peak_flops: 2.25e15
    memory_bytes: 1.92e11
    memory_bandwidth: 8.0e12
    intra_node_bandwidth: 9.0e11
    intra_node_latency: 3.0e-6
    inter_node_bandwidth: 5.0e10
    inter_node_latency: 6.0e-6
    gpus_per_node: 8
models:
  my-1b:
    vocab_size: 32000
    hidden_size: 2048
    intermediate_size: 5632
    num_layers: 22
    num_heads: 32
    num_kv_heads: 4
    rope_theta: 500000
    rope_scaling: {rope_type: llama3, factor: 32, low_freq_factor: 1, high_freq_factor: 4,
                   original_max_position_embeddings: 8192}
"""
    )
    catalog = default_catalog().extended(path)
    assert catalog.accelerator("B200").gpus_per_node == 8
    mine = catalog.model("my-1b")
    assert 1.0e9 < mine.num_params() < 1.2e9
    assert (mine.rope_theta, mine.rope_scaling.factor) == (500_000.0, 32)
    assert catalog.model("llama-3.1-8b")  # built-ins stay


TINY_ENTRY = {
    "vocab_size": 10,
    "hidden_size": 64,
    "intermediate_size": 1,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 1,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8,
    "low_freq_factor": 1,
    "high_freq_factor": 4,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"models": {"m": {"vocab_size": 10}}}, "models.m.hidden_size: required field is missing"),
        (
            {
                "models": {
                    "m": {
                        "vocab_size": 10,
                        "hidden_size": 64,
                        "intermediate_size": 1,
                        "num_layers": 2,
                        "num_heads": 3,
                        "num_kv_heads": 1,
                    }
                }
            },
            "m.hidden_size: 64 is not divisible",
        ),
        ({"models": {"m": {"vocab_size": "lots"}}}, "models.m.vocab_size: expected an integer"),
        ({"models": {"m": {"colour": "blue"}}}, "models.m.colour: unknown field"),
        ({"accelerators": {"x": {"peak_flops": 1}}}, "accelerators.x.memory_bytes: required"),
        ({"gpus": {}}, "catalog.gpus: unknown section"),
        (
            {
                "models": {
                    "m": {**TINY_ENTRY, "rope_scaling": {"rope_type": "dynamic", "factor": 2}}
                }
            },
            "models.m.rope_scaling.rope_type: 'dynamic' is not implemented",
        ),
        (
            {"models": {"m": {**TINY_ENTRY, "rope_scaling": {**LLAMA3_SCALING, "factor": -8}}}},
            "models.m.rope_scaling.factor: must be a positive number",
        ),
        (
            {
                "models": {
                    "m": {**TINY_ENTRY, "rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 1}}
                }
            },
            "models.m.rope_scaling.high_freq_factor: must exceed low_freq_factor",
        ),
        ([1, 2], "must hold a mapping"),
        # Found by review: these raised OverflowError out of the CLI with a traceback.
        (
            {"models": {"m": {**TINY_ENTRY, "vocab_size": 10**400}}},
            "models.m.vocab_size: at most 9007199254740992, got an integer of 1329 bits",
        ),
        (
            {"accelerators": {"x": {"peak_flops": 10**400}}},
            "accelerators.x.peak_flops: too large for a number",
        ),
        ({"accelerators": {"x": {"peak_flops": "1e999"}}}, "peak_flops: expected a finite number"),
        # Found by review: rope_scaling is checked by RopeScaling, whose math.isfinite raised
        # OverflowError on these (a traceback and exit 1 from `nereus plan --catalog`).
        (
            {
                "models": {
                    "m": {**TINY_ENTRY, "rope_scaling": {**LLAMA3_SCALING, "factor": 10**400}}
                }
            },
            "models.m.rope_scaling.factor: too large for a number (an integer of 1329 bits)",
        ),
        (
            {
                "models": {
                    "m": {
                        **TINY_ENTRY,
                        "rope_scaling": {**LLAMA3_SCALING, "low_freq_factor": -(10**400)},
                    }
                }
            },
            "models.m.rope_scaling.low_freq_factor: too large for a number",
        ),
        (
            {
                "models": {
                    "m": {
                        **TINY_ENTRY,
                        "rope_scaling": {
                            **LLAMA3_SCALING,
                            "original_max_position_embeddings": 10**400,
                        },
                    }
                }
            },
            "models.m.rope_scaling.original_max_position_embeddings: must be a positive integer "
            "up to 9007199254740992, got an integer of 1329 bits",
        ),
    ],
)
def test_malformed_files_name_the_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(CatalogError) as info:
        default_catalog().extended(path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_theta": 10**400}, "m.rope_theta: too large for a number"),
        ({"rope_theta": float("inf")}, "m.rope_theta: must be a finite number, got inf"),
        ({"rms_norm_eps": 10**400}, "m.rms_norm_eps: too large for a number"),
        ({"vocab_size": 10**400}, "m.vocab_size: must be a positive integer up to"),
        (
            {"rope_scaling": {**LLAMA3_SCALING, "factor": 10**400}},
            "m.rope_scaling.factor: too large for a number",
        ),
    ],
)
def test_a_model_from_a_record_refuses_numbers_a_float_cannot_hold(fields, message):
    """A model built from a JSON record without the file loader's checks (a job's job.json, read
    by ``nereus export``): found by review, such numbers raised OverflowError, or were taken
    (an infinite RoPE base), and failed later."""
    with pytest.raises(CatalogError) as info:
        ModelConfig(name="m", **{**TINY_ENTRY, **fields})
    assert str(info.value).startswith(message), info.value


ACCELERATOR_ENTRY = {
    "peak_flops": 1e12,
    "memory_bytes": 1e10,
    "memory_bandwidth": 1e11,
    "intra_node_bandwidth": 1e10,
    "intra_node_latency": 0,
    "inter_node_bandwidth": 1e9,
    "inter_node_latency": 0,
    "gpus_per_node": 8,
}
"""A valid accelerator's fields, for the tests to spoil one."""


def test_an_accelerator_refuses_a_number_a_float_cannot_hold():
    entry = {**ACCELERATOR_ENTRY, "peak_flops": 10**400}
    with pytest.raises(CatalogError, match=r"^x\.peak_flops: too large for a number"):
        Accelerator(name="x", **entry)


def test_unparseable_and_missing_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [unclosed")
    with pytest.raises(CatalogError, match="is not valid YAML"):
        default_catalog().extended(broken)
    with pytest.raises(CatalogError, match="cannot read"):
        default_catalog().extended(tmp_path / "missing.json")
    latin = tmp_path / "latin.json"
    latin.write_bytes(b"\xff\xfe{}")  # named no file or option before
    with pytest.raises(CatalogError, match=r"catalog: .*latin.json is not UTF-8 text"):
        default_catalog().extended(latin)


def test_gpus_per_node_must_be_a_power_of_two(tmp_path):
    path = tmp_path / "odd.json"
    entry = {**ACCELERATOR_ENTRY, "gpus_per_node": 6}
    path.write_text(json.dumps({"accelerators": {"odd": entry}}))
    with pytest.raises(
        CatalogError, match=r"accelerators\.odd\.gpus_per_node: must be a power of two"
    ):
        default_catalog().extended(path)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "twice.yaml",
            "models:\n  mymod: {layers: 2}\n  mymod: {layers: 80}\n",
            "'mymod' is given twice (line 3)",
        ),
        ("twice.json", '{"models": {"m": {}, "m": {}}}', "'m' is given twice"),
        (
            "cased.yaml",
            "models:\n  mymod: {layers: 2}\n  MyMod: {layers: 80}\n",
            "catalog.models.MyMod: the same name as mymod (names ignore case)",
        ),
    ],
)
def test_a_name_given_twice_is_refused_not_silently_replaced(tmp_path, name, text, message):
    """Found by review: YAML and JSON readers keep the last of two equal keys, and names are
    looked up whatever their case, so one entry silently took another's place."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(CatalogError) as info:
        default_catalog().extended(path)
    assert message in str(info.value)


def test_a_key_a_merge_brings_in_and_the_entry_then_sets_is_an_override_not_a_repeat(tmp_path):
    """Found by review: the first duplicate check read mappings after PyYAML's merge had copied
    keys into them, and refused such files."""
    entry = json.dumps(TINY_ENTRY)
    path = tmp_path / "merged.yaml"
    path.write_text(
        f"models:\n  small: &small {entry}\n  deeper: {{<<: *small, num_layers: 4}}\n"
        "  nested: {<<: [*small, {num_layers: 6}], num_layers: 8}\n"
    )
    catalog = default_catalog().extended(path)
    assert catalog.model("small").num_layers == 2 and catalog.model("deeper").num_layers == 4
    assert catalog.model("nested").num_layers == 8
    # A mapping merged (and so rewritten by PyYAML) before it is itself read: not a repeat
    # either; what is wrong with this file is its unknown section.
    odd = tmp_path / "odd.yaml"
    odd.write_text("m: &M {<<: {x: 1}, x: 2}\n<<: *M\n")
    with pytest.raises(CatalogError, match=r"catalog\.m: unknown section"):
        default_catalog().extended(odd)
