"""notebooks/staleness_effects.ipynb runs top to bottom on the committed results and shows
its plots as images."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "staleness_effects.ipynb"

# About 10 s on a 2-core CPU (kernel start and JAX import included), so not marked slow:
# the cells load ~60 small run directories and draw six figures.


def test_notebook_executes_and_shows_images(tmp_path):
    extra = "needs the analysis extra: pip install 'a3po_jax[analysis]'"
    nbformat = pytest.importorskip("nbformat", reason=extra)
    nbclient = pytest.importorskip("nbclient", reason=extra)
    pytest.importorskip("ipykernel", reason=extra)
    pytest.importorskip("pandas", reason=extra)
    pytest.importorskip("matplotlib", reason=extra)
    assert (ROOT / "results" / "staleness_sweep_toy").is_dir(), "committed results missing"

    # Executed from a temporary copy placed where the original lives relative to the
    # results (../results), so the committed file is never rewritten by the test.
    work = tmp_path / "notebooks"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    (tmp_path / "results").symlink_to(ROOT / "results")
    nb = nbformat.read(work / NOTEBOOK.name, as_version=4)
    # Clear stored outputs: the images checked below must come from this execution.
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None

    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(work)}},
    )
    # The kernel must be this interpreter's (the venv with a3po_jax), whatever kernelspecs
    # the machine has installed.
    client.kernel_manager_class = _venv_kernel_manager()
    client.execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5
    tables = [o for c in code for o in c.outputs if "text/markdown" in o.get("data", {})]
    assert any("± " in o["data"]["text/markdown"] for o in tables)
    # Prose before every code cell (the notebook explains before it computes).
    for before, cell in zip(nb.cells, nb.cells[1:], strict=False):
        if cell.cell_type == "code":
            assert before.cell_type == "markdown"


def _venv_kernel_manager():
    from jupyter_client.manager import KernelManager

    class VenvKernelManager(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return [
                sys.executable,
                "-m",
                "ipykernel_launcher",
                "-f",
                self.connection_file,
            ]

    return VenvKernelManager
