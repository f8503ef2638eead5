"""examples/quickstart.ipynb runs headless (nbclient, the venv's python3 kernel) on the embedded SmolLM2:
generation with the strategy, the stats as text, HTML and a plot, generate_batch, a small eval run.
The notebook asserts greedy equality with plain decoding itself, so a regression fails a cell."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits it; see the one_thread fixture
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    data = [o.data for o in outputs if o.output_type in ("execute_result", "display_data")]
    assert "mean accepted drafts per cycle" in text and "acceptance rate" in text
    assert any("<table>" in d.get("text/html", "") and "SparseSpecStats" in d["text/html"] for d in data)
    assert any("image/png" in d for d in data)
    report = next(d["text/markdown"] for d in data if "text/markdown" in d)
    assert "Greedy: 2/2 outputs identical token for token" in report and "| sparsespec |" in report
