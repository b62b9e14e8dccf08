"""Where units live: Ray device-slot actors joined by torch.distributed groups.

Importing this package before Ray keeps a single-machine Ray instance on loopback (see
``ray_cluster``); it must therefore be imported before anything imports ``ray``.
"""

import os

from runtime.engine.ray_cluster import loopback_environment

for _key, _value in loopback_environment(os.environ.get("RAY_ADDRESS")).items():
    os.environ.setdefault(_key, _value)
