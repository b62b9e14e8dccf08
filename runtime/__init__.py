"""The Nereus runtime: plans, moves and runs jobs. Imports nothing from Django (see webapp/)."""
