"""Nereus: keeps running PPO post-training jobs on a good parallel plan as the world drifts."""

__version__ = "0.1.0"
