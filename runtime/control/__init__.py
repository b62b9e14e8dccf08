"""Control: the monitor (signals, triggers, drift horizons), admission (feasibility and payback),
the approval gate, and the controller with its step loop. Engine-agnostic."""

from runtime.control.admission import Verdict, decide
from runtime.control.controller import Controller, RunSummary, run_job
from runtime.control.monitor import DriftHorizon, Monitor, Trigger
from runtime.control.policy import JobPolicy, PolicyError

__all__ = [
    "Controller",
    "DriftHorizon",
    "JobPolicy",
    "Monitor",
    "PolicyError",
    "RunSummary",
    "Trigger",
    "Verdict",
    "decide",
    "run_job",
]
