"""Your additions to the template's training loop, called at fixed points. This file is yours.

A template release never rewrites it, and the template's code (training/task.py, training/loop.py)
calls each
function here where it says, so you add a metric without editing `evaluate()` and your change
never conflicts with the template's.
"""

from __future__ import annotations

import torch


def extra_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Your validation metrics, by name: for one batch, each metric's SUM over its samples.

    Called on every validation batch (no gradients) with float `logits` (N, C) and class
    indices `targets` (N,); for a language model, one row per token. Evaluation adds the sums
    up over the batches and the processes and divides them by the number of samples: each
    name becomes `val_<name>` in the epoch's record (metrics.jsonl, the tracker, checkpoints).
    For example, top-5 accuracy as `val_top5`:

        hits = (logits.topk(5, 1).indices == targets[:, None]).any(1)
        return {"top5": hits.sum()}
    """
    return {}
