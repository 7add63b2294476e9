"""Random resized crops and flips on the training device, with the JPEG decode in the workers or on the device.

With ``augment_on="device"`` a DataLoader worker does only what must happen per file (:class:`CropReader`):
it reads the bytes, draws the crop boxes and flips from the file header's size (``MultiCropGeometry.plan``:
torchvision ``RandomResizedCrop.get_params``'s rule, DINO's scales per crop kind, torch's RNG), and either

- ``decode_on="worker"``: decodes the image, at a reduced JPEG DCT scale (PIL ``draft``) when every crop of it
  still keeps at least its output size, otherwise with torchvision's libjpeg-turbo ``decode_jpeg`` (measured
  faster than PIL's full decode in ``benchmarks/bench_dataloading.py --compare-decoders``), with PIL as the
  fallback for other formats; or
- ``decode_on="device"``: keeps the file bytes, which the training process decodes for the whole batch in one
  ``torchvision.io.decode_jpeg(list, device=...)`` call (nvJPEG on a GPU, libjpeg-turbo on the CPU). Files the
  batched decoder may refuse or mis-orient (not a baseline RGB/grey JPEG, or EXIF-rotated) are decoded in the
  worker instead and counted. A file the device decoder still refuses costs only itself: the batch is decoded
  again image by image, and the refused files on the CPU (libjpeg-turbo, then PIL), counted with the others.

:func:`collate_crops` pads a batch's images to the largest one, repeating each image's last row and column into
its padding (so a box that touches the border samples the border, as on the unpadded image), and lays the boxes
out as ``roi_align`` rows. :func:`cut_crops` then cuts all crops of one output size in one
``torchvision.ops.roi_align(..., aligned=True, sampling_ratio=-1)`` call: pixel centres at +0.5 as PIL's
``resize(box=...)``, and ``ceil(box / output)`` samples averaged per output pixel, an anti-aliased downscale.
Padding rather than bucketing by size: roi_align's cost follows the output and the samples per bin, not the
input's size, so a padded batch costs one call per crop size and only the pad's memory.

torchvision's decoders are deprecated (0.29) in favour of TorchCodec's, which have the same batched CUDA call;
they are kept because TorchCodec would be a new dependency with the same libjpeg-turbo / nvJPEG underneath.

Every index and box is computed on the host and travels with the batch, so the device half never reads a device
value back (``tests/gpu``).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.ops import roi_align

from ssl_xcit.data.crops import _TRANSPOSED_ORIENTATIONS, Crop, MultiCropGeometry
from ssl_xcit.data.image_dataset import EmptyBatch
from ssl_xcit.errors import UserError

# Devices a copy to is left blocking, as Lightning's move_data_to_device does (MPS: pytorch issue 83015).
_BLOCKING_DEVICE_TYPES = ("cpu", "mps")

DECODE_ON = ("worker", "device")


class CropItem:
    """One image as a worker delivers it: decoded uint8 ``(3, h, w)`` pixels or ``encoded`` file bytes, with
    its crops' boxes ``(K, 4)`` (x1, y1, x2, y2 in the delivered pixels' coordinates), flips ``(K,)`` and output
    sides ``crop_sizes`` (K; None: the reader's)."""

    __slots__ = ("boxes", "crop_sizes", "data", "encoded", "flips", "fallback", "size")

    def __init__(
        self, data: torch.Tensor, boxes: np.ndarray, flips: np.ndarray, size: tuple[int, int], encoded: bool,
        fallback: bool = False, crop_sizes: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.data, self.boxes, self.flips, self.size = data, boxes, flips, size
        self.encoded, self.fallback, self.crop_sizes = encoded, fallback, crop_sizes


def _boxes(crops: Sequence[Crop], sx: float, sy: float) -> tuple[np.ndarray, np.ndarray]:
    boxes = np.array(
        [(c.left * sx, c.top * sy, (c.left + c.width) * sx, (c.top + c.height) * sy) for c in crops],
        dtype=np.float32,
    )
    return boxes, np.array([c.flip for c in crops], dtype=bool)


def _pil_decode(image: Image.Image, orientation: int) -> torch.Tensor:
    image.load()  # the full decode, so a truncated file raises here
    upright = ImageOps.exif_transpose(image) if orientation != 1 else image
    if upright.mode != "RGB":
        upright = upright.convert("RGB")
    return torch.from_numpy(np.asarray(upright).copy()).permute(2, 0, 1)


class CropReader:
    """The worker half of device crops: read a file, draw its crops, decode it (or keep its bytes).

    ``ImageDataset`` calls :meth:`read` for the file and the reader itself on the result (the identity).
    """

    def __init__(self, geometry: MultiCropGeometry, decode_on: str = "worker") -> None:
        if decode_on not in DECODE_ON:
            raise UserError(
                f"decode_on must be 'worker' (decode in the DataLoader workers) or 'device' (workers send the "
                f"file bytes, one batched decode on the training device), got {decode_on!r}"
            )
        self.geometry = geometry
        self.decode_on = decode_on

    @property
    def num_crops(self) -> int:
        return self.geometry.num_crops

    @property
    def sizes(self) -> list[int]:
        """Output side of each crop, in the batch's crop order (the Gram teacher's last)."""
        g = self.geometry
        gram = [g.gram_crops_size] * g.num_gram_crops  # the Gram teacher's, last (MultiCropGeometry.plan)
        return [g.global_crops_size] * 2 + [g.local_crops_size] * g.local_crops_number + gram

    def read(self, path: str | Path | bytes) -> CropItem:
        """Read a file, or take a shard record's encoded bytes (``ssl_xcit.data.streaming``)."""
        if isinstance(path, (bytes, bytearray, memoryview)):
            raw = bytearray(path)  # writable, as torch.frombuffer wants
        else:
            with open(
                path, "rb"
            ) as file:  # into a writable buffer: torch.frombuffer shares it without a copy
                raw = bytearray(os.fstat(file.fileno()).st_size)
                file.readinto(raw)
        with Image.open(io.BytesIO(raw)) as image:
            orientation = image.getexif().get(0x0112, 1)
            width, height = image.size
            if orientation in _TRANSPOSED_ORIENTATIONS:
                width, height = height, width
            crops = self.geometry.plan(width, height)
            sides = tuple(c.size for c in crops)  # travel with the batch: the stage's size mix varies them
            plain_jpeg = (
                image.format == "JPEG" and image.mode in ("RGB", "L") and not image.info.get("progressive")
            )
            if self.decode_on == "device" and plain_jpeg and orientation == 1:
                boxes, flips = _boxes(crops, 1.0, 1.0)
                data = torch.frombuffer(raw, dtype=torch.uint8)
                return CropItem(data, boxes, flips, (height, width), encoded=True, crop_sizes=sides)
            reduction = min(min(c.width, c.height) / c.size for c in crops)
            if self.geometry.draft and image.format == "JPEG" and reduction >= 2.0:
                # The largest DCT reduction at which every crop keeps at least its output size.
                raw_w, raw_h = image.size
                image.draft("RGB", (math.ceil(raw_w / reduction), math.ceil(raw_h / reduction)))
                pixels = _pil_decode(image, orientation)
            elif plain_jpeg:
                pixels = _fast_decode(raw, image, orientation)
            else:
                pixels = _pil_decode(image, orientation)
        h, w = pixels.shape[-2:]
        boxes, flips = _boxes(crops, w / width, h / height)
        fallback = self.decode_on == "device"
        return CropItem(pixels, boxes, flips, (h, w), encoded=False, fallback=fallback, crop_sizes=sides)

    def __call__(self, item: CropItem) -> CropItem:
        if not isinstance(item, CropItem):
            raise TypeError(f"CropReader works on the files it reads itself, got {type(item).__name__}")
        return item

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.geometry!r}, decode_on={self.decode_on!r})"


