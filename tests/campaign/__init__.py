"""The reliability campaign (issue 24 §3): seeded random cases with faults, each run in its own
process under a hard timeout, each ending as exactly the expected bytes/batches or a named
``StatefulsetError`` - never a hang, never a silent difference.

- :func:`draw`: the case of a seed (a JSON-able dict; the seed alone reproduces it);
- :mod:`campaign.runner`: the session (one moto server, the shared shards) and the scheduler;
- :mod:`campaign.known`: findings another change is fixing, reported apart;
- the short form is tests/test_campaign.py, the long form benchmarks/campaign.py;
  docs/reliability.md says what is covered.
"""

from __future__ import annotations

import random

from campaign.loading_draw import draw_load
from campaign.preprocessing import draw_preprocess


def draw(seed: int, long_form: bool = False) -> dict:
    rng = random.Random(seed)
    case = draw_preprocess(rng, long_form) if rng.random() < 0.35 else draw_load(rng, long_form)
    case["seed"] = seed
    return case
