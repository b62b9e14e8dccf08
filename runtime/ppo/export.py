"""A trained model out of a job, as a Hugging Face folder that transformers and vLLM load.

A folder holds ``config.json`` (a Llama, or a Qwen2 where the model has q/k/v biases; the
critic as a sequence classifier with one label), ``generation_config.json``, ``model.safetensors``
(the names ``runtime.ppo.model`` already uses) and, written last, ``manifest.json``: every file
with its size and SHA-256, and where the weights came from (job, role, step). A folder without a
manifest is incomplete and is never offered; one is replaced whole, never in place.

Two sources: the live units at the end of a job (``PpoRuntime.export``), or any committed
checkpoint of a job's working directory (``export_checkpoint``, ``nereus export``), read with
DCP on this process alone, whatever layout the job had when it saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from runtime.files import replace_folder, sweep_leftovers, write_file
from runtime.planner.catalog import ModelConfig
from runtime.ppo.weights import write_safetensors

logger = logging.getLogger(__name__)

FORMAT = "huggingface"
MANIFEST = "manifest.json"
ROLES = ("actor", "critic")
"""The trained models of a PPO job (the reference and reward models are its inputs)."""
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExportError(ValueError):
    """A model that cannot be exported; the message names the field."""


def hf_config(
    config: ModelConfig,
    *,
    scalar_head: bool = False,
    dtype: str = "bfloat16",
    max_positions: int = 4096,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict:
    """Hugging Face's ``config.json`` for a model of ``config``. A model with q/k/v biases is a
    Qwen2 there (a Llama's ``attention_bias`` would add one to the output projection too)."""
    family = "Qwen2" if config.qkv_bias else "Llama"
    head = "ForSequenceClassification" if scalar_head else "ForCausalLM"
    out = {
        "architectures": [family + head],
        "model_type": family.lower(),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype,
    }
    if config.rope_scaling is not None:
        out["rope_scaling"] = config.rope_scaling.to_hf()
    if not config.qkv_bias:
        out.update({"attention_bias": False, "mlp_bias": False})
    if scalar_head:
        out["num_labels"] = 1
    for key, value in (
        ("pad_token_id", pad_token_id),
        ("bos_token_id", bos_token_id),
        ("eos_token_id", eos_token_id),
    ):
        if value is not None:
            out[key] = value
    return out


def write_hf_folder(
    folder: str | Path,
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    *,
    scalar_head: bool = False,
    dtype: str = "bfloat16",
    source: Mapping | None = None,
    generation: Mapping | None = None,
    before_replace: Callable[[], None] = lambda: None,
    **config_fields,
) -> Path:
    """Write ``state_dict`` as a Hugging Face folder at ``folder`` (replacing one there), the
    manifest last. ``source`` says where the weights came from; ``generation`` is
    ``generation_config.json`` (e.g. the end-of-sequence token). ``before_replace`` runs once
    the folder is written, before it takes ``folder``'s place: raising there leaves nothing."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    folder = Path(folder).resolve()
    _check_replaceable(folder)
    partial = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        sweep_leftovers(folder)
        partial.mkdir(parents=True)
    except OSError as exc:
        raise ExportError(f"out: cannot write beside {folder} ({exc.strerror or exc})") from None
    try:
        cfg = hf_config(config, scalar_head=scalar_head, dtype=dtype, **config_fields)
        (partial / "config.json").write_text(json.dumps(cfg, indent=2))
        if generation is not None:
            (partial / "generation_config.json").write_text(json.dumps(dict(generation), indent=2))
        write_safetensors(
            partial / "model.safetensors",
            {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in state_dict.items()},
        )
        files = [
            {"name": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(partial.iterdir())
        ]
        manifest = {
            "format": FORMAT,
            "architecture": cfg["architectures"][0],
            "dtype": dtype,
            "source": dict(source or {}),
            "files": files,
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2))
        for path in partial.iterdir():  # on disk before the folder is renamed into place
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        before_replace()
        replace_folder(partial, folder)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise ExportError(f"out: cannot write {folder} ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder


def _check_replaceable(folder: Path) -> None:
    """Refuse (``ExportError``, nothing changed) to replace ``folder`` unless it is missing,
    empty, or an earlier export holding only what its manifest lists: a folder that holds
    anything else (a file someone put beside the weights, a tokenizer) is not the export's to
    remove."""
    try:
        if not folder.exists():
            return
        if not folder.is_dir():
            raise ExportError(f"out: {folder} exists and is not a folder (nothing was changed)")
        held = {p.name for p in folder.iterdir()}
    except OSError as exc:
        raise ExportError(f"out: cannot read {folder} ({exc.strerror or exc})") from None
    if not held:
        return
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("format") != FORMAT:
        raise ExportError(f"out: {folder} exists and is not an export folder (nothing was changed)")
    others = sorted(held - {f["name"] for f in manifest["files"]} - {MANIFEST})
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ExportError(
            f"out: {folder} holds what no export wrote ({shown}): move it, or export to another "
            "folder (nothing was changed)"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: str | Path) -> dict | None:
    """The manifest of a complete export folder, or None where there is none (or it is not one)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or not all(_good_entry(f) for f in files):
        return None
    return manifest


FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")


def plain_name(name) -> bool:
    """A name that is one path segment: letters, digits, '.', '_' and '-', no ``..``."""
    return isinstance(name, str) and FILE_NAME.fullmatch(name) is not None and ".." not in name


def _good_entry(entry) -> bool:
    """A manifest's file: a plain name in its folder, a size, a SHA-256."""
    return (
        isinstance(entry, dict)
        and plain_name(entry.get("name"))
        and entry["name"] != MANIFEST
        and isinstance(entry.get("bytes"), int)
        and not isinstance(entry["bytes"], bool)
        and entry["bytes"] >= 0
        and isinstance(entry.get("sha256"), str)
        and SHA256.fullmatch(entry["sha256"]) is not None
    )


def artifacts(export_root: str | Path) -> dict[str, dict]:
    """``{name: manifest}`` of the complete export folders under ``export_root`` (``nereus export
    --out $NEREUS_JOBS_DIR/<id>/export/NAME`` adds one)."""
    root = Path(export_root)
    if not root.is_dir():
        return {}
    found = ((folder.name, artifact(root, folder.name)) for folder in sorted(root.iterdir()))
    return {name: manifest for name, manifest in found if manifest is not None}


def artifact(export_root: str | Path, name: str) -> dict | None:
    """The manifest of the export ``name`` under ``export_root``: a folder with a plain name, not
    a link, holding a manifest; else None."""
    folder = Path(export_root) / name
    if not plain_name(name) or folder.is_symlink() or not folder.is_dir():
        return None
    return read_manifest(folder)


def params_from_checkpoint(unit_dir: str | Path) -> dict[str, torch.Tensor]:
    """The parameters (not the optimizer's state) saved in one training unit's DCP checkpoint,
    whole, read on this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(unit_dir))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # a damaged file raises whatever its unpickler does
        raise ExportError(
            f"checkpoint: {unit_dir} is not a DCP checkpoint ({type(exc).__name__}: {exc})"
        ) from None
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and "::" not in key
    }
    if not state:
        raise ExportError(f"checkpoint: {unit_dir} holds no parameters")
    with warnings.catch_warnings():  # one process on purpose: no process group to wait for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as exc:  # a truncated or missing shard file
            if isinstance(exc, CheckpointException):  # DCP's wrapper of each rank's failure
                exc = next(iter(exc.failures.values()))[0]
            raise ExportError(
                f"checkpoint: {unit_dir} cannot be read ({type(exc).__name__}: {exc})"
            ) from None
    return state


def export_checkpoint(
    job_dir: str | Path,
    out: str | Path,
    *,
    config: ModelConfig,
    role: str = "actor",
    step: int | None = None,
    dtype: str = "bfloat16",
    generation: Mapping | None = None,
    **token_ids: int,
) -> Path:
    """Export ``role``'s weights from a committed checkpoint of the job working in ``job_dir``
    (the newest, or the one that resumes at ``step``) to the folder ``out``."""
    if role not in ROLES:
        raise ExportError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    root = Path(job_dir) / "checkpoints"
    committed = committed_checkpoints(root)
    if step is not None:
        committed = [c for c in committed if c.step == step]
    if not committed:
        which = "no committed checkpoint" if step is None else f"no committed checkpoint at {step}"
        raise ExportError(f"checkpoint: {which} in {root}")
    chosen = committed[-1].folder
    params = params_from_checkpoint(chosen / f"{role}_training")
    expected = {
        name: tuple(tensor.shape)
        for name, tensor in _model_shapes(config, scalar_head=role == "critic").items()
    }
    for name, shape in expected.items():
        if name not in params:
            raise ExportError(f"model: {name} is not in the checkpoint (is it a {config.name}?)")
        if tuple(params[name].shape) != shape:
            raise ExportError(
                f"model: {name} is {tuple(params[name].shape)} in the checkpoint, {shape} in "
                f"{config.name}"
            )
    return write_hf_folder(
        out,
        config,
        {name: params[name] for name in expected},
        scalar_head=role == "critic",
        dtype=dtype,
        source={
            "role": role,
            "step": committed[-1].step,
            "checkpoint": str(chosen),
        },
        generation=generation,
        **token_ids,
    )


COMMITTED = "COMMITTED"
"""A checkpoint folder's mark, written last: ``{"step": N, "units": [model-stage, ...],
"checksums": {model-stage: "0x…"}}``."""


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed checkpoint: the step it resumes at, its folder, the model-stages it holds."""

    step: int
    folder: Path
    units: tuple[str, ...]
    checksums: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each model-stage's state checksum when it was saved (layout-independent: the same after
    DCP reshards it); empty in a checkpoint written before they were recorded."""


def committed_checkpoints(root: Path) -> list[Committed]:
    """The committed checkpoints under ``root`` (``step-N/`` folders), oldest first. A folder
    whose mark cannot be read as one (torn by a crash of a writer that wrote in place) is
    skipped with a warning: an earlier checkpoint is used, never a half-written one. The names
    are zero-padded to six digits, so past 999,999 only their numbers sort."""
    found = []
    for mark in Path(root).glob(f"step-*/{COMMITTED}"):
        folder = mark.parent
        try:
            step = int(folder.name.removeprefix("step-"))
            data = json.loads(mark.read_text(encoding="utf-8"))
            units = tuple(str(name) for name in data["units"])
            if data["step"] != step:
                raise ValueError(f"it says step {data['step']}")
            checksums = {str(k): int(v, 16) for k, v in data.get("checksums", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning(
                "checkpoint %s: its %s mark is unreadable (%s); skipped", folder, COMMITTED, exc
            )
            continue
        found.append(Committed(step=step, folder=folder, units=units, checksums=checksums))
    return sorted(found, key=lambda c: c.step)


JOB_FILE = "job.json"
"""In a PPO job's working directory: its model's architecture and special tokens, so that a
checkpoint there can be exported without the job's spec (``export_job_checkpoint``)."""


