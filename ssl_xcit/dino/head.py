"""DINO projection head: MLP -> 256-d bottleneck -> L2 normalisation -> last linear layer.

The last layer is DINO's and DINOv2's weight-normalised linear layer (``last_layer="weight_norm"``, state keys
``last_layer.weight_g``, ``last_layer.weight_v`` as in the official DINO checkpoints) or DINOv3's plain trainable
``nn.Linear`` without bias (``last_layer="linear"``, key ``last_layer.weight``, trunc-normal 0.02 like the MLP:
dinov3/layers/dino_head.py). Either way the state keys match the reference's, so heads load from and save to
the reference formats unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

LAST_LAYERS = ("weight_norm", "linear")


class WeightNormLinear(nn.Module):
    """A bias-free linear layer ``y = x (g * v / ||v||)^T`` with the norm taken over each output row.

    Same maths and parameter names as ``torch.nn.utils.weight_norm(nn.Linear(...))`` (the reference), written
    out as plain parameters because (a) the legacy hook-based function is deprecated, (b) its replacement
    ``torch.nn.utils.parametrizations.weight_norm`` renames the state keys to ``parametrizations.weight.*``
    and would break loading official checkpoints, and (c) plain parameters survive ``deepcopy``, DDP and
    ``torch.compile`` without forward pre-hooks. ``tests/dino/test_head.py`` checks equality with the legacy
    function.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        # v keeps nn.Linear's default (kaiming-uniform) init, as in the reference, where the head's
        # trunc-normal init runs before the last layer is built.
        v = nn.Linear(in_features, out_features, bias=False).weight.detach().clone()
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))
        self.weight_v = nn.Parameter(v)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_v * (self.weight_g / self.weight_v.norm(dim=1, keepdim=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.weight_v.shape[1]}, out_features={self.weight_v.shape[0]}"


class DINOHead(nn.Module):
    """Projection head of DINO.

    Args:
        in_dim: backbone embedding size.
        out_dim: number of prototypes K (65536 on ImageNet; a few thousand for small datasets).
        use_bn: BatchNorm after each hidden Linear (off in the reference ViT/XCiT recipes).
        norm_last_layer: fix ``weight_g`` to 1 and freeze it, i.e. a cosine-similarity last layer. More
            stable; the XCiT-S and ViT-S recipes turn it off for a little more accuracy. Applies to the
            weight-normalised last layer only (a plain layer has no norm to fix).
        nlayers: MLP depth (>= 1); the last MLP layer maps to the bottleneck with no activation.
        hidden_dim: width of the hidden MLP layers.
        bottleneck_dim: size of the L2-normalised embedding fed to the last layer.
        last_layer: ``weight_norm`` (DINO, DINOv2) or ``linear`` (DINOv3: a plain trainable layer).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        use_bn: bool = False,
        norm_last_layer: bool = True,
        nlayers: int = 3,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        last_layer: Literal["weight_norm", "linear"] = "weight_norm",
    ) -> None:
        super().__init__()
        if last_layer not in LAST_LAYERS:
            raise ValueError(f"last_layer must be one of {', '.join(LAST_LAYERS)}, got {last_layer!r}")
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp: nn.Module = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers: list[nn.Module] = [nn.Linear(in_dim, hidden_dim)]
            if use_bn:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.GELU())
            for _ in range(nlayers - 2):
                layers.append(nn.Linear(hidden_dim, hidden_dim))
                if use_bn:
                    layers.append(nn.BatchNorm1d(hidden_dim))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.last_layer: nn.Module
        if last_layer == "linear":
            # DINOv3 builds the plain layer with the MLP and initialises all of them trunc-normal 0.02.
            self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
            self.apply(self._init_weights)
        else:
            self.apply(self._init_weights)
            self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
            if norm_last_layer:
                self.last_layer.weight_g.requires_grad = False

    @property
    def out_dim(self) -> int:
        """The number of prototypes K (rows of the last layer, whichever its kind)."""
        return int(getattr(self.last_layer, "weight_v", self.last_layer.weight).shape[0])

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)
