"""Measure what each technique buys on this machine: `python -m <package>.benchmark --help`.

One module per section, plus `timing` (what they share) and `cli` (the command line).

Eleven sections, side by side in one run. Every figure is a measurement from this run with its
spread (median and interquartile range from `torch.utils.benchmark`), or a ratio from
interleaved rounds with its spread across rounds ("within noise" when that spread covers 1.0),
or `skipped: <reason>`. Model FLOPs utilization is divided by a peak measured on this device
(a cached matmul calibration, see `observability/mfu.py`), and by the datasheet peak where one is
known.

1. DataLoader workers on an on-disk image folder: samples/s per worker count
2. pin_memory + non_blocking versus pageable, blocking host-to-device copies (CUDA only)
3. torch.compile versus eager: training-step time, and the first (compiling) call
4. evaluation under inference_mode versus no_grad versus grad-enabled: time and peak memory
5. anomaly detection, deterministic mode, gradient clipping: step time on / off
6. the real training loop (`train.train`) versus a bare loop over the same model and data
7. throughput in samples/s (tokens/s for a language model), achieved TFLOP/s and model FLOPs
   utilization (MFU)
8. attention through the fused `scaled_dot_product_attention` kernels versus its math kernel
9. checkpoint saves: the loop's step time while a save is written (in the background, and
   blocking) against a step without one
10. generation with a key/value cache versus recomputing the window for every token (a
    language model; a model without `new_cache` is skipped)
11. training-image augmentation: the loader's samples/s with crop-flip, TrivialAugment and
    random erasing, as a share of the same loader without them (an image task)

The table is printed, the numbers go to `<out>/benchmark.json`, and a chart to
`<out>/benchmark.png` when matplotlib is installed (`pip install '.[plot]'`). `--quick` takes
seconds and is for tests and smoke checks; drop it for numbers worth acting on. Timings share
the machine with everything else that runs: close other heavy programs first.
"""

from __future__ import annotations

from .cli import SCHEMA_VERSION, SECTIONS, main

__all__ = ["SCHEMA_VERSION", "SECTIONS", "main"]
