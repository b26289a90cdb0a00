"""The console script, run as users run it (a subprocess), including its error paths."""

from __future__ import annotations

import json
import os
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
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd or HERE, env=env)


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
    assert_user_error(run("verify", "autockpt.zoo:unet", str(path)), cli.EXIT_PLAN, "plan was made for")
    future = dict(printed, schema_version=99)
    other = tmp_path / "future.json"
    other.write_text(json.dumps(future))
    assert_user_error(run("show", str(other)), cli.EXIT_PLAN, "schema_version 99")


def test_unimportable_spec_exits_5():
    assert_user_error(run("plan", "no_such_module:f", "--budget-gb", "1"), cli.EXIT_SPEC, "cannot import")
    assert_user_error(run("plan", "autockpt.zoo", "--budget-gb", "1"), cli.EXIT_SPEC, "package.module:factory")
    assert_user_error(run("plan", "autockpt.zoo:nothing", "--budget-gb", "1"), cli.EXIT_SPEC, "no callable")


def test_untraceable_model_exits_6_naming_the_line():
    result = run("plan", "tests.cli_models:value_branch", "--budget-gb", "1", cwd=HERE.parent)
    assert_user_error(result, cli.EXIT_TRACE, "cli_models.py:")
    assert "x.sum() > 0" in result.stderr


def test_usage_errors_exit_2():
    assert run().returncode == cli.EXIT_USAGE
    assert run("plan", "autockpt.zoo:gpt").returncode == cli.EXIT_USAGE  # no --budget-gb