def write_job_file(job_dir: str | Path, config: ModelConfig, **fields) -> None:
    path = Path(job_dir) / JOB_FILE
    write_file(path, json.dumps({"model": dataclasses.asdict(config), **fields}, indent=2))


def export_job_checkpoint(
    job_dir: str | Path,
    out: str | Path,
    *,
    role: str = "actor",
    step: int | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """``export_checkpoint`` for a PPO job's working directory, with the model and special tokens
    its ``job.json`` records."""
    path = Path(job_dir) / JOB_FILE
    try:
        info = json.loads(path.read_text())
        config = ModelConfig(**info["model"])
    except OSError:
        raise ExportError(
            f"job_dir: {job_dir} has no {JOB_FILE}: is it a PPO job's working directory?"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"job_dir: {path} is not readable ({exc})") from None
    generation = info.get("generation")
    if generation is not None and not isinstance(generation, dict):
        raise ExportError(f"job_dir: {path}: generation must be an object, got {generation!r:.60}")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = info.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ExportError(f"job_dir: {path}: {key} must be a token id, got {value!r:.60}")
    return export_checkpoint(
        job_dir,
        out,
        config=config,
        role=role,
        step=step,
        dtype=dtype,
        generation=generation,
        **{k: info[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if k in info},
    )


def _model_shapes(config: ModelConfig, *, scalar_head: bool) -> dict[str, torch.Tensor]:
    from runtime.ppo.model import LlamaForCausalLM, LlamaForScore

    cls = LlamaForScore if scalar_head else LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps)
    return dict(model.state_dict())
