"""The submit form: an SFT job on CPU slots, a PPO job on CPU slots through Ray (real), or a PPO
job on the simulated cluster.

The form only parses what people type; the runtime's job spec (``spec_from_json``) is the one
validator, and its errors, which name their field, are put on the matching form field.
"""

from __future__ import annotations

import uuid

from django import forms

from runtime.control.policy import APPROVAL_MODES, RUNWAYS, SIGNALS, JobPolicy
from runtime.engine.traces import SHAPES
from runtime.jobs.spec import PpoJobSpec, PpoSimJobSpec, SftJobSpec, spec_from_json
from runtime.planner.catalog import default_catalog
from runtime.ppo.job import GENERATION_BACKENDS, REWARDS
from runtime.ppo.tasks import TASK_NAMES
from webapp.projects.models import Project, Role
from webapp.projects.selectors import projects_visible_to
from webapp.validators import NoControlCharacters

_SFT = SftJobSpec()
_SIM = PpoSimJobSpec()
_PPO = PpoJobSpec()
KIND_FIELDS = {
    "sft": ("num_slots",),
    "ppo-sim": ("model", "gpu", "gpus", "trace", "pace_s", "approval"),
    "ppo": (
        "ppo_model",
        "tasks",
        "reward",
        "num_slots",
        "max_slots",
        "batch_size",
        "max_new_tokens",
        "warmup_steps",
        "checkpoint_every",
        "approval",
    ),
}
# Spec fields that the form names differently for one kind.
_KIND_FIELD = {("ppo", "model"): "ppo_model", ("ppo", "gpu"): "ppo_gpu"}
# Where a spec error lands: the spec's field name (before the colon) -> the form's field.
_SPEC_FIELD = {
    "policy.gamma": "gamma",
    "policy.approval": "approval",
    "policy.approval_above_s": "approval_above_s",
    "policy.memory_runway": "memory_runway",
    "policy.min_saving": "min_saving",
    "policy.link_probe_every_s": "link_probe_every_s",
    "minibatch_size": "batch_size",  # the form derives minibatches from the batch size
    **{f"policy.thresholds.{signal}": "threshold" for signal in SIGNALS},
}


def _choices(names) -> list[tuple[str, str]]:
    return [(name, name) for name in sorted(names)]


