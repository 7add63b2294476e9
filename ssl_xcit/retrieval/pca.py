"""PCA and PCA-whitening learnt on an independent image set, followed by L2 normalisation.

``faiss.PCAMatrix`` computes the same map: its ``eigen_power`` (= ``-whiten_power``) and ``epsilon`` shrink the
whitening exactly as here (``tests/retrieval/test_vlad.py`` checks that the two agree). This torch version is
kept because it accumulates the covariance in float64 chunks straight from the float16 descriptor cache:
faiss needs the whole training set as one contiguous float32 array (1M x 384 descriptors: a 1.5 GB copy), and
here the floor is relative to the largest eigenvalue, so it does not depend on the descriptors' scale. A full
``-0.5`` power blows up the near-zero eigenvalues that a few hundred training images leave; shrinkage is what
HOW and DINO's copy detection use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssl_xcit.errors import UserError


@dataclass
class PCA:
    """``y = L2(((x - mean) @ components.T) * (eigenvalues + eps) ** -whiten_power)``.

    ``whiten_power`` 0 is plain PCA (a rotation + truncation), 0.5 is full whitening, values in between shrink
    the whitening.
    """

    mean: torch.Tensor  # (d,)
    components: torch.Tensor  # (d_out, d), rows sorted by decreasing eigenvalue
    eigenvalues: torch.Tensor  # (d_out,)
    whiten_power: float = 0.0
    eps: float = 1e-6

    @classmethod
    def fit(cls, x: torch.Tensor, dim: int, whiten_power: float = 0.0, chunk: int = 65536) -> PCA:
        """Learn the projection to ``dim`` dimensions from the rows of ``x`` (n, d)."""
        n, d = x.shape
        if dim > d:
            raise UserError(
                f"PCA to {dim} dimensions is impossible for {d}-dimensional descriptors (use <= {d})"
            )
        if n <= dim:
            raise UserError(
                f"PCA to {dim} dimensions needs more than {dim} training vectors, got {n}: "
                "add training images or lower the PCA dimension"
            )
        mean = x.double().mean(0)
        cov = torch.zeros(d, d, dtype=torch.float64)
        # Chunked float64 accumulation: a million 384-d descriptors never materialise as one float64 copy.
        for start in range(0, n, chunk):
            xc = x[start : start + chunk].double() - mean
            cov += xc.T @ xc
        cov /= n - 1
        eigenvalues, vectors = torch.linalg.eigh(cov)
        order = torch.argsort(eigenvalues, descending=True)[:dim]
        return cls(
            mean=mean.float(),
            components=vectors[:, order].T.contiguous().float(),
            eigenvalues=eigenvalues[order].clamp_min(0).float(),
            whiten_power=whiten_power,
        )

    @property
    def dim(self) -> int:
        return self.components.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.float() - self.mean) @ self.components.T
        if self.whiten_power:
            y = y * (self.eigenvalues + self.eps * self.eigenvalues.max()).pow(-self.whiten_power)
        return F.normalize(y, dim=-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "mean": self.mean,
            "components": self.components,
            "eigenvalues": self.eigenvalues,
            "whiten_power": torch.tensor(self.whiten_power),
            "eps": torch.tensor(self.eps),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> PCA:
        return cls(
            mean=state["mean"],
            components=state["components"],
            eigenvalues=state["eigenvalues"],
            whiten_power=float(state["whiten_power"]),
            eps=float(state["eps"]),
        )
