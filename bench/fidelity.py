"""The staleness lab's command (issue 34): ``bench/fidelity.py --plan``, ``--report-only``, ``--round2``, ...; the lab
itself (runs, registered rules, summaries, report, figures, the lab model and task) is the package bench/lab/, and
bench/lab/driver.py says what each flag does."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's bench and megamu

from bench.lab.driver import main  # noqa: E402

if __name__ == "__main__":
    main()
