"""PCA and PCA-whitening learnt on an independent image set, followed by L2 normalisation.

The decomposition is scikit-learn's ``PCA(svd_solver="covariance_eigh")`` on float64: the eigenvectors and
eigenvalues of the covariance, the computation this module did by hand before, now with sign-fixed components
(``tests/retrieval/test_vlad.py`` checks it against that computation and against ``faiss.PCAMatrix``). Measured
on 1M x 384 descriptors to 256 dimensions (1 thread, shared 2-core CPU, 2026-11-24): the hand-written version took
169 s and 2,932 MiB above the input (its float64 mean made a full float64 copy), scikit-learn on float64 155 s and
2,940 MiB. At 300k descriptors their largest relative eigenvalue errors against a float64 SVD were 6e-8 and
1e-14; scikit-learn on float32 (faiss also trains in float32) takes 3.9 s and 10 MiB at 1M, but its smallest
eigenvalues were off by 1.4e-3, and whitening divides by their roots.

The map itself stays here: scikit-learn's ``whiten=True`` is full whitening only, while retrieval shrinks it
(``whiten_power`` between 0 and 0.5) and floors the eigenvalues relative to the largest one, so it does not
depend on the descriptors' scale. A full ``-0.5`` power blows up the near-zero eigenvalues that a few hundred
training images leave; shrinkage is what HOW and DINO's copy detection use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssl_xcit.errors import UserError

# Part of the retrieval cache key of everything projected by a PCA: the sign-fixed components of scikit-learn
# differ from the hand-written version's, so codebooks learnt in the old projection are not reused.
FIT_VERSION = "sklearn-covariance_eigh-float64"


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
    def fit(cls, x: torch.Tensor, dim: int, whiten_power: float = 0.0) -> PCA:
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
        from sklearn.decomposition import PCA as SklearnPCA

        fitted = SklearnPCA(n_components=dim, svd_solver="covariance_eigh").fit(x.double().numpy())
        return cls(
            mean=torch.from_numpy(fitted.mean_).float(),
            components=torch.from_numpy(fitted.components_).float().contiguous(),
            eigenvalues=torch.from_numpy(fitted.explained_variance_).clamp_min(0).float(),
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