def _fast_decode(raw: bytearray, image: Image.Image, orientation: int) -> torch.Tensor:
    """libjpeg-turbo through torchvision; PIL when it refuses the file."""
    try:
        data = torch.frombuffer(raw, dtype=torch.uint8)
        return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=orientation != 1)
    except RuntimeError:
        return _pil_decode(image, orientation)


class CropBatch:
    """A collated batch of :class:`CropItem`: ``images`` (padded uint8 batch, or None when every image is still
    encoded), ``encoded`` (file bytes, kept on the CPU by :meth:`to`), ``rois`` ``(K * B, 5)`` in crop-major
    order, ``flips`` ``(K * B,)`` and the K output sides ``crop_sizes`` (None: the reader's). Image ``b`` of
    ``order`` is row ``b`` of the rois' batch index."""

    def __init__(
        self,
        images: torch.Tensor | None,
        encoded: list[torch.Tensor],
        sizes: list[tuple[int, int]],
        rois: torch.Tensor,
        flips: torch.Tensor,
        fallbacks: int,
        crop_sizes: tuple[int, ...] | None = None,
    ) -> None:
        self.images, self.encoded, self.sizes = images, encoded, sizes
        self.rois, self.flips, self.fallbacks = rois, flips, fallbacks
        self.crop_sizes = crop_sizes

    @property
    def batch_size(self) -> int:
        return len(self.sizes)

    def _map(self, fn: Any) -> CropBatch:
        images = fn(self.images) if self.images is not None else None
        return CropBatch(
            images, self.encoded, self.sizes, fn(self.rois), fn(self.flips), self.fallbacks, self.crop_sizes
        )

    def to(self, device: Any, *args: Any, non_blocking: bool | None = None, **kwargs: Any) -> CropBatch:
        """Move the pixels, boxes and flips; the file bytes stay on the CPU for the batched decoder.

        ``non_blocking`` defaults to True for an accelerator: Lightning's ``move_data_to_device`` passes it only
        to plain tensors, and without it each copy of this batch makes the host wait for the GPU's queue. Not to
        the CPU (a device-to-host copy read too early) nor MPS, the devices Lightning copies blocking too.
        """
        if non_blocking is None:
            non_blocking = torch.device(device).type not in _BLOCKING_DEVICE_TYPES
        return self._map(lambda t: t.to(device, *args, non_blocking=non_blocking, **kwargs))

    def pin_memory(self) -> CropBatch:
        """Page-locked pixels, boxes and flips (the DataLoader's pin thread calls this), the tensors :meth:`to`
        copies. The file bytes are not pinned: they are never copied by ``to``; the batched decoder reads them
        on the host and stages them in nvJPEG's own pinned buffers."""
        return self._map(lambda t: t.pin_memory())


