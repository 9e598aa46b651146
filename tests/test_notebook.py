"""notebooks/ablations.ipynb runs top to bottom on a tiny config (TINY = True), so it never
rots: its code cells are executed in order in one namespace, as a kernel would."""

from __future__ import annotations

import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "ablations.ipynb"


def test_ablations_notebook_runs_top_to_bottom():
    import matplotlib

    matplotlib.use("Agg")
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    assert "parameters" in cells[0]["metadata"]["tags"]
    namespace: dict = {}
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if i == 0:
            source = source.replace("TINY = False", "TINY = True")
            assert "TINY = True" in source
        exec(compile(source, f"{NOTEBOOK.name}[cell {i}]", "exec"), namespace)
    assert namespace["TINY"] is True
    assert len(namespace["by_budget"]) == len(namespace["budgets"])
