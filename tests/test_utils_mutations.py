"""The generated utils tests catch wrong implementations, not just the right one.

A test suite that passes whatever the code does proves nothing. Here the template is rendered
once, then each technique in the generated `utils.py` is broken in one realistic way (the bugs
the spec and the source article warn about) and the generated project's own tests for that
technique must fail. Every mutation must match the source exactly once, so a change to
`utils.py` cannot silently turn this file into a test of nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest

from helpers import KILL_RATES
from mutations import caught, render_to_mutate, run_jobs


class Mutation(NamedTuple):
    name: str
    old: str
    new: str
    tests: str  # the generated test file that must catch it
    select: str | None = None  # a -k expression, to run only the tests that can catch it
    timed: bool = False  # caught by a speed ratio: skipped, not passed, without two free CPUs


UNMUTATED = "unmutated"
# What the generated tuner test says when it skips: another process held a CPU it needed.
UNMEASURED = "two CPUs were never free"


MUTATIONS = [
    # 1. Seeding and determinism
    Mutation(
        "seed-0-skipped",
        "    torch.manual_seed(seed)\n",
        "    if seed:  # the falsy-seed bug\n        torch.manual_seed(seed)\n",
        "test_utils_seeding.py",
    ),
    Mutation(
        "workers-share-one-seed",
        "    worker_seed = torch.initial_seed() % 2**32\n",
        "    worker_seed = 0\n",
        "test_utils_seeding.py",
    ),
    Mutation(
        "loader-ignores-its-generator",
        "        generator=generator,\n",
        "        generator=None,\n",
        "test_utils_seeding.py",
    ),
    Mutation(
        "deterministic-switch-called-at-every-start",
        "    if enabled or torch.are_deterministic_algorithms_enabled():\n",
        "    if True:\n",
        "test_utils_seeding.py",
    ),
    # 2. Anomaly detection
    Mutation(
        "anomaly-never-enabled",
        "    return torch.autograd.detect_anomaly(check_nan=True)\n",
        "    return contextlib.nullcontext()\n",
        "test_utils_anomaly.py",
    ),
    Mutation(
        "anomaly-wraps-only-backward",  # the article's pattern, behind the same API
        "    return torch.autograd.detect_anomaly(check_nan=True)\n",
        "    return _backward_only()\n"
        "\n\n"
        "@contextlib.contextmanager\n"
        "def _backward_only():\n"
        "    original = torch.Tensor.backward\n"
        "\n"
        "    def backward(self, *args, **kwargs):\n"
        "        with torch.autograd.detect_anomaly(check_nan=True):\n"
        "            return original(self, *args, **kwargs)\n"
        "\n"
        "    torch.Tensor.backward = backward\n"
        "    try:\n"
        "        yield\n"
        "    finally:\n"
        "        torch.Tensor.backward = original\n",
        "test_utils_anomaly.py",
    ),
    Mutation(
        "anomaly-enabled-on-construction",
        "    return torch.autograd.detect_anomaly(check_nan=True)\n",
        "    return torch.autograd.set_detect_anomaly(True, check_nan=True)\n",
        "test_utils_anomaly.py",
    ),
    Mutation(
        "finite-check-sees-nan-only",
        "    finite = torch.isfinite(value.detach())\n",
        "    finite = ~torch.isnan(value.detach())\n",
        "test_utils_anomaly.py",
    ),
    # 3. DataLoader workers
    Mutation(
        "persistent-workers-with-zero-workers",
        "    if num_workers > 0:\n",
        "    if True:\n",
        "test_utils_data.py",
    ),
    Mutation(
        "auto-workers-ignore-other-ranks",
        "available_cpus() // world_size - 1",
        "available_cpus() - 1",
        "test_utils_data.py",
    ),
    Mutation(
        "tuner-ignores-the-worker-count",
        "            num_workers=workers,\n",
        "            num_workers=0,\n",
        "test_utils_data.py",
        select="tuner_ranks",
        timed=True,
    ),
    Mutation(
        "tuner-stops-only-after-measuring",
        "                    samples += _batch_len(next(batches))\n                    check()\n",
        "                    samples += _batch_len(next(batches))\n",
        "test_utils_data.py",
        select="tuning_workers_waits",
    ),
    Mutation(
        "workers-start-with-stop-signals-open",
        "    return SignalSafeLoader(\n",
        "    return DataLoader(\n",
        "test_utils_data.py",
        select="stop_signal",
    ),
    # 4. pin_memory and non_blocking
    Mutation(
        "pin-memory-on-cpu",
        "        pin_memory=_pin_memory_for(device),\n",
        "        pin_memory=True,\n",
        "test_utils_data.py",
    ),
    Mutation(
        "to-device-flattens-dicts",
        "    if isinstance(batch, Mapping):\n        moved",
        "    if isinstance(batch, Mapping):\n"
        "        return [to_device(v, device) for v in batch.values()]  # type: ignore\n"
        "        moved",
        "test_utils_data.py",
    ),
    # 5. torch.compile
    Mutation(
        "unwrap-keeps-ddp",
        "            model = model.module\n",
        "            return model\n",
        "test_utils_compile.py",
    ),
    # 6. Evaluation without autograd
    Mutation(
        "eval-under-no-grad",
        "        with torch.inference_mode():\n",
        "        with torch.no_grad():\n",
        "test_utils_eval.py",
    ),
    Mutation(
        "eval-mode-not-restored",
        "            module.training = training\n",
        "            pass\n",
        "test_utils_eval.py",
    ),
    # 7. Gradient clipping
    Mutation(
        "clip-returns-post-clip-norm",
        "        norm = torch.nn.utils.clip_grad_norm_(\n"
        "            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite\n"
        "        )\n",
        "        torch.nn.utils.clip_grad_norm_(\n"
        "            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite\n"
        "        )\n"
        "        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)\n",
        "test_utils_clip.py",
    ),
    Mutation(
        "clip-before-unscale",
        "        scaler.unscale_(optimizer)\n",
        "        pass\n",
        "test_utils_clip.py",
    ),
]


@pytest.fixture(scope="module")
def rendered_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_to_mutate(tmp_path_factory, "utils-mutations")


def _utils_test_files(project: Path) -> list[str]:
    return sorted(path.name for path in (project / "tests").glob("test_utils*.py"))


def _job(name: str, edits: list[tuple[str, str]], tests: list[str], **extra: Any) -> dict:
    return {"name": name, "module": "utils.py", "edits": edits, "timeout": 300,
            "tests": [f"tests/{test}" for test in tests], "markers": "not gpu and not slow",
            "select": None, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest,
    rendered_project: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """Run every selected mutation once, in tests/mutation_runner.py (one torch import, two
    children at a time); a mutation caught by a speed ratio runs last and alone, since a run
    beside it would take the CPUs its test needs free."""
    selected = {
        item.callspec.params["mutation"].name
        if hasattr(item, "callspec") and "mutation" in item.callspec.params
        else item.name
        for item in request.session.items
    }
    jobs = [
        _job(m.name, [(m.old, m.new)], [m.tests], select=m.select, alone=m.timed)
        for m in sorted(MUTATIONS, key=lambda m: m.timed)
        if m.name in selected
    ]
    if "test_the_unmutated_utils_pass_their_tests" in selected:
        jobs.insert(0, _job(UNMUTATED, [], _utils_test_files(rendered_project)))
    results = run_jobs(rendered_project, jobs, tmp_path_factory)
    planted = [name for name in results if name != UNMUTATED]
    hits = [name for name in planted if caught(results[name])]
    unmeasured = [name for name in planted if UNMEASURED in results[name]["output"]]
    KILL_RATES.append(
        f"utils mutations: {len(hits)}/{len(planted)} planted bugs caught by the generated "
        f"utils tests ({100 * len(hits) / max(len(planted), 1):.0f}%)"
        + (f", {len(unmeasured)} not measurable without two free CPUs" if unmeasured else "")
    )
    return results


def test_every_mutation_targets_a_rendered_test_file(rendered_project: Path) -> None:
    files = _utils_test_files(rendered_project)
    assert {mutation.tests for mutation in MUTATIONS} <= set(files)
    assert len({mutation.name for mutation in MUTATIONS}) == len(MUTATIONS)


def test_the_unmutated_utils_pass_their_tests(outcomes: dict[str, dict[str, Any]]) -> None:
    result = outcomes[UNMUTATED]
    assert not result["problem"], result["problem"]
    assert result["code"] == 0, result["output"][-4000:]
    assert " passed" in result["output"]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_a_broken_technique_fails_its_tests(
    outcomes: dict[str, dict[str, Any]], mutation: Mutation
) -> None:
    result = outcomes[mutation.name]
    assert not result["problem"], f"{mutation.name}: {result['problem']}"
    output = result["output"][-4000:]
    if mutation.timed and result["code"] == 0 and UNMEASURED in output:
        pytest.skip(f"{mutation.name}: no two free CPUs to measure the tuner on")
    # Exit code 1 means tests ran and failed; 2 (an import or collection error) would mean the
    # mutation broke the module rather than the technique, which proves nothing.
    assert result["code"] == 1, f"exit code {result['code']}:\n{output}"
    assert caught(result), output
