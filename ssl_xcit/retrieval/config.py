"""The settings of one retrieval run (the CLI flags map one to one onto :class:`RetrievalConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ssl_xcit.errors import UserError

METHODS = ("cls", "vlad", "asmk")
# Which patch tokens VLAD and ASMK describe an image with: ``last_block``, the backbone's
# ``forward_patch_tokens`` (XCiT: after the last XCA block, before class attention, as in XCiT's appendix D.3);
# ``final_norm``, the patch tokens after class attention and the final norm, which iBOT's patch head trains.
# The two are the same tokens for ViT and CaiT.
LOCAL_TOKENS = ("last_block", "final_norm")
DEFAULT_K = {"vlad": 256, "asmk": 1024}


@dataclass
class RetrievalConfig:
    """Settings of one run; the CLI flags map one to one onto these fields."""

    dataset: str
    data_root: str
    method: str = "cls"
    weights: str | None = None
    arch: str | None = None
    resolution: int = 768
    codebook_size: int | None = None
    train_images: str | None = None
    max_train_images: int | None = None
    max_local: int | None = 1000
    local_tokens: str = "last_block"
    local_dim: int = 128
    local_whiten: float = 0.0
    multiscale: bool = False
    whiten: bool = False
    pca_dim: int = 128
    crop_queries: bool = True
    gnd: str | None = None
    rotations: str | None = None
    vlad_power: float = 0.5
    vlad_intra_norm: bool = True
    asmk_binary: bool = True
    asmk_alpha: float = 3.0
    asmk_threshold: float = 0.0
    asmk_ma_query: int = 5
    asmk_ma_db: int = 1
    asmk_idf: bool = False
    kmeans_iters: int = 20
    max_train_descriptors: int = 1_000_000
    seed: int = 0
    cache_dir: str | None = None
    no_cache: bool = False
    device: str = "cpu"
    num_workers: int = 0
    threads: int | None = None
    output: str | None = None
    progress: bool = False

    def validate(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown retrieval method {self.method!r}; valid: {', '.join(METHODS)}")
        if self.resolution < 16:
            raise UserError(f"resolution must be at least one patch (>= 16 px), got {self.resolution}")
        if self.local_tokens not in LOCAL_TOKENS:
            raise UserError(f"unknown local_tokens {self.local_tokens!r}; valid: {', '.join(LOCAL_TOKENS)}")
        if self.max_local is not None and self.max_local < 1:
            raise UserError(f"max_local must be >= 1 (or None for all tokens), got {self.max_local}")
        if self.method in ("vlad", "asmk") and self.train_images is None:
            raise UserError(
                f"--method {self.method} learns PCA and a codebook: give --train-images (a folder or .txt list of "
                "images independent of the benchmark), or --train-images database to learn on the database itself "
                "(not independent; results are then optimistic)"
            )
        if self.method == "cls" and self.whiten and self.train_images is None:
            raise UserError("--whiten learns PCA-whitening: give --train-images (or 'database')")
