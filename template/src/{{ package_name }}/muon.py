"""`--matrix-optimizer muon`: Muon on the hidden weight matrices, AdamW on the other parameters.

Muon (Keller Jordan, 2024; PyTorch's own `torch.optim.Muon`) replaces each matrix's update by
its momentum made orthogonal (a few Newton-Schulz iterations), so every direction of the
matrix moves by the same amount instead of the few that dominate the gradient. It is meant
for the 2-D weights inside the network: embeddings, the output layer, biases, norms and
convolution kernels stay with AdamW. Both run as one optimizer (`MuonAdamW`): one set of
parameter groups for the schedule, gradient scaling and clipping, one state dict in the
checkpoints, so a resumed run continues both exactly.

`adjust_lr_fn="match_rms_adamw"` scales Muon's step to AdamW's typical size (0.2 times the
square root of the larger side, as in Moonshot AI's "Muon is scalable", 2025), so `--lr`,
`--weight-decay` and the schedule mean the same for both halves and no second learning rate
is needed. Which matrices (`hidden_matrices`): the weight of every `nn.Linear` but the output
layer (the model's last Linear), the input layer (its first, unless an embedding or a
convolution reads the input) and any tied to an `nn.Embedding`. Newton-Schulz needs each
matrix whole, so Muon does not run with `--parallel fsdp` (config_checks refuses it).
Measured on the language model's `configs/cpu-30min.toml` in docs/language-model.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def hidden_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The weights Muon updates: every `nn.Linear`'s but the output layer's (the last
    Linear) and the input layer's (the first Linear, where no `nn.Embedding` or convolution
    comes before it in `model.modules()`), and none shared with an `nn.Embedding` (a tied
    output layer)."""
    linears: list[nn.Linear] = []
    input_side: set[int] = set()  # embeddings, convolutions, and a plain stack's first Linear
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            input_side.add(id(module.weight))
        elif isinstance(module, nn.Linear):
            if not linears and not input_side:  # the first layer: it reads the raw input
                input_side.add(id(module.weight))
            linears.append(module)
    chosen = [m.weight for m in linears[:-1] if id(m.weight) not in input_side]
    return list({id(p): p for p in chosen if p.ndim == 2}.values())  # a shared one once


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` on `matrices`, `torch.optim.AdamW` on the rest, behind one set of
    param groups. Each of `groups` (slots.param_groups' or yours: `params` plus settings such
    as `lr` and `weight_decay`) is split in two, a Muon group and an AdamW group with the same
    settings; groups left empty are dropped. The optimizer's `param_groups` and `state` are
    the two inner optimizers' own objects, so the scheduler, `state_dict()` and
    `load_state_dict()` see and set both."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        matrices: list[torch.Tensor],
        lr: float,
        weight_decay: float,
        fused: bool = False,
    ):
        chosen = {id(p) for p in matrices}
        muon_groups, adamw_groups = [], []
        for group in groups:
            params = list(group["params"])
            settings = {key: value for key, value in group.items() if key != "params"}
            muon = [p for p in params if id(p) in chosen]
            rest = [p for p in params if id(p) not in chosen]
            if muon:
                muon_groups.append({**settings, "params": muon})
            if rest:
                adamw_groups.append({**settings, "params": rest})
        self.muon = (
            torch.optim.Muon(
                muon_groups, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
            )
            if muon_groups
            else None
        )
        self.adamw = (
            torch.optim.AdamW(adamw_groups, lr=lr, weight_decay=weight_decay, fused=fused)
            if adamw_groups
            else None
        )
        self._split = len(muon_groups)
        inner = [
            *(self.muon.param_groups if self.muon else []),
            *(self.adamw.param_groups if self.adamw else []),
        ]
        super().__init__(inner, {"lr": lr})
        self._share()

    def _share(self) -> None:
        """Point both inner optimizers at this one's groups and state (after a load, which
        replaces both)."""
        if self.muon is not None:
            self.muon.param_groups = self.param_groups[: self._split]
            self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = self.param_groups[self._split :]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One step of each: Muon on the matrices, AdamW on the rest."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        if self.muon is not None:
            self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
