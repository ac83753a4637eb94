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

    # GradScaler (fp16) hands this optimizer its found-inf flag instead of reading it: without
    # this, `scaler.step` calls `.item()` on it, a blocking host sync per step on a GPU.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One step of each: Muon on the matrices, AdamW on the rest. Under fp16 GradScaler
        sets `found_inf` (and `grad_scale` when the gradients are still scaled): a step with
        an overflow changes nothing, decided on the device."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is not None:  # scaler.step without scaler.unscale_ before it
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch._foreach_mul_(grads, grad_scale.double().reciprocal().float())
        if self.muon is not None:
            step_unless(self.muon, found_inf)
        if self.adamw is None:
            return
        if found_inf is not None and self.adamw.defaults.get("fused"):
            self.adamw.found_inf = found_inf  # type: ignore[attr-defined]  # its kernel skips
            try:
                self.adamw.step()
            finally:
                del self.adamw.found_inf  # type: ignore[attr-defined]
        else:  # unfused (the CPU): put back on the device where found_inf is set
            step_unless(self.adamw, found_inf)


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` attribute (GradScaler's contract),
    skipping its whole update on the device where it is set: torch's fused optimizers (their
    kernels leave weights, moments and step counts as they were) and MuonAdamW."""
    if isinstance(optimizer, MuonAdamW):
        return True
    fused = type(optimizer).__module__.startswith("torch.optim") and optimizer.defaults.get("fused")
    return bool(fused and getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """`optimizer.step()`, undone on the device where `found_inf` is set: the parameters and
    the state tensors are copied before and put back after (a transient copy of Muon's
    matrices and momenta at each step that has a flag: fp16's, or the non-finite guard's in
    one process, loop._update). A momentum made by a skipped first step stays zero, which is
    what a missing one means."""
    if found_inf is None:
        optimizer.step()
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    weights = [p.detach().clone() for p in params]
    states = {
        id(value): value.clone()
        for p in params
        for value in optimizer.state.get(p, {}).values()
        if isinstance(value, torch.Tensor)
    }
    optimizer.step()
    skip = found_inf.to(torch.bool)
    for p, old in zip(params, weights, strict=True):
        p.detach().copy_(torch.where(skip, old, p.detach()))
        for value in optimizer.state[p].values():
            if isinstance(value, torch.Tensor):
                saved = states.get(id(value))
                value.copy_(torch.where(skip, saved if saved is not None else 0, value))
