"""``DINODataModule``: multi-crop training batches, plus the labelled sets the online k-NN callback needs.

A training batch is ``[crops, labels, indices]``: ``crops`` is a list of ``2 + local_crops_number`` float
tensors, the two global crops (B, 3, G, G) first, then the local ones (B, 3, L, L); ``labels`` is -1 for
unlabelled data; for a model that anchors, ``{"crops": [...], "gram_crops": [...]}`` (``use_gram_crops``).
Items whose file cannot be decoded are dropped from their batch (so a batch can be smaller than ``batch_size``;
``None`` if every item failed). The number of skipped files is available as ``num_skipped`` (it counts files
flagged by any DataLoader worker, see ``ssl_xcit.data.image_dataset``) and is
logged as ``data/skipped_images`` by the ``SkippedImagesLogger`` callback and summarised at ``teardown``.

A prepared dataset (``ssl-xcit prepare``: LitData shards, a folder or an ``s3://`` / ``gs://`` URL) trains
through LitData's streaming loader instead (``ssl_xcit.data.streaming``), which Lightning checkpoints too.

On folders the training loader is ``ssl_xcit.data.resumable``'s: a ``DistributedSampler`` of its own (with the trainer's
world size and rank, so Lightning keeps it under DDP) in torchdata's ``StatefulDataLoader``, which Lightning
checkpoints, so a run resumed from a mid-epoch checkpoint finishes that epoch in the same order, every image
once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from ssl_xcit.data.callbacks import SkippedImagesLogger
from ssl_xcit.data.crops import gram_crop_side
from ssl_xcit.data.datamodule_device import DeviceAugmentHooks
from ssl_xcit.data.datasets import ImageDataset, open_folders
from ssl_xcit.data.device_augment import PhotometricAugment
from ssl_xcit.data.device_crops import DECODE_ON, CropReader
from ssl_xcit.data.knn_data import aligned_val, knn_sets
from ssl_xcit.data.loaders import build_loader, check_full_batches
from ssl_xcit.data.shards import is_shard_root, is_url
from ssl_xcit.data.stages import MixedCropsView, check_high_res, in_high_res_stage, stage_crops
from ssl_xcit.data.storage import storage_options as parse_storage_options
from ssl_xcit.data.streaming import ShardTrainSet, dataset_view, open_shards
from ssl_xcit.data.synthetic import ensure_synthetic_dataset
from ssl_xcit.data.transforms import MultiCropTransform, eval_transform
from ssl_xcit.errors import UserError

# SkippedImagesLogger lived here; importing it from this module still works.
__all__ = ["AUGMENT_ON", "DINODataModule", "SkippedImagesLogger"]

AUGMENT_ON = ("auto", "cpu", "device")


def _pair_stage(k: int) -> str:
    """The name of the high-resolution stage's ``k``-th (global, local) pair among the datamodule's stages."""
    return "high_res" if k == 0 else f"high_res/{k}"


class DINODataModule(DeviceAugmentHooks, L.LightningDataModule):
    """Images for DINO pretraining, from a folder, an ImageFolder tree or a list file (or the built-in set).

    Args:
        root: Training images: an ImageFolder tree (class subfolders give labels), any folder of images (searched
            recursively, unlabelled), a .txt file listing image paths (optional label column), or a dataset
            prepared by ``ssl-xcit prepare`` (a folder or URL; docs/cluster.md). None uses the built-in synthetic
            shapes (train split), generated on first use with no download.
        val_root: Labelled images for the online k-NN monitor (queries; the bank is the labelled training set);
            any of the forms of ``root``.
            With the built-in data it defaults to the synthetic val split.
        val_fraction: If > 0 (and ``root`` is not a prepared dataset), hold out this fraction of every class
            (deterministic stratified split; of all images when unlabelled) as the k-NN queries and the
            label-free monitor's images (``heldout_dataset``); those images are then not trained on.
        split_seed: Seed of the ``val_fraction`` split (and of the ``knn_bank_limit`` subsample).
        labelled: None detects labels from the layout; False ignores them (e.g. ImageFolder of unrelated
            groups); True requires them.
        batch_size: Images per device per step (DINO: 64 per GPU, the LR scales with the total batch / 256).
        num_workers: DataLoader worker processes per device (DINO: 10). Decoding + 10 crops per image is
            CPU-heavy: see ``benchmarks/bench_dataloading.py`` for images/s per worker.
        pin_memory: Page-locked host batches for faster GPU copies (ignored without CUDA).
        persistent_workers: Keep workers alive across epochs (only with num_workers > 0); saves their start-up.
        global_crops_size: Side of the 2 global crops (DINO: 224).
        global_crops_scale: Area range of the global crops (DINO: (0.4, 1); its XCiT configs used (0.3, 1)).
        local_crops_number: Number of local crops (DINO: 8; 0 disables multi-crop).
        local_crops_size: Side of the local crops (DINO: 96).
        local_crops_scale: Area range of the local crops (DINO: (0.05, 0.4)).
        global_blur_probs: Gaussian-blur probability of global crops 1 and 2 (DINO: 1.0 and 0.1).
        local_blur_prob: Gaussian-blur probability of each local crop (DINO: 0.5).
        global_solarize_probs: Solarize probability of global crops 1 and 2 (DINO: 0 and 0.2).
        local_solarize_prob: Solarize probability of each local crop (DINO: 0).
        eval_resize: Short side the k-NN images are resized to (DINO eval: 256).
        eval_crop: Center crop of the k-NN images (DINO eval: 224; keep it a multiple of the patch size).
        verify_images: Decode every training image at setup to find unreadable files before training (seconds
            for thousands of images; leave off for ImageNet, where they are found lazily in the first epoch).
        color_jitter: Brightness, contrast, saturation and hue strengths of the colour jitter (DINO: 0.4, 0.4,
            0.2, 0.1). Raise them when colour is a shortcut: on data whose colours say nothing about content
            (the built-in shapes) views can otherwise be matched by colour alone.
        color_jitter_prob: Probability of applying the colour jitter (DINO: 0.8).
        grayscale_prob: Probability of converting a crop to grayscale (DINO: 0.2).
        blur_radius: Range of the Gaussian blur's sigma in pixels of the crop (DINO: 0.1 to 2.0 for 224-px
            crops). On small crops the same sigma blurs away far more of the image: scale it with the crop
            (x 64/224 for 64-px crops).
        knn_bank_limit: Keep at most this many bank images (deterministic stratified subsample) so the online
            k-NN stays cheap on large labelled sets; None keeps all.
        augment_on: Where the photometric augmentation (colour jitter, grayscale, blur, solarise, normalise)
            runs. ``device``: workers only read each file, draw its crop boxes and flips and (see ``decode_on``)
            decode it; the random resized crops, flips and the photometric half then run batched on the
            training device after the transfer, with per-sample parameters from the same distributions
            (``ssl_xcit.data.device_crops``); the workers then deliver several times the images/s (measured in
            docs/input-pipeline.md). ``cpu``: DINO's whole PIL augmentation in
            the workers, as the reference does. ``auto`` (default) is ``device`` when the trainer runs on an
            accelerator and ``cpu`` when it trains on the CPU: there the "device" is the training process
            itself, so moving the work out of the parallel workers into it measured slower per step.
        decode_on: With ``augment_on=device``, where JPEGs are decoded. ``worker`` (default): in the DataLoader
            workers (libjpeg-turbo, or a reduced-scale PIL decode when every crop allows it). ``device``:
            workers send the file bytes and the training process decodes each batch in one batched call (nvJPEG
            on a GPU); files it may refuse (not a baseline RGB/grey JPEG, or EXIF-rotated) are decoded in the
            workers and counted (``data/cpu_decoded_images``). ``device`` measured 4.5x to 6.9x ``worker``'s images/s
            per worker at 640 x 480 (docs/input-pipeline.md), but moves the decode into the training process and decodes
            large photos at full size (8 GB of float per 64 8-MP photos); ``worker`` is the default because it
            has been measured end to end (no GPU decode has been timed yet) and keeps memory bounded.
        storage_options: For ``s3://`` roots: boto3 client settings such as ``{"endpoint_url":
            "http://minio:9000"}`` (an S3-compatible store), passed to LitData; default: the environment's
            (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...). See docs/cluster.md.
        high_res_epochs: the last this many epochs are a high-resolution stage, as DINOv3's high-resolution
            adaptation (``ssl_xcit.data.stages``); 0 (default) for none.
        high_res_crops_size: ``[global, local]`` crop sides of that stage (DINOv3: 512-768 and 112-336 px), or a
            list of such pairs, one of which crops each batch (DINOv3's mix; folders and list files only).
        high_res_crops_ratios: with a list of pairs, the share of batches of each (DINOv3: 0.3, 0.3, 0.3, 0.05,
            0.05); normalised to sum 1.
    """

    def __init__(
        self,
        root: str | None = None,
        val_root: str | None = None,
        val_fraction: float = 0.0,
        split_seed: int = 0,
        labelled: bool | None = None,
        batch_size: int = 64,
        num_workers: int = 8,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        global_crops_size: int = 224,
        global_crops_scale: tuple[float, float] = (0.4, 1.0),
        local_crops_number: int = 8,
        local_crops_size: int = 96,
        local_crops_scale: tuple[float, float] = (0.05, 0.4),
        global_blur_probs: tuple[float, float] = (1.0, 0.1),
        local_blur_prob: float = 0.5,
        global_solarize_probs: tuple[float, float] = (0.0, 0.2),
        local_solarize_prob: float = 0.0,
        color_jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1),
        color_jitter_prob: float = 0.8,
        grayscale_prob: float = 0.2,
        blur_radius: tuple[float, float] = (0.1, 2.0),
        eval_resize: int = 256,
        eval_crop: int = 224,
        verify_images: bool = False,
        knn_bank_limit: int | None = None,
        augment_on: Literal["auto", "cpu", "device"] = "auto",
        decode_on: Literal["worker", "device"] = "worker",
        storage_options: dict[str, Any] | None = None,
        high_res_epochs: int = 0,
        high_res_crops_size: tuple[int, int] | list[tuple[int, int]] | None = None,
        high_res_crops_ratios: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        storage_options = parse_storage_options(storage_options)  # a bad key fails here, in one line
        # Fail at construction (before a Trainer exists) on anything checkable without reading the data.
        for name, path in (("root", root), ("val_root", val_root)):
            if path is not None and not is_url(path) and not Path(path).expanduser().exists():
                raise FileNotFoundError(
                    f"data.{name} {path} does not exist; expected an image folder, an ImageFolder tree or a .txt "
                    "list file"
                    + (" (omit data.root to use the built-in synthetic dataset)" if name == "root" else "")
                )
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        if val_fraction > 0 and val_root is not None:
            raise UserError("give either val_root or val_fraction > 0 for the k-NN val set, not both")
        if batch_size < 1 or num_workers < 0:
            raise UserError(f"need batch_size >= 1 and num_workers >= 0, got {batch_size} and {num_workers}")
        if knn_bank_limit is not None and knn_bank_limit < 1:
            raise UserError(f"knn_bank_limit must be >= 1 or None, got {knn_bank_limit!r}")
        if augment_on not in AUGMENT_ON:
            raise UserError(
                f"augment_on must be 'auto', 'cpu' (PIL augmentation in the workers) or 'device' (photometric "
                f"part batched on the training device), got {augment_on!r}"
            )
        if decode_on not in DECODE_ON:
            raise UserError(
                f"decode_on must be 'worker' (decode in the DataLoader workers) or 'device' (one batched decode "
                f"on the training device), got {decode_on!r}"
            )
        # The crops of each stage (ssl_xcit.data.stages): the run's sizes, and the high-resolution stage's.
        self.high_res = check_high_res(high_res_epochs, high_res_crops_size, high_res_crops_ratios)
        self._stages = {"base": stage_crops(self.hparams, global_crops_size, local_crops_size)}
        for k, sizes in enumerate(self.high_res.sizes if self.high_res is not None else ()):
            self._stages[_pair_stage(k)] = stage_crops(self.hparams, *sizes)  # "high_res": the first pair
        self.decode_fallbacks = 0  # files decode_on=device left to the workers (this process's batches)
        self.photometric = PhotometricAugment(
            color_jitter=color_jitter,
            color_jitter_prob=color_jitter_prob,
            grayscale_prob=grayscale_prob,
            global_blur_probs=global_blur_probs,
            local_blur_prob=local_blur_prob,
            global_solarize_probs=global_solarize_probs,
            local_solarize_prob=local_solarize_prob,
            blur_radius=blur_radius,
        )
        self.augment_on: str = "cpu" if augment_on == "auto" else augment_on  # "auto" is resolved in setup()
        self.train_dataset: ImageDataset | None = None
        self._use_stage("base")
        # The device augmentation draws each batch from a generator seeded by (run seed, rank, stream, epoch,
        # batch index), see batch_rng. The run seed is read once and kept in the checkpoint.
        self._augment_seed: int | None = None
        self._other_batches = 0
        self.eval_transform = eval_transform(eval_resize, eval_crop)
        self.val_dataset: ImageDataset | None = None  # labelled k-NN queries (no transform), or None
        self._heldout: ImageDataset | None = None  # the val images, labelled or not (no transform)
        self._val_crops: ImageDataset | None = None  # the val images with the multi-crop transform
        self.knn_unavailable_reason: str | None = None
        self._knn: tuple[ImageDataset, ImageDataset] | None = None

    def _use_augment_on(self, where: str) -> None:
        self.augment_on = where
        self.train_transform: MultiCropTransform | CropReader = (
            self.reader if where == "device" else self.cpu_transform
        )
        self.device_augment: PhotometricAugment | None = self.photometric if where == "device" else None
        if self.train_dataset is not None:  # a loader built from now on crops with it
            # LitData's StreamingDataset applies its own `transform` to the raw record: ours is `item_transform`
            name = "item_transform" if isinstance(self.train_dataset, ShardTrainSet) else "transform"
            setattr(self.train_dataset, name, self.train_transform)

    def _use_stage(self, name: str) -> None:
        """Crop with stage ``name``'s crops (``base`` or ``high_res``) from the next loader on."""
        crops = self._stages[name]
        self.stage, self.cpu_transform, self.geometry, self.reader = (
            name,
            crops.cpu,
            crops.geometry,
            crops.reader,
        )
        self.crop_config: dict[str, Any] = crops.cpu.config  # every crop setting, resolved (both modes)
        self._use_augment_on(self.augment_on)

    def resolve_augment_on(self) -> str:
        """``augment_on`` with ``auto`` resolved: ``device`` when the trainer runs on an accelerator, else ``cpu``."""
        if self.hparams.augment_on != "auto":
            return self.hparams.augment_on
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        device = getattr(strategy, "root_device", None)
        return "device" if device is not None and device.type != "cpu" else "cpu"

    @property
    def num_crops(self) -> int:
        return self.train_transform.num_crops

    # ----------------------------------------------------------------------------------------------- setup
    def prepare_data(self) -> None:
        # Runs once per node before setup(): generate the built-in set here so ranks do not race for it.
        if self.hparams.root is None:
            ensure_synthetic_dataset()

    def use_gram_crops(self, scale: float | None) -> None:
        """Cut the Gram teacher's 2 crops into every batch (None: not): each global crop's box and flip at ``scale``
        x its side, undistorted. ``setup`` reads ``scale`` from the trainer's model (its ``gram_crops_scale``).
        Every stage gets them, at ``scale`` x that stage's own global side (the high-resolution stage's pairs too,
        each at its own: 1.5 gives DINOv3's 768 and 1152 px for 512 and 768)."""
        for crops in self._stages.values():
            size = None if scale is None else gram_crop_side(crops.geometry.global_crops_size, scale)
            crops.cpu.gram_crops_size = crops.geometry.gram_crops_size = size

    def setup(self, stage: str | None = None) -> None:
        model = getattr(self.trainer, "lightning_module", None)  # before the loaders copy the transforms
        self.use_gram_crops(getattr(model, "gram_crops_scale", None))
        if self.train_dataset is not None:
            return
        if self.high_res is not None and self.trainer is not None:
            in_high_res_stage(
                0, self.trainer.max_epochs, self.hparams.high_res_epochs
            )  # refuses bad settings
            self.trainer.reload_dataloaders_every_n_epochs = (
                1  # a stage's loader is built when its epoch starts
            )
        self._use_augment_on(self.resolve_augment_on())
        hp = self.hparams
        val_root = hp.val_root
        if hp.root is None:
            synthetic = ensure_synthetic_dataset()
            train_root = synthetic / "train"
            if val_root is None and hp.val_fraction == 0:
                val_root = str(synthetic / "val")
        elif is_shard_root(hp.root):
            return self._setup_shards()
        else:
            train_root = Path(hp.root).expanduser()
        self.train_dataset, val_set = open_folders(
            train_root, val_root, hp.val_fraction, hp.labelled, hp.split_seed, self.train_transform
        )
        classes, self._heldout = self.train_dataset.classes, val_set
        self._check_batches(train_root)
        self.val_dataset, self.knn_unavailable_reason = aligned_val(val_set, classes, val_root)
        if hp.verify_images:
            bad = self.train_dataset.verify()
            rank_zero_info(
                f"verify_images: {bad} of {len(self.train_dataset)} training images are unreadable"
            )
        kind = f"{len(classes)} classes" if classes is not None else "unlabelled"
        unreadable = self.train_dataset.num_skipped if hp.verify_images else 0
        if unreadable:  # they stay in the index (skipped when drawn); the count says what trains
            kind += f"; {unreadable} unreadable skipped"
        self._report(len(self.train_dataset) - unreadable, kind, train_root)

    def _setup_shards(self) -> None:
        """``root`` is a prepared dataset: LitData's streaming training set (``ssl_xcit.data.streaming``)."""
        hp = self.hparams
        if self.high_res is not None and len(self.high_res.sizes) > 1:
            raise UserError(
                f"high_res_crops_size gives {len(self.high_res.sizes)} (global, local) pairs, which needs a folder "
                f"or list-file root (LitData's loader draws its own batches); {hp.root} is a prepared dataset: "
                "give one pair"
            )
        self.train_dataset, val_set = open_shards(
            hp.root,
            hp.val_root,
            hp.val_fraction,
            hp.labelled,
            hp.verify_images,
            self.train_transform,
            hp.storage_options,
        )
        classes, self._heldout = self.train_dataset.classes, val_set
        self._check_batches(hp.root)
        self.val_dataset, self.knn_unavailable_reason = aligned_val(val_set, classes, hp.val_root)
        kind = f"{len(classes)} classes" if classes else "unlabelled"
        self._report(self.train_dataset.num_records, f"{kind}, prepared", hp.root)

    def _report(self, images: int, kind: str, train_root: Any) -> None:
        knn = (
            f"k-NN monitor: {len(self.val_dataset)} labelled queries"
            if self.val_dataset is not None
            else f"k-NN monitor off: {self.knn_unavailable_reason}"
        )
        rank_zero_info(f"DINO data: {images} training images ({kind}) from {train_root}; {knn}")

    def _check_batches(self, train_root: Any) -> None:
        world = self.trainer.world_size if self.trainer is not None else 1
        check_full_batches(self.train_dataset, self.hparams.batch_size, world, train_root)

    # ---------------------------------------------------------------------------------------------- loaders
    def _loader(
        self, dataset: ImageDataset, batch_size: int, train: bool, persistent_workers: bool | None = None
    ) -> DataLoader:
        hp = self.hparams
        return build_loader(
            dataset,
            batch_size,
            train,
            self.trainer,
            num_workers=hp.num_workers,
            pin_memory=hp.pin_memory,
            persistent_workers=hp.persistent_workers if persistent_workers is None else persistent_workers,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled multi-crop batches, ``drop_last=True`` (DINO's centre and BN want full batches), from a
        loader Lightning saves and resumes mid-epoch (``ssl_xcit.data.resumable``)."""
        if self.train_dataset is None:
            self.setup("fit")
        high = False
        if self.high_res is not None:  # the epoch alone decides: the same stage on every rank and on resume
            trainer = self.trainer
            high = in_high_res_stage(trainer.current_epoch, trainer.max_epochs, self.hparams.high_res_epochs)
            self._use_stage("high_res" if high else "base")
        if high and len(self.high_res.sizes) > 1:  # one (global, local) pair per batch (ssl_xcit.data.stages)
            device = self.augment_on == "device"
            transforms = [
                self._stages[_pair_stage(k)].reader if device else self._stages[_pair_stage(k)].cpu
                for k in range(len(self.high_res.sizes))
            ]
            hp = self.hparams
            return build_loader(
                MixedCropsView(self.train_dataset, transforms),
                hp.batch_size,
                True,
                self.trainer,
                num_workers=hp.num_workers,
                pin_memory=hp.pin_memory,
                persistent_workers=hp.persistent_workers,
                batch_pairs=self.high_res.pairs,
            )
        return self._loader(self.train_dataset, self.hparams.batch_size, train=True)

    def val_dataloader(self) -> DataLoader | list:
        """Multi-crop batches of the labelled val set, in order, for the DINO loss on held-out images.

        ``[]`` (no validation loop) when there is no val set; the online k-NN monitor does not need this loader.
        """
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        if self._val_crops is None:
            self._val_crops = dataset_view(self.val_dataset, self.train_transform)
        return self._loader(self._val_crops, self.hparams.batch_size, train=False, persistent_workers=False)

    def knn_datasets(self) -> tuple[ImageDataset, ImageDataset] | None:
        """``(bank, queries)`` with the eval transform, or None (see ``knn_unavailable_reason``) without labels.

        The bank is the labelled training images (minus a held-out ``val_fraction``, limited to
        ``knn_bank_limit``); the queries are the val set. Both share the training class list.
        """
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return None
        if self._knn is None:
            hp = self.hparams
            self._knn = knn_sets(
                self.train_dataset, self.val_dataset, self.eval_transform, hp.knn_bank_limit, hp.split_seed
            )
        return self._knn

    def heldout_dataset(self) -> ImageDataset | None:
        """The held-out images (``val_root`` or the ``val_fraction`` split), labelled or not, with the eval
        transform, for the label-free monitor (``ssl_xcit.trainer.rankme``); None without a val set."""
        if self.train_dataset is None:
            self.setup("validate")
        return None if self._heldout is None else dataset_view(self._heldout, self.eval_transform)

    # ------------------------------------------------------------------------------------------ bookkeeping
    @property
    def num_skipped(self) -> int:
        """Distinct unreadable files met so far in this process's training and k-NN datasets."""
        datasets = [self.train_dataset, self._val_crops, *(self._knn or ())]
        return sum(d.num_skipped for d in datasets if d is not None)

    def teardown(self, stage: str | None = None) -> None:
        if self.num_skipped:
            paths = [
                p
                for d in [self.train_dataset, *(self._knn or ())]
                if d is not None
                for p in d.skipped_paths()
            ]
            rank_zero_warn(
                f"{self.num_skipped} unreadable image(s) were skipped on this rank, e.g. "
                + ", ".join(str(p) for p in paths[:5])
            )
