"""9. Checkpoint saves: the loop's step time while a save is written, against a step without one.

One run of the real loop (`train.train`) per mode, with `--save-every 4`: steps with a save and
steps without one interleave, so both see the same moment of the machine. The step after a
save is timed from the previous `on_step` call to its own: it holds the save's work on the
training thread (the finiteness check, the copy into CPU memory, and in the blocking mode the
write itself) and, in the background mode, the write running on its thread meanwhile. Each
save cycle gives one pair, that step and the step half a cycle later; the ratio is the median
of the pairs' ratios, its spread their interquartile range.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from typing import Any

from ..config import Config
from ..runtime import accelerator
from .loop_overhead import _loop_config
from .timing import Context, Skip, compare_rounds, fmt_bytes, fmt_ratio, fmt_timing, quartiles

EVERY = 4  # steps between saves: a pair per cycle, the step after the save and two later


def section_checkpoint_saves(ctx: Context) -> dict[str, Any]:
    cycles = 4 if ctx.quick else max(10, ctx.min_runs)
    base, epoch_steps = _loop_config(ctx, (cycles + 1) * EVERY + 1)
    base = base.replace(
        save_every=EVERY, keep_last=1, log_every=10**9, run_dir=str(ctx.out / "save-run")
    )
    modes: dict[str, dict[str, Any]] = {}
    for mode, background in (("background", True), ("blocking", False)):
        config = base.replace(save_in_background=background)
        times, size = _step_times(ctx, config)
        pairs = _pairs(times, epoch_steps)
        if len(pairs) < 2:
            raise Skip(f"only {len(pairs)} save cycles away from an epoch's end")
        during, without = [p[0] for p in pairs], [p[1] for p in pairs]
        modes[mode] = {
            "during_save": _as_timing(quartiles(during)),
            "without": _as_timing(quartiles(without)),
            "ratio_rounds": compare_rounds(during, without),
            "checkpoint_bytes": size,
        }
        modes[mode]["ratio"] = modes[mode]["ratio_rounds"]["ratio"]
    rows = [
        [mode, fmt_timing(m["during_save"]), fmt_timing(m["without"]), fmt_ratio(m["ratio_rounds"])]
        for mode, m in modes.items()
    ]
    low, high = modes["background"]["ratio_rounds"]["spread"]
    return {
        "every": EVERY,
        "cycles": len(pairs),
        "modes": modes,
        "ratio": modes["background"]["ratio"],
        "target": 1.10,
        "table": {
            "columns": ["save", "step with a save ± IQR", "step without ± IQR", "ratio (spread)"],
            "rows": rows,
        },
        "notes": [
            f"background: a step during a save takes {modes['background']['ratio']:.2f}x a step "
            f"without one ({low:.2f}-{high:.2f} over {len(pairs)} save cycles; target 1.10); "
            f"blocking: {modes['blocking']['ratio']:.2f}x; checkpoint "
            f"{fmt_bytes(modes['background']['checkpoint_bytes'])}, --save-every {EVERY}",
            "a write that outlasts two steps also slows the step it is compared with, so the "
            "background ratio then reads low; compare with the blocking one",
        ],
    }


def _step_times(ctx: Context, config: Config) -> tuple[dict[int, float], int]:
    """train() with a timer in on_step: {step: seconds since the previous step's on_step},
    and the size of the checkpoint it wrote."""
    from ..train import train

    times: dict[int, float] = {}
    last: list[float] = []

    def on_step(step: int) -> None:
        accelerator.synchronize(ctx.device)
        now = time.perf_counter()
        if last:
            times[step] = now - last[0]
        last[:] = [now]

    shutil.rmtree(config.run.run_dir, ignore_errors=True)  # a scratch run
    with contextlib.redirect_stdout(io.StringIO()):
        train(config, on_step=on_step)
    path = ctx.out / "save-run" / "checkpoints" / "last.pt"
    return times, path.stat().st_size


def _pairs(times: dict[int, float], epoch_steps: int) -> list[tuple[float, float]]:
    """(the step after a save, the step half a cycle later) per save cycle after the first,
    none that spans an epoch's end (its evaluation and save)."""
    pairs = []
    for saved in range(2 * EVERY, max(times) + 1, EVERY):
        after, later = saved + 1, saved + 1 + EVERY // 2
        ends = {step for step in range(saved, later) if step % epoch_steps == 0}
        if not ends and after in times and later in times:
            pairs.append((times[after], times[later]))
    return pairs


def _as_timing(stats: dict[str, float]) -> dict[str, float]:
    return {"median_s": stats["median"], "iqr_s": stats["iqr"], "runs": stats["n"]}
