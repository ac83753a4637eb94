"""Train a model: `python -m <package>.train --help`.

(Minimal first version: the full loop with checkpoints, AMP and torchrun lands next.)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import utils
from .config import Config, parse_config
from .data import build_datasets
from .model import build_model


def train(config: Config) -> dict[str, float]:
    device = utils.resolve_device(config.device)
    generator = utils.seed_everything(config.seed, config.deterministic)
    train_set, val_set, info = build_datasets(config)
    workers = utils.resolve_num_workers(config.num_workers, in_memory=info.in_memory)
    train_loader = utils.build_dataloader(
        train_set, batch_size=config.batch_size, train=True, num_workers=workers,
        generator=generator, device=device,
    )
    val_loader = utils.build_dataloader(
        val_set, batch_size=config.batch_size, train=False, num_workers=workers, device=device
    )
    model = build_model(
        config.model, in_channels=info.in_channels, image_size=info.image_size,
        num_classes=info.num_classes, width=config.width, dropout=config.dropout,
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    result: dict[str, float] = {}
    for epoch in range(config.epochs):
        model.train()
        loss_sum = torch.zeros((), device=device)
        steps = 0
        for inputs, targets in train_loader:
            inputs, targets = utils.to_device((inputs, targets), device)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            utils.clip_gradients(model.parameters(), config.grad_clip)
            optimizer.step()
            loss_sum += loss.detach()
            steps += 1
        correct = total = 0
        with utils.evaluation_mode(model):
            for inputs, targets in val_loader:
                inputs, targets = utils.to_device((inputs, targets), device)
                correct += int((model(inputs).argmax(1) == targets).sum())
                total += targets.numel()
        result = {"epoch": epoch, "train_loss": float(loss_sum) / max(steps, 1),
                  "val_acc": correct / max(total, 1)}
        print(f"epoch {epoch}: train loss {result['train_loss']:.4f}  val acc {result['val_acc']:.3f}")
    return result


def main(argv: list[str] | None = None) -> int:
    config, _ = parse_config(argv, description="Train the model.")
    train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
