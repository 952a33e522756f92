"""tools/gpu_checks.sh without a GPU: its plans run with stand-ins for nvidia-smi and python3 (first on PATH)
and tiny limits (GPU_CHECKS_SCALE), so the order, each step's limit, the logs and the summary are checked
without CUDA; and its one-line refusals."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "tools" / "gpu_checks.sh"
BASH = shutil.which("bash")
SCALE = 0.02
QUICK = ["quick-tests", "quick-wt103", "quick-wt2par", "quick-latency"]
FULL = ["tests", "syncs", "steps-wt103-bf16", "steps-wt103-tf32", "steps-wt2par", "steps-graphs-wt2par",
        "steps-graphs-wt103", "steps-nvidia", "padding-tests", "padding-wt103", "supernet-tests", "supernet-wt2par",
        "flex-wt103", "flex-long", "latency"]
PYTEST_STEPS = ("tests", "quick-tests", "padding-tests", "supernet-tests")


def run_plan(tmp_path: Path, args: list[str], python3: str, gpu: str = "Stand-in GPU"
             ) -> tuple[subprocess.CompletedProcess, Path, list[dict]]:
    """Runs the script with ``python3`` (a shell script's body; $CALLS lists each call) and a fake nvidia-smi
    (naming ``gpu``) first on PATH; returns the process, $OUT and the summary's rows."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}, 81559 MiB, 0'\n")
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$*" >>"$CALLS"\n{python3}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out),
           "GPU_CHECKS_SCALE": str(SCALE), "CALLS": str(tmp_path / "calls")}
    proc = subprocess.run([BASH, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)
    header, *lines = (out / "summary.tsv").read_text().splitlines()
    rows = [dict(zip(header.split("\t"), line.split("\t"))) for line in lines]
    return proc, out, rows


@pytest.mark.slow
def test_quick_runs_its_steps_in_order_each_cut_at_its_own_limit_and_logged_as_it_goes(tmp_path):
    """The WT103 step hangs (cut at its limit, after what it printed reached its log), the wt2-par step fails,
    the latency step hangs: each later step still runs, and the summary is written step by step."""
    python3 = """case "$*" in
    *"import pytest_timeout"*) exit 0 ;;
    *wt103*) echo "compiled (default): ready"; sleep 60 ;;
    *wt2-par*reduce-overhead*) cat "$OUT/summary.tsv"
        echo "wt2-par: the wt2-par preset at its GPU length; 6 layers, d_model 128, 4 heads"
        echo "  compiled (reduce-overhead)  301,234 tokens/s  13.6 ms/step  peak   0.30 GiB  12.2 MFLOP/token  MFU 0.4%"
        exit 3 ;;
    *"parnas.cli latency"*) echo "timing the table"; sleep 60 ;;
    *) echo "ran $*" ;;
esac"""
    proc, out, rows = run_plan(tmp_path, ["quick"], python3)
    assert proc.returncode == 1, proc.stderr
    assert [r["step"] for r in rows] == QUICK
    assert [(r["result"], r["exit"]) for r in rows] == [("passed", "0"), ("cut", "124"), ("failed", "3"),
                                                        ("cut", "124")]
    limits = [float(r["limit"]) for r in rows]
    for row, limit in zip(rows, limits):
        if row["result"] == "cut":
            assert limit <= float(row["seconds"]) < limit + 1.5, row
    # the one command ends within 7 minutes: its limits, the install before it and the lines before the steps
    assert sum(limits) / SCALE <= 6.5 * 60 - 20

    assert "compiled (default): ready" in (out / "quick-wt103.log").read_text()  # printed before the cut
    assert "timing the table" in (out / "quick-latency.log").read_text()
    assert "quick-wt103\tcut\t124" in (out / "quick-wt2par.log").read_text()  # the summary as the step began
    assert "Stand-in GPU" in (out / "device.txt").read_text()
    calls = (tmp_path / "calls").read_text().splitlines()[2:]  # after torch's version and pytest-timeout's check
    assert [c.split()[:3] for c in calls] == [["-m", "pytest", "-v"],
                                              ["benchmarks/gpu_step.py", "--shape", "wt103-base"],
                                              ["benchmarks/gpu_step.py", "--shape", "wt2-par"],
                                              ["-m", "parnas.cli", "latency"]]
    assert "-m gpu" in calls[0] and "--timeout=60" in calls[0]  # each test under its own limit
    assert "--no-supernet" in calls[1] and "--compile reduce-overhead" in calls[2]  # WT103 eager; wt2-par graphs
    assert "-k test_search_export_retrain_evaluate_generate_compare_on_cuda or" in calls[0]  # the most valuable
    # one table of every model timed, from the steps' logs (a failed step's rows too)
    assert "| quick-wt2par | wt2-par | compiled (reduce-overhead) | 301,234 | 13.6 | 0.4% | 0.30 |" in \
        (out / "table.md").read_text().splitlines()
    assert calls[3].endswith(f"--out {out}/gpu-wt2-par-v2.json")
    assert "4 steps, 1 passed, 3 failed or cut" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("args, steps", [(["quick"], QUICK), ([], FULL),
                                         (["latency", "flex"], ["flex-wt103", "flex-long", "latency"]),
                                         (["supernet"], ["supernet-tests", "supernet-wt2par"]),
                                         (["supernet", "padding"],
                                          ["padding-tests", "padding-wt103", "supernet-tests", "supernet-wt2par"])])
def test_each_plan_runs_its_steps_and_passes_when_they_do(tmp_path, args, steps):
    """Without pytest-timeout the tests run under their step's limit alone, and say so."""
    proc, out, rows = run_plan(tmp_path, args, 'case "$*" in *"import pytest_timeout"*) exit 1 ;; esac')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(r["step"], r["result"]) for r in rows] == [(s, "passed") for s in steps]
    assert sorted(p.name for p in out.glob("*.log")) == sorted(f"{s}.log" for s in steps)
    pytest_calls = [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m pytest")]
    assert len(pytest_calls) == len([s for s in steps if s in PYTEST_STEPS])
    assert not any("--timeout" in c for c in pytest_calls)
    assert ("pytest-timeout is not installed" in proc.stdout) == bool(pytest_calls)


@pytest.mark.parametrize("args, env, needle", [
    (["quick"], {}, "no NVIDIA GPU here (nvidia-smi not found)"),
    (["quick", "qiuck"], {}, "unknown step 'qiuck'"),
    (["quick"], {"GPU_CHECKS_SCALE": "0"}, "GPU_CHECKS_SCALE=0 is not a positive number")])
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, args, env, needle):
    empty = tmp_path / "bin"  # no nvidia-smi on PATH, nor anything else
    empty.mkdir()
    proc = subprocess.run([BASH, str(SCRIPT), *args], env={"PATH": str(empty), "OUT": str(tmp_path / "out"), **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
