"""What a benchmark script records for `fleetrl bench`: one ratio per figure, as a JSON line in
the file that `fleetrl bench` names in its environment (nothing when the script runs alone)."""

from __future__ import annotations

import json
import os

from fleetrl.app.bench import RESULTS_ENV


def record(figure: str, ratio: float, detail: str = "") -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"figure": figure, "ratio": ratio, "detail": detail}) + "\n")