class JobSubmitForm(forms.Form):
    project = forms.ModelChoiceField(
        queryset=None,
        required=False,
        empty_label="my personal project",
        help_text="Projects where you may submit (operator role or above).",
    )
    name = forms.CharField(max_length=200, initial="sft-demo", validators=[NoControlCharacters()])
    submit_key = forms.RegexField(
        regex=r"^[0-9a-f]{32}$",
        required=False,
        widget=forms.HiddenInput,
        error_messages={"invalid": "expected the 32 hex digits the page gave"},
        help_text="One per page shown: a second submit of the same page (a double click, a "
        "resend) returns the job the first made.",
    )
    kind = forms.ChoiceField(
        choices=[
            ("sft", "SFT on CPU slots (real)"),
            ("ppo", "PPO on Ray slots (real)"),
            ("ppo-sim", "PPO on the simulated cluster"),
        ],
        initial="sft",
        required=False,
    )
    num_steps = forms.IntegerField(initial=_SFT.num_steps)
    seed = forms.IntegerField(min_value=0, max_value=2**31 - 1, initial=_SFT.seed)
    # --- sft ---
    num_slots = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=8,
        initial=_SFT.num_slots,
        help_text="CPU slots stand in for GPUs on this machine.",
    )
    # --- ppo (real) ---
    ppo_model = forms.ChoiceField(
        required=False,
        initial=_PPO.model,
        label="Model",
        help_text="Actor, critic, reference and reward share it; tiny ones fit CPU slots.",
    )
    ppo_gpu = forms.ChoiceField(
        required=False,
        initial=_PPO.gpu,
        label="Slots",
        help_text="cpu-slot: a CPU process per slot; a GPU kind: one such GPU per slot, which "
        "the Ray cluster must have.",
    )
    generation_backend = forms.ChoiceField(
        required=False,
        choices=[(name, name) for name in GENERATION_BACKENDS],
        initial=_PPO.generation_backend,
        label="Generation",
        help_text="torch: any slots. vllm: GPU slots only, with vLLM installed on them (the gpu "
        "extra); refused on CPU slots.",
    )
    tasks = forms.CharField(
        required=False,
        max_length=200,
        initial=_PPO.tasks,
        help_text=f"Comma-separated: {', '.join(TASK_NAMES)}.",
    )
    reward = forms.ChoiceField(
        required=False,
        choices=[(name, name) for name in REWARDS],
        initial=_PPO.reward,
        help_text="length: longer answers earn more, so the response length grows (drift).",
    )
    max_slots = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=16,
        initial=_PPO.max_slots,
        help_text="Slot processes started; a grant draws from those beyond the job's slots.",
    )
    batch_size = forms.IntegerField(
        required=False, min_value=1, max_value=4096, initial=_PPO.batch_size
    )
    max_new_tokens = forms.IntegerField(
        required=False, min_value=1, max_value=1024, initial=_PPO.max_new_tokens
    )
    warmup_steps = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=10_000,
        initial=_PPO.warmup_steps,
        help_text="Supervised steps on the tasks' answers before PPO.",
    )
    checkpoint_every = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=1_000_000,
        initial=_PPO.checkpoint_every,
        help_text="Steps between committed checkpoints (a lost worker resumes from the last).",
    )
    revoke_at_step = forms.IntegerField(
        required=False, initial=-1, help_text="Take a slot away before this step (-1: never)."
    )
    grant_at_step = forms.IntegerField(
        required=False, initial=-1, help_text="Give a slot before this step (-1: never)."
    )
    # --- ppo-sim ---
    model = forms.ChoiceField(required=False, initial=_SIM.model)
    gpu = forms.ChoiceField(required=False, initial=_SIM.gpu, label="Accelerator")
    gpus = forms.IntegerField(
        required=False, initial=_SIM.gpus, label="GPUs", help_text="Simulated slots at the start."
    )
    trace = forms.ChoiceField(
        required=False,
        choices=_choices(SHAPES),
        initial=_SIM.trace,
        help_text="How the generated length and the slot pool drift.",
    )
    pace_s = forms.FloatField(
        required=False, initial=_SIM.pace_s, label="Pace (s/step)", help_text="Wall time per step."
    )
    approval = forms.ChoiceField(
        required=False,
        choices=[(mode, mode) for mode in APPROVAL_MODES],
        initial="auto",
        help_text="manual: every plan change waits for an approver.",
    )
    approval_above_s = forms.FloatField(
        required=False, label="Approve above (s)", help_text="With manual_above."
    )
    gamma = forms.FloatField(required=False, help_text="Admit when cost/saving ≤ gamma × H.")
    min_saving = forms.FloatField(
        required=False,
        label="Least saving",
        help_text=f"Moves saving less than this fraction of a step are not made "
        f"({JobPolicy().min_saving}).",
    )
    threshold = forms.FloatField(
        required=False, label="Drift threshold", help_text="Relative drift that triggers (0.3)."
    )
    memory_runway = forms.ChoiceField(
        required=False,
        choices=[(runway, runway) for runway in RUNWAYS],
        initial=JobPolicy().memory_runway,
        help_text="How long a new plan must keep fitting as answers grow: shortest (fastest "
        "steps), amortized (by move cost), longest (fewest moves).",
    )

    calibration_probes = forms.ChoiceField(
        required=False,
        choices=[("on", "on"), ("off", "off")],
        initial="on",
        label="Calibration probes",
        help_text="Time each communication class alone before plans are weighed.",
    )
    link_probe_every_s = forms.FloatField(
        required=False,
        label="Link probes every (s)",
        help_text=f"With calibration probes: time the links again this often, to follow their "
        f"load ({JobPolicy().link_probe_every_s:g}; 0: never).",
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["submit_key"].initial = uuid.uuid4().hex
        # The empty choice is the user's personal project (made on their first job), so it is
        # not listed a second time under its own name.
        project = self.fields["project"]
        project.queryset = projects_visible_to(user, min_role=Role.OPERATOR).exclude(
            personal_for=user
        )
        # As the job list and the project pages name it, with the slug the API and CLI use.
        project.label_from_instance = lambda p: f"{p.name} ({p.slug})"
        personal = Project.objects.filter(personal_for=user).first()
        if personal is not None:
            project.empty_label = f"{project.label_from_instance(personal)}: personal"
        catalog = default_catalog()
        self.fields["model"].choices = _choices(catalog.models)
        self.fields["ppo_model"].choices = _choices(catalog.models)
        self.fields["gpu"].choices = _choices(catalog.accelerators)
        self.fields["ppo_gpu"].choices = _choices(catalog.accelerators)

    def clean(self):
        data = super().clean()
        kind = data.get("kind") or "sft"
        data["kind"] = kind
        for field in KIND_FIELDS[kind]:
            if data.get(field) in (None, "") and field not in self.errors:
                self.add_error(field, "This field is required.")
        if self.errors:
            return data
        try:
            spec_from_json(self.spec())
        except ValueError as exc:
            self.add_error(self.field_of(str(exc)), str(exc))
        return data

    def field_of(self, message: str) -> str | None:
        """The form field a spec error (``"field: problem"``) belongs to; None if none does."""
        field, _, _ = message.partition(":")
        kind = (
            (getattr(self, "cleaned_data", None) or {}).get("kind")
            or self.data.get("kind")
            or "sft"
        )
        field = _KIND_FIELD.get((kind, field), _SPEC_FIELD.get(field, field))
        return field if field in self.fields else None

    def spec(self) -> dict:
        """The job spec the cleaned fields describe (valid once ``is_valid()`` is true)."""
        data = self.cleaned_data
        kind = data.get("kind", "sft")
        if kind == "sft":
            return {
                "num_slots": data["num_slots"],
                "num_steps": data["num_steps"],
                "seed": data["seed"],
            }
        policy: dict = {"approval": data["approval"]}
        if data.get("approval_above_s") is not None:
            policy["approval_above_s"] = data["approval_above_s"]
        if data.get("gamma") is not None:
            policy["gamma"] = data["gamma"]
        if data.get("min_saving") is not None:
            policy["min_saving"] = data["min_saving"]
        if data.get("threshold") is not None:
            policy["thresholds"] = {signal: data["threshold"] for signal in SIGNALS}
        if data.get("memory_runway"):
            policy["memory_runway"] = data["memory_runway"]
        if data.get("calibration_probes"):
            policy["calibration_probes"] = data["calibration_probes"] == "on"
        if data.get("link_probe_every_s") is not None:
            policy["link_probe_every_s"] = data["link_probe_every_s"]
        if kind == "ppo":
            spec = {
                "kind": "ppo",
                "model": data["ppo_model"],
                "gpu": data.get("ppo_gpu") or _PPO.gpu,
                "generation_backend": data.get("generation_backend") or _PPO.generation_backend,
                "tasks": data["tasks"],
                "reward": data["reward"],
                "num_slots": data["num_slots"],
                "max_slots": data["max_slots"],
                "num_steps": data["num_steps"],
                "batch_size": data["batch_size"],
                # The form has no minibatch field: the spec's default, cut to a smaller batch
                # (the spec needs minibatch_size <= batch_size).
                "minibatch_size": min(_PPO.minibatch_size, data["batch_size"]),
                "max_new_tokens": data["max_new_tokens"],
                "warmup_steps": data["warmup_steps"],
                "checkpoint_every": data["checkpoint_every"],
                "seed": data["seed"],
                "policy": policy,
            }
            for field in ("revoke_at_step", "grant_at_step", "pace_s"):
                if data.get(field) is not None:
                    spec[field] = data[field]
            return spec
        return {
            "kind": "ppo-sim",
            "model": data["model"],
            "gpu": data["gpu"],
            "gpus": data["gpus"],
            "trace": data["trace"],
            "pace_s": data["pace_s"],
            "num_steps": data["num_steps"],
            "seed": data["seed"],
            "policy": policy,
        }


class PoolForm(forms.Form):
    """A running PPO job's slot pool, changed by an operator (``services.job_resize_for``
    checks the rest: the job's kind and ``max_slots``, whether its models fit)."""

    slots = forms.IntegerField(min_value=1, max_value=64, help_text="The job's pool from now on.")
    notice_s = forms.FloatField(
        min_value=0.0,
        max_value=86400.0,
        initial=0.0,
        required=False,
        label="Notice (s)",
        help_text="For a shrink: how long the slots to go stay while the job moves off them "
        "(0: taken at once, with what they hold).",
    )

    def __init__(self, *args, max_slots: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if max_slots:  # the browser stops what the service would refuse (its spec's max_slots)
            self.fields["slots"].widget.attrs["max"] = max_slots
