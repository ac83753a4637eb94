"""Your additions to the template's training loop, called at fixed points. This file is yours.

A template release never rewrites it, and the template's code (training/task.py, training/loop.py)
calls what you register here where it says, so you change the loss, the optimizer or a metric
without editing the template's code, and your change never conflicts with the template's.
Register with the slots (slots.py shows each with an example; docs/template.md's "Where to
change what" says which to use):

    from . import slots

    @slots.training_loss             # or @slots.loss; @slots.optimizer, @slots.schedule("name"),
    def focal(logits, targets, step):  # @slots.batch_transform("name"), @slots.train_metric,
        ...                          # @slots.val_metric, @slots.set_metric(finish),
                                     # @slots.callback("after_step"), @slots.state("name")

`extra_metrics` below is the older way to add a per-sample validation metric; it still works.
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
