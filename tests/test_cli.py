"""The console script, run as users run it (a subprocess), including its error paths."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autockpt import cli

HERE = Path(__file__).parent


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("autockpt")
    command = [exe, *args] if exe else [sys.executable, "-m", "autockpt.cli", *args]
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=cwd or HERE, env=env
    )


def assert_user_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert text in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    result = run("plan", "autockpt.zoo:gpt", "--budget-gb", "0.0042", "-o", str(path), "--json")
    assert result.returncode == 0, result.stderr
    return path, json.loads(result.stdout)


def test_demo_runs_and_fits(tmp_path):
    result = run("demo", "--blocks", "8", "--width", "64", "--batch", "256", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["fits"] is True
    assert report["optimized"]["peak_bytes"] <= report["plan"]["budget_bytes"]
    assert report["plan"]["segments"], "halfway budget on an activation-heavy stack needs segments"
    ratio = report["step_ratio"]  # a timing shown to a user says its rounds and its spread
    assert ratio["rounds"] == 7 and ratio["low"] <= ratio["median"] <= ratio["high"]


def test_plan_show_verify_round_trip(gpt_plan):
    path, printed = gpt_plan
    assert json.loads(path.read_text()) == printed
    shown = run("show", str(path))
    assert shown.returncode == 0, shown.stderr
    for segment in printed["segments"]:
        assert segment["first_node"] in shown.stdout and segment["last_node"] in shown.stdout
    verified = run("verify", "autockpt.zoo:gpt", str(path), "--json")
    assert verified.returncode == 0, verified.stderr + verified.stdout
    report = json.loads(verified.stdout)
    assert report["ok"] and all(report["checks"].values())
    assert report["peak_bytes"] <= report["budget_bytes"]


def test_budget_below_minimum_exits_3_with_the_minimum():
    result = run("plan", "autockpt.zoo:gpt", "--budget-gb", "0.001", "-o", "/dev/null")
    assert_user_error(result, cli.EXIT_BUDGET, "minimum feasible")


def test_corrupt_plan_exits_4(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "model": ')
    assert_user_error(run("show", str(bad)), cli.EXIT_PLAN, "not valid JSON")
    missing = run("show", str(tmp_path / "nowhere.json"))
    assert_user_error(missing, cli.EXIT_PLAN, "nowhere.json")


def test_plan_for_another_model_or_version_exits_4(gpt_plan, tmp_path):
    path, printed = gpt_plan
    assert_user_error(
        run("verify", "autockpt.zoo:unet", str(path)), cli.EXIT_PLAN, "plan was made for"
    )
    future = dict(printed, schema_version=99)
    other = tmp_path / "future.json"
    other.write_text(json.dumps(future))
    assert_user_error(run("show", str(other)), cli.EXIT_PLAN, "schema_version 99")


def test_unimportable_spec_exits_5():
    assert_user_error(
        run("plan", "no_such_module:f", "--budget-gb", "1"), cli.EXIT_SPEC, "cannot import"
    )
    assert_user_error(
        run("plan", "autockpt.zoo", "--budget-gb", "1"), cli.EXIT_SPEC, "package.module:factory"
    )
    assert_user_error(
        run("plan", "autockpt.zoo:nothing", "--budget-gb", "1"), cli.EXIT_SPEC, "no callable"
    )


def test_untraceable_model_exits_6_naming_the_line():
    result = run("plan", "tests.cli_models:value_branch", "--budget-gb", "1", cwd=HERE.parent)
    assert_user_error(result, cli.EXIT_TRACE, "cli_models.py:")
    assert "x.sum() > 0" in result.stderr


def test_usage_errors_exit_2():
    assert run().returncode == cli.EXIT_USAGE
    assert run("plan", "autockpt.zoo:gpt").returncode == cli.EXIT_USAGE  # no --budget-gb


# -- the held-out model (tests.cli_models:tiny_patch_transformer, not in the zoo) through every
# command, plots, progress and the newer error paths ----------------------------------------

HELD_OUT = "tests.cli_models:tiny_patch_transformer"
ROOT = HERE.parent


def run_with_tty_stderr(*args: str, cwd: Path) -> tuple[int, str, str]:
    """Run the console script with stderr on a pseudo-terminal (as in an interactive shell);
    return the exit code, stdout and everything written to the terminal."""
    import pty

    exe = shutil.which("autockpt")
    command = [exe, *args] if exe else [sys.executable, "-m", "autockpt.cli", *args]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(
        os.environ,
        PYTHONPATH=path,
        OMP_WAIT_POLICY="PASSIVE",
        TERM="xterm",
        COLUMNS="120",
        AUTOCKPT_PROGRESS_DELAY_S="0",  # deterministic: not tied to this machine's speed
    )
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=terminal, stdin=subprocess.DEVNULL, cwd=cwd, env=env
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    stdout = process.stdout.read().decode()
    process.wait(timeout=600)
    return process.returncode, stdout, b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def held_out_plan(tmp_path_factory) -> Path:
    """`autockpt plan` on the held-out model, interactively: the terminal shows a progress
    line (delay set to 0 here); the summary goes to stdout."""
    path = tmp_path_factory.mktemp("held_out") / "plan.json"
    code, stdout, terminal = run_with_tty_stderr(
        "plan", HELD_OUT, "--budget-gb", "0.02", "-o", str(path), cwd=ROOT
    )
    assert code == 0, stdout + terminal
    assert re.search(r"capturing|profiling|measuring|solving", terminal), terminal
    assert "Traceback" not in terminal
    assert f"wrote {path}" in stdout and "checkpoint stages" in stdout
    return path


def assert_png(path: Path) -> None:
    from tests.test_report import assert_png as check

    check(path)


def test_held_out_show_prints_tables_and_plots_the_timeline(held_out_plan, tmp_path):
    plan = json.loads(held_out_plan.read_text())
    assert (
        plan["segments"]
        and plan["timeline"]
        and plan["measured_peak_bytes"] <= plan["budget_bytes"]
    )
    picture = tmp_path / "timeline.png"
    shown = run("show", str(held_out_plan), "--plot", str(picture))
    assert shown.returncode == 0, shown.stderr
    for text in (
        "memory breakdown",
        "peak with the plan",
        "measured",
        "dp" if plan["solver"] == "dp" else plan["solver"],
        plan["solver_status"],
        f"wrote {picture}",
    ):
        assert text in shown.stdout
    for segment in plan["segments"]:
        assert segment["first_node"] in shown.stdout and segment["last_node"] in shown.stdout
    assert_png(picture)


def test_held_out_verify_passes(held_out_plan):
    verified = run("verify", HELD_OUT, str(held_out_plan), "--json", cwd=ROOT)
    assert verified.returncode == 0, verified.stderr + verified.stdout
    report = json.loads(verified.stdout)
    assert report["ok"] and report["checks"] == {
        "loss equal": True,
        "gradients equal": True,
        "peak within budget": True,
    }


def test_held_out_frontier_writes_plot_and_json(tmp_path):
    picture, data = tmp_path / "frontier.png", tmp_path / "frontier.json"
    result = run(
        "frontier", HELD_OUT, "-o", str(picture), "--json", str(data), "--budgets", "5", cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "sqrt(n)" in result.stdout and "per block (blocks)" in result.stdout
    frontier = json.loads(data.read_text())
    peaks = [p["predicted_peak_bytes"] for p in frontier["points"]]
    costs = [p["predicted_recompute_seconds"] for p in frontier["points"]]
    assert peaks == sorted(peaks) and costs == sorted(costs, reverse=True)
    assert (
        peaks[0] == frontier["minimum_peak_bytes"]
        and peaks[-1] == frontier["no_checkpoint_peak_bytes"]
    )
    assert frontier["block_container"] == "blocks" and len(frontier["per_block"]["segments"]) == 6
    assert_png(picture)


def test_zoo_frontier_prints_json_for_scripts():
    result = run("frontier", "autockpt.zoo:gpt", "--json", "--no-plot", "--budgets", "3")
    assert result.returncode == 0, result.stderr
    frontier = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert frontier["model"] == "GPT" and frontier["block_container"] == "h"
    assert frontier["points"][-1]["segments"] == []


def test_show_plot_errors_are_one_line(gpt_plan, tmp_path):
    path, printed = gpt_plan
    old = tmp_path / "old.json"
    old.write_text(json.dumps({k: v for k, v in printed.items() if k != "timeline"}))
    assert run("show", str(old)).returncode == 0  # older plans still load
    assert_user_error(
        run("show", str(old), "--plot", str(tmp_path / "t.png")),
        cli.EXIT_PLAN,
        "no memory timeline",
    )
    unwritable = tmp_path / "no" / "such" / "dir" / "t.png"
    assert_user_error(
        run("show", str(path), "--plot", str(unwritable)), cli.EXIT_OUTPUT, "cannot write the plot"
    )


def test_missing_matplotlib_exits_8(gpt_plan, tmp_path):
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError('matplotlib is blocked for this test')\n"
    )
    path, _ = gpt_plan
    env_path = os.pathsep.join([str(blocker.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])
    exe = shutil.which("autockpt")
    command = [exe] if exe else [sys.executable, "-m", "autockpt.cli"]
    result = subprocess.run(
        [*command, "show", str(path), "--plot", str(tmp_path / "t.png")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=env_path, OMP_WAIT_POLICY="PASSIVE"),
    )
    assert_user_error(result, cli.EXIT_DEPENDENCY, "pip install matplotlib")


def test_errors_print_json_for_scripts(tmp_path):
    result = run("show", str(tmp_path / "absent.json"), "--json")
    assert result.returncode == cli.EXIT_PLAN and "Traceback" not in result.stderr
    error = json.loads(result.stdout)
    assert error["exit_code"] == cli.EXIT_PLAN and "absent.json" in error["message"]
    frontier = run("frontier", "no_such_module:f", "--json", "--no-plot")
    assert (
        frontier.returncode == cli.EXIT_SPEC
        and json.loads(frontier.stdout)["exit_code"] == cli.EXIT_SPEC
    )


@pytest.mark.parametrize(
    "args",
    [
        ("plan", "autockpt.zoo:gpt", "--budget-gb", "-1"),
        ("plan", "autockpt.zoo:gpt", "--budget-gb", "nan"),
        ("plan", "autockpt.zoo:gpt", "--budget-gb", "1", "--solver", "magic"),
        ("frontier", "autockpt.zoo:gpt", "--budgets", "1"),
        ("bench", "everything"),
        ("show",),
    ],
)
def test_bad_arguments_exit_2(args, capsys):
    # argparse rejects these before any work; in-process keeps the suite fast (the console
    # script's own usage path is covered by test_usage_errors_exit_2 and the one below)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(args))
    assert exit_info.value.code == cli.EXIT_USAGE
    assert "error:" in capsys.readouterr().err


def test_bad_argument_through_the_console_script_is_one_usage_error():
    result = run("plan", "autockpt.zoo:gpt", "--budget-gb", "-1")
    assert result.returncode == cli.EXIT_USAGE and "Traceback" not in result.stderr
    assert "expected a positive number" in result.stderr


def test_factory_returning_no_module_exits_5():
    result = run("plan", "tests.cli_models:not_a_module", "--budget-gb", "1", cwd=ROOT)
    assert_user_error(result, cli.EXIT_SPEC, "torch.nn.Module first")


@pytest.mark.slow
def test_bench_solvers_quick_writes_its_report(tmp_path):
    result = run(
        "bench", "solvers", "--quick", "--out", str(tmp_path / "bench"), "--json", cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the running report went to stderr
    assert report == {"benchmark": "solvers", "out": str(tmp_path / "bench")}
    assert any((tmp_path / "bench").glob("*.json")) and any((tmp_path / "bench").glob("*.png"))


def test_the_loss_is_the_users_in_plan_and_verify(tmp_path):
    """A model returning logits, trained with cross-entropy: a plan made without the loss
    (the sum of the logits) exceeds its budget on the real step, and `verify` with the
    factory's loss says so (exit 1) instead of "ok"; planned with the loss (the factory's
    third item, or --loss), the same budget holds on the real step. The plan records which
    loss it covers."""
    budget = "0.0195"  # halfway between the cross-entropy step's leanest plan and none
    summed = tmp_path / "summed.json"
    made = run("plan", "tests.cli_models:logits_lm", "--budget-gb", budget, "-o", str(summed))
    assert made.returncode == 0, made.stderr
    assert "note: no loss given" in made.stdout and "Warning" not in made.stderr
    plan = json.loads(summed.read_text())
    assert plan["loss"] == "default" and any("loss: default" in n for n in plan["notes"])
    checked = run("verify", "tests.cli_models:logits_lm_with_loss", str(summed))
    assert checked.returncode == cli.EXIT_VERIFY, checked.stderr + checked.stdout
    assert "plan was made with loss default" in checked.stdout
    assert "FAIL peak within budget" in checked.stdout

    with_loss = tmp_path / "ce.json"
    made = run(
        "plan", "tests.cli_models:logits_lm_with_loss", "--budget-gb", budget, "-o", str(with_loss)
    )
    assert made.returncode == 0, made.stderr
    plan = json.loads(with_loss.read_text())
    assert plan["loss"] == "tests.cli_models:next_token_loss"
    checked = run("verify", "tests.cli_models:logits_lm_with_loss", str(with_loss), "--json")
    assert checked.returncode == 0, checked.stderr + checked.stdout
    report = json.loads(checked.stdout)
    assert report["ok"] and report["peak_bytes"] <= report["budget_bytes"]
    assert report["loss"] == report["plan_loss"] == "tests.cli_models:next_token_loss"

    flag = tmp_path / "flag.json"
    spec, loss = "tests.cli_models:logits_lm", "tests.cli_models:next_token_loss"
    made = run("plan", spec, "--budget-gb", budget, "-o", str(flag), "--loss", loss)
    assert made.returncode == 0, made.stderr
    again = json.loads(flag.read_text())
    assert again["loss"] == loss

    def stages(p: dict) -> list[tuple[int, int]]:
        return [(seg["start_stage"], seg["end_stage"]) for seg in p["segments"]]

    assert stages(again) == stages(plan)


def test_a_loss_that_cannot_be_imported_or_called_exits_5(tmp_path):
    out = str(tmp_path / "p.json")
    bad = run("plan", "tests.cli_models:logits_lm", "--budget-gb", "1", "--loss", "nowhere:f")
    assert_user_error(bad, cli.EXIT_SPEC, "cannot import 'nowhere'")
    spelled = run(
        "plan", "tests.cli_models:logits_lm", "--budget-gb", "1", "-o", out, "--loss", "x"
    )
    assert_user_error(spelled, cli.EXIT_SPEC, "--loss must look like package.module:function")