def pad_into(out: torch.Tensor, index: int, image: torch.Tensor) -> None:
    """Copy ``image`` (3, h, w) into ``out[index]`` and repeat its last column and row into the padding."""
    h, w = image.shape[-2:]
    out[index, :, :h, :w] = image
    out[index, :, :h, w:] = out[index, :, :h, w - 1 : w]
    out[index, :, h:, :] = out[index, :, h - 1 : h, :]


def collate_crops(batch: list[Any]) -> Any:
    """Collate ``(CropItem, label, index)`` items, dropping ``None`` (unreadable); :class:`EmptyBatch` if none.

    Decoded images come first in the batch, then the encoded ones (decoded later, appended in that order).
    """
    items = [b for b in batch if b is not None]
    if not items:
        return EmptyBatch()
    items = [b for b in items if not b[0].encoded] + [b for b in items if b[0].encoded]
    decoded = [it for it, _, _ in items if not it.encoded]
    images = None
    if decoded:
        height = max(it.size[0] for it in decoded)
        width = max(it.size[1] for it in decoded)
        shape = (len(decoded), 3, height, width)
        images = torch.empty(0, dtype=torch.uint8)
        if get_worker_info() is not None:
            # Built in shared memory, as default_collate does in a worker: otherwise the batch is copied
            # there once more when it is sent to the training process.
            images.set_(torch.UntypedStorage._new_shared(math.prod(shape)), 0, shape)
        else:
            images.resize_(shape)
        for i, it in enumerate(decoded):
            pad_into(images, i, it.data)
    boxes = np.stack([it.boxes for it, _, _ in items], axis=1)  # (K, B, 4): crop-major
    k, n = boxes.shape[:2]
    rois = np.concatenate([np.tile(np.arange(n, dtype=np.float32), k)[:, None], boxes.reshape(k * n, 4)], 1)
    flips = np.stack([it.flips for it, _, _ in items], axis=1).reshape(-1)
    sides = {getattr(it, "crop_sizes", None) for it, _, _ in items}
    if len(sides) != 1:  # a sampler that mixes sizes gives every item of a batch one pair
        raise ValueError(f"a batch's images were cropped at different sizes: {sorted(map(str, sides))}")
    crop_batch = CropBatch(
        images,
        [it.data for it, _, _ in items if it.encoded],
        [it.size for it, _, _ in items],
        torch.from_numpy(rois),
        torch.from_numpy(flips),
        sum(it.fallback for it, _, _ in items),
        sides.pop(),
    )
    labels = torch.tensor([b[1] for b in items], dtype=torch.int64)
    indices = torch.tensor([b[2] for b in items], dtype=torch.int64)
    return [crop_batch, labels, indices]


