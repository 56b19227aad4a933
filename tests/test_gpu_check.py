"""`make gpu-check` at the tiny shape on CPU, as a bare GPU image would run it.

The run goes through the Make target with a python that cannot import GPTQModel, bitsandbytes,
torchao, accelerate, scipy, scikit-learn, statsmodels, pydantic, lm-eval, datasets, matplotlib or
psutil (each set to None in sys.modules, so importing fails and transformers' find_spec checks say
absent): the script must not need them. The run is float32, so every greedy check must be exact, and
the default time budget must leave room for every part, the speculative rounds included.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BLOCKED = ("gptqmodel", "bitsandbytes", "torchao", "accelerate", "optimum", "scipy", "sklearn", "statsmodels",
           "pydantic", "lm_eval", "datasets", "matplotlib", "psutil")
BARE_PYTHON = f"""
import runpy, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # as if not installed
assert sys.argv[1] == "-m", sys.argv
module = sys.argv[2]
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    wrapper = tmp / "bare_python.py"
    wrapper.write_text(BARE_PYTHON)
    out = tmp / "out"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"OUT={out}",
                           f"GPU_PY={sys.executable} {wrapper}", "GPU_CHECK_ARGS=--shape tiny --bandwidth-mib 16"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), proc.stderr


def test_every_part_ran_and_greedy_is_exact_in_float32(gpu_check):
    doc, _, stderr = gpu_check
    # Nothing skipped for the budget: the speculative rounds at every k ran within it.
    assert doc["finished"] and doc["skipped"] == [] and doc["errors"] == [] and "gpu-check: done" in stderr
    assert doc["environment"]["device"] == "cpu" and doc["settings"]["dtype"] == "float32"
    assert doc["elapsed_s"] < doc["budget_s"]
    assert doc["model"]["shape"] == "tiny" and doc["model"]["parameters"] > 0
    parts = doc["parts"]
    assert parts["bandwidth"]["gbps"] > 0
    assert [s["batch"] for s in doc["memory_plan"]["steps"] if s["action"] == "run"] == [1, 2]
    assert set(parts) == {"bandwidth", "plain", "speculative"}  # float32 already: no separate float32 check
    cells = parts["plain"]["cells"]
    assert [c["batch"] for c in cells] == [1, 2]
    for c in cells:
        assert len(c["tpot_ms"]["samples"]) == 2 and c["tpot_ms"]["min"] <= c["tpot_ms"]["median"] > 0
        assert c["roofline_fraction"] == pytest.approx(c["achieved_gbps"] / parts["bandwidth"]["gbps"])
        assert len(c["tokens"]) == 12
    rows = parts["speculative"]["rows"]
    assert parts["speculative"]["draft"] == "layerskip:1" and [r["k"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["greedy"] == {"equal": True}, r  # float32: speculative greedy == plain greedy, exactly
        assert 1.0 <= r["tokens_per_round"]["median"] <= r["k"] + 1
        assert r["round_ms"]["median"] >= r["draft_ms"]["min"] > 0


def test_the_versions_it_ran_with_are_printed_first_and_recorded(gpu_check):
    """The python (GPU_PY, here the test's own interpreter through the wrapper), torch and the CUDA it
    was built for, and transformers: the first thing on stderr and in the JSON and the table."""
    import platform

    import transformers

    doc, md, stderr = gpu_check
    env = doc["environment"]
    assert env["python_executable"] == sys.executable and env["python"] == platform.python_version()
    assert env["torch"] == torch.__version__ and env["torch_cuda"] == torch.version.cuda
    assert env["transformers"] == transformers.__version__
    first = stderr.splitlines()[0]
    assert first.endswith(f"] gpu-check: python {env['python']} ({sys.executable}), torch {torch.__version__} "
                          f"(CUDA {torch.version.cuda or 'none: a CPU build'}), transformers "
                          f"{transformers.__version__}" + (f", NVIDIA driver {env['nvidia_driver']}"
                                                           if env["nvidia_driver"] else ""))
    assert (f"python {env['python']} ({sys.executable}), torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"transformers {transformers.__version__}, float32") in md


def test_markdown_table(gpu_check):
    _, md, _ = gpu_check
    lines = md.splitlines()
    assert lines[0] == "# gpu-check: tiny shape on " + gpu_check[0]["environment"]["device_name"]
    assert "| part | cell | measured | note |" in lines
    rows = [line for line in lines if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| bandwidth", "| plain decode", "| plain decode",
                                                     *["| speculative (layerskip:1)"] * 3]
    assert all(r.count("|") == 5 for r in rows)  # four columns in every row
    assert sum("greedy == plain" in r for r in rows) == 3  # k = 1, 2, 3
    assert "% of roofline" in rows[2] and "memory plan: 2 cells" in md


def test_budget_guard_skips_parts_with_a_note(tmp_path):
    """No time left: every part is skipped with its reason, and the files still say so."""
    from pipeline.tools.gpu_check import main

    assert main([str(tmp_path), "--shape", "tiny", "--budget-s", "0"]) == 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["finished"] and "bandwidth" not in doc["parts"]
    assert doc["parts"]["plain"]["cells"] == [] and doc["parts"]["speculative"]["rows"] == []
    skipped = [s["part"] for s in doc["skipped"]]
    assert skipped == ["bandwidth", "plain B=1", "plain B=2", "speculative k=1", "speculative k=2",
                       "speculative k=3"]
    assert all("budget" in s["why"] for s in doc["skipped"])
    assert "- skipped plain B=1: needs about" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_part_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    from pipeline.tools import gpu_check

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(gpu_check, "plain_part", broken)
    assert gpu_check.main([str(tmp_path), "--shape", "tiny", "--budget-s", "0"]) == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["finished"] and [e["part"] for e in doc["errors"]] == ["plain"]
    assert doc["errors"][0]["error"] == "RuntimeError: kernel exploded" and doc["errors"][0]["traceback"]
    assert "speculative k=1" in [s["part"] for s in doc["skipped"]]  # the next part was still reached
    assert "- FAILED plain: RuntimeError: kernel exploded" in (tmp_path / "gpu_check.md").read_text()


def test_logit_gap_at_a_divergence():
    """compare_greedy: where two outputs first differ, the target's logit gap between the token
    of the reference and the other one, from an uncached forward (checked by hand here)."""
    from pipeline.decode.engine import generate
    from pipeline.tools.gpu_check import build_model, compare_greedy, prompt

    model = build_model("tiny", torch.device("cpu"), torch.float32, seed=1)
    ids = prompt(model.config.vocab_size, 1, 10, seed=2)
    reference = generate(model, ids, 6).tokens
    with torch.inference_mode():
        logits = model(input_ids=torch.cat([ids[0], torch.tensor(reference[:3])]).unsqueeze(0)).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    other = reference[:3] + [runner_up] + reference[4:]
    out = compare_greedy(model, ids, reference, other)
    assert out["first_divergence"] == 3 and out["token"] == runner_up and not out["equal"]
    assert out["logit_gap"] == pytest.approx(float(logits[reference[3]] - logits[runner_up]), abs=1e-5)
    assert out["logit_gap"] > 0 and out["near_tie"] == (out["logit_gap"] <= 0.02 * max(1.0, abs(out["top_logit"])))
    assert compare_greedy(model, ids, reference, list(reference)) == {"equal": True}


def test_an_old_driver_stops_the_check_with_one_line(tmp_path, monkeypatch, capsys):
    """A CUDA 13 torch on an R550 driver (probes replaced: this machine has none): the check stops
    before building the model, exit 2, with the versions and the one line in the JSON."""
    from pipeline.core import device
    from pipeline.tools import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(device, "driver_cuda_version", lambda: 12040)
    monkeypatch.setattr(device, "driver_version", lambda: "550.54.15")
    monkeypatch.setattr(gpu_check, "driver_version", lambda: "550.54.15")
    monkeypatch.setattr(gpu_check, "build_model", lambda *a, **k: pytest.fail("the model must not be built"))
    assert gpu_check.main([str(tmp_path), "--shape", "tiny"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "gpu-check: device: auto: torch " in last and "built for CUDA 13.0" in last and "R580" in last
    assert "550.54.15 (supports CUDA 12.4)" in last
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["environment"]["torch_cuda"] == "13.0" and doc["environment"]["nvidia_driver"] == "550.54.15"
    assert [e["part"] for e in doc["errors"]] == ["device"] and "R580" in doc["errors"][0]["error"]
    assert "- FAILED device: device: auto: torch" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.parametrize("installed", [False, True])
def test_make_picks_the_venv_python_only_when_its_install_finished(tmp_path, installed):
    """`make -n gpu-check` in a copy of the Makefile: with a .venv whose install finished (the stamp),
    .venv/bin/python; with none, or one whose install did not finish, python3. Nothing is installed
    (-n runs nothing, and the target has no prerequisite)."""
    (tmp_path / "Makefile").write_text((REPO / "Makefile").read_text())
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    if installed:
        (tmp_path / ".venv" / ".installed").write_text("")

    def recipe(*args):
        out = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    python = ".venv/bin/python" if installed else "python3"
    assert recipe() == (f"PYTHONPATH=.${{PYTHONPATH:+:$PYTHONPATH}} {python} -m pipeline.tools.gpu_check "
                        "'runs/gpu-check'")
    assert recipe("GPU_PY=/opt/py/bin/python3").split()[1] == "/opt/py/bin/python3"
    assert {p.name for p in (tmp_path / ".venv").iterdir()} == {"bin"} | ({".installed"} if installed else set())
