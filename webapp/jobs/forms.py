"""The submit form: an SFT job on CPU slots, or a PPO job on the simulated cluster.

The form only parses what people type; the runtime's job spec (``spec_from_json``) is the one
validator, and its errors, which name their field, are put on the matching form field.
"""

from __future__ import annotations

from django import forms

from runtime.control.policy import APPROVAL_MODES, SIGNALS
from runtime.engine.traces import SHAPES
from runtime.jobs.spec import PpoSimJobSpec, SftJobSpec, spec_from_json
from runtime.planner.catalog import default_catalog
from webapp.projects.models import Role
from webapp.projects.selectors import projects_visible_to

_SFT = SftJobSpec()
_SIM = PpoSimJobSpec()
KIND_FIELDS = {
    "sft": ("num_slots",),
    "ppo-sim": ("model", "gpu", "gpus", "trace", "pace_s", "approval"),
}
# Where a spec error lands: the spec's field name (before the colon) -> the form's field.
_SPEC_FIELD = {
    "policy.gamma": "gamma",
    "policy.approval": "approval",
    "policy.approval_above_s": "approval_above_s",
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
    name = forms.CharField(max_length=200, initial="sft-demo")
    kind = forms.ChoiceField(
        choices=[
            ("sft", "SFT on CPU slots (real)"),
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
    threshold = forms.FloatField(
        required=False, label="Drift threshold", help_text="Relative drift that triggers (0.3)."
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = projects_visible_to(user, min_role=Role.OPERATOR)
        catalog = default_catalog()
        self.fields["model"].choices = _choices(catalog.models)
        self.fields["gpu"].choices = _choices(catalog.accelerators)

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
            field, _, _ = str(exc).partition(":")
            field = _SPEC_FIELD.get(field, field)
            self.add_error(field if field in self.fields else None, str(exc))
        return data

    def spec(self) -> dict:
        """The job spec the cleaned fields describe (valid once ``is_valid()`` is true)."""
        data = self.cleaned_data
        if data.get("kind", "sft") == "sft":
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
        if data.get("threshold") is not None:
            policy["thresholds"] = {signal: data["threshold"] for signal in SIGNALS}
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