def decode_batch(batch: CropBatch, device: torch.device) -> torch.Tensor:
    """The batch's padded uint8 images on ``device``, decoding its encoded files in one batched call. Files the
    device decoder refuses are decoded on the CPU and added to ``batch.fallbacks``; none ends the run."""
    if not batch.encoded:
        return batch.images
    if device.type == "cuda":
        decoded, refused = _decode_on_side_stream(batch.encoded, device)
    else:
        decoded, refused = _decode_on(batch.encoded, device)
    batch.fallbacks += refused
    height = max(h for h, _ in batch.sizes)
    width = max(w for _, w in batch.sizes)
    out = torch.empty((batch.batch_size, 3, height, width), dtype=torch.uint8, device=device)
    done = 0
    if batch.images is not None:
        done = batch.images.shape[0]
        h, w = batch.images.shape[-2:]
        # The worker padded by repetition, so repeating its padded edge extends each image's own edge.
        out[:done, :, :h, :w] = batch.images
        out[:done, :, :h, w:] = out[:done, :, :h, w - 1 : w]
        out[:done, :, h:, :] = out[:done, :, h - 1 : h, :]
    for i, image in enumerate(decoded):
        pad_into(out, done + i, image)
    return out


_SIDE_STREAMS: dict[Any, Any] = {}


def _decode_on_side_stream(
    encoded: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], int]:
    """:func:`_decode_on` on a stream of our own, ordered on the device after what the current stream queued.
    nvJPEG decodes on a private stream and was seen to overwrite memory the current stream was still reading
    (pytorch/vision PR 9606, meta-pytorch/torchcodec PR 1634). The decoder's outputs are allocated on the side
    stream, whose memory the current stream never used; the side stream waits for the current one with a
    device-side event wait instead of the host waiting for the whole stream, and the current stream waits for
    the decode the same way. ``record_stream`` keeps each image's memory until the current stream is done."""
    current = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        decoded, refused = _decode_on(encoded, device)
    current.wait_stream(side)
    for image in decoded:
        image.record_stream(current)
    return decoded, refused


def _decode_on(encoded: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], int]:
    """Decode ``encoded`` on ``device`` in one call; if the decoder refuses the batch (nvJPEG refuses a whole
    batched call for one file it cannot read), image by image, the refused ones on the CPU. Returns the
    images and how many were refused."""
    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device), 0
    except RuntimeError:
        pass
    images: list[torch.Tensor | None] = []
    on_cpu: dict[int, torch.Tensor] = {}
    for i, data in enumerate(encoded):
        try:
            images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            images.append(None)
            on_cpu[i] = _cpu_decode(data)
    # Copied after every device decode, so nothing the current stream queues overlaps nvJPEG's own stream.
    for i, pixels in on_cpu.items():
        images[i] = pixels.to(device, non_blocking=True)
    return images, len(on_cpu)


def _cpu_decode(data: torch.Tensor) -> torch.Tensor:
    """uint8 (3, h, w) RGB of a file the device refused: libjpeg-turbo, then PIL (which reads CMYK and other
    JPEGs libjpeg-turbo's RGB path refuses)."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB)
    except RuntimeError:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            return _pil_decode(image, 1)  # EXIF-rotated files never reach the device decoder


def cut_crops(images: torch.Tensor, rois: torch.Tensor, flips: torch.Tensor, sizes: Sequence[int]) -> list:
    """The crops of a batch: ``sizes[k]`` x ``sizes[k]`` uint8 ``(B, 3, s, s)`` per crop ``k``, one roi_align
    call per run of equal sizes, flipped where ``flips`` says, rounded to uint8 as PIL's resize does."""
    n = rois.shape[0] // len(sizes)
    source = images.float()
    out: list[torch.Tensor] = []
    start = 0
    while start < len(sizes):
        end = start + 1
        while end < len(sizes) and sizes[end] == sizes[start]:
            end += 1
        rows = slice(start * n, end * n)
        crops = roi_align(source, rois[rows], sizes[start], 1.0, -1, True)
        crops = torch.where(flips[rows].view(-1, 1, 1, 1), crops.flip(-1), crops)
        out += list(crops.round_().clamp_(0, 255).to(torch.uint8).split(n))
        start = end
    return out
