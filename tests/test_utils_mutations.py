"""The generated utils tests catch wrong implementations, not just the right one.

A test suite that passes whatever the code does proves nothing. Here the template is rendered
once, then each technique in the generated `utils.py` is broken in one realistic way (the bugs
the spec and the source article warn about) and the generated project's own tests for that
technique must fail. Every mutation must match the source exactly once, so a change to
`utils.py` cannot silently turn this file into a test of nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from helpers import KILL_RATES

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "mutpkg"


class Mutation(NamedTuple):
    name: str
    old: str
    new: str
    tests: str  # the generated test file that must catch it
    select: str | None = None  # a -k expression, to run only the tests that can catch it
    timed: bool = False  # caught by a speed ratio: skipped, not passed, without two free CPUs


class Outcome(NamedTuple):
    result: subprocess.CompletedProcess[str] | None
    problem: str  # why the mutation could not be applied


UNMUTATED = "unmutated"


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
        "    return torch.nn.utils.clip_grad_norm_(\n"
        "        params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite\n"
        "    )\n",
        "    torch.nn.utils.clip_grad_norm_(\n"
        "        params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite\n"
        "    )\n"
        "    return torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)\n",
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
    copier = pytest.importorskip("copier")
    destination = tmp_path_factory.mktemp("utils-mutations") / "project"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dirty working tree is rendered on purpose
        copier.run_copy(
            src_path=str(REPO),
            dst_path=destination,
            defaults=True,
            vcs_ref="HEAD",
            data={"package_name": PACKAGE},
            unsafe=False,
            quiet=True,
        )
    return destination


def _utils_test_files(project: Path) -> list[str]:
    return sorted(path.name for path in (project / "tests").glob("test_utils*.py"))


def _run_tests(
    project: Path, test_files: list[str], select: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(project / "src"), env.get("PYTHONPATH")]))
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-rs", "-p", "no:cacheprovider"]
    command += ["-m", "not gpu and not slow", *(f"tests/{name}" for name in test_files)]
    if select:
        command += ["-k", select]
    return subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def _mutate_and_run(rendered: Path, workdir: Path, mutation: Mutation) -> Outcome:
    project = workdir / mutation.name
    shutil.copytree(rendered, project)
    utils_py = project / "src" / PACKAGE / "utils.py"
    source = utils_py.read_text(encoding="utf-8")
    matches = source.count(mutation.old)
    if matches != 1:
        return Outcome(None, f"the mutation matches utils.py {matches} times instead of once")
    utils_py.write_text(source.replace(mutation.old, mutation.new), encoding="utf-8")
    return Outcome(_run_tests(project, [mutation.tests], mutation.select), "")


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest,
    rendered_project: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Outcome]:
    """Run every selected mutation once, two at a time (each run is mostly torch's import)."""
    selected = {
        item.callspec.params["mutation"].name
        if hasattr(item, "callspec") and "mutation" in item.callspec.params
        else item.name
        for item in request.session.items
    }
    workdir = tmp_path_factory.mktemp("mutants")
    jobs = [m for m in MUTATIONS if m.name in selected and not m.timed]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {m.name: pool.submit(_mutate_and_run, rendered_project, workdir, m) for m in jobs}
        if "test_the_unmutated_utils_pass_their_tests" in selected:
            files = _utils_test_files(rendered_project)
            futures[UNMUTATED] = pool.submit(
                lambda: Outcome(_run_tests(rendered_project, files), "")
            )
        results = {name: future.result() for name, future in futures.items()}
    # A mutation caught by a speed ratio runs alone, after the pool: a run beside it would
    # take the CPUs its test needs free.
    for mutation in MUTATIONS:
        if mutation.timed and mutation.name in selected:
            results[mutation.name] = _mutate_and_run(rendered_project, workdir, mutation)
    planted = [name for name in results if name != UNMUTATED]
    caught = [
        name
        for name in planted
        if results[name].result is not None
        and results[name].result.returncode == 1  # type: ignore[union-attr]
        and " failed" in results[name].result.stdout  # type: ignore[union-attr]
    ]
    unmeasured = [
        name
        for name in planted
        if results[name].result is not None
        and "two CPUs were never free" in results[name].result.stdout  # type: ignore[union-attr]
    ]
    KILL_RATES.append(
        f"utils mutations: {len(caught)}/{len(planted)} planted bugs caught by the generated "
        f"utils tests ({100 * len(caught) / max(len(planted), 1):.0f}%)"
        + (f", {len(unmeasured)} not measurable without two free CPUs" if unmeasured else "")
    )
    return results


def test_every_mutation_targets_a_rendered_test_file(rendered_project: Path) -> None:
    files = _utils_test_files(rendered_project)
    assert {mutation.tests for mutation in MUTATIONS} <= set(files)
    assert len({mutation.name for mutation in MUTATIONS}) == len(MUTATIONS)


def test_the_unmutated_utils_pass_their_tests(outcomes: dict[str, Outcome]) -> None:
    result = outcomes[UNMUTATED].result
    assert result is not None
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_a_broken_technique_fails_its_tests(
    outcomes: dict[str, Outcome], mutation: Mutation
) -> None:
    result, problem = outcomes[mutation.name]
    assert result is not None, f"{mutation.name}: {problem}"
    output = result.stdout[-4000:] + result.stderr[-2000:]
    if mutation.timed and result.returncode == 0 and "two CPUs were never free" in output:
        pytest.skip(f"{mutation.name}: no two free CPUs to measure the tuner on")
    # Exit code 1 means tests ran and failed; 2 (an import or collection error) would mean the
    # mutation broke the module rather than the technique, which proves nothing.
    assert result.returncode == 1, f"exit code {result.returncode}:\n{output}"
    assert " failed" in result.stdout, output
