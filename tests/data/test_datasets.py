from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ssl_xcit.data.datasets import (
    IMG_EXTENSIONS,
    ImageDataset,
    UnreadableImageWarning,
    build_dataset,
    collate_skip_none,
    load_image,
)
from ssl_xcit.data.transforms import eval_transform


def write_image(path: Path, size=(8, 8), colour=(10, 20, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".bmp": "BMP", ".webp": "WEBP", ".ppm": "PPM"}
    fmt.update({".tif": "TIFF", ".tiff": "TIFF"})
    Image.new("RGB", size, colour).save(path, format=fmt[path.suffix.lower()])
    return path


def write_truncated_jpeg(path: Path) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path, format="JPEG", quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_imagefolder_layout_is_labelled(tmp_path):
    write_image(tmp_path / "dog" / "a.jpg")
    write_image(tmp_path / "dog" / "nested" / "b.PNG")  # upper-case extension, deeper folder: still "dog"
    write_image(tmp_path / "cat" / "c.jpeg")
    write_image(tmp_path / "cat" / ".hidden.jpg")
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / "empty_class").mkdir()
    ds = build_dataset(tmp_path)
    assert ds.classes == ["cat", "dog"] and ds.labelled
    assert [(p.relative_to(tmp_path).as_posix(), y) for p, y in ds.samples] == [
        ("cat/c.jpeg", 0),
        ("dog/a.jpg", 1),
        ("dog/nested/b.PNG", 1),
    ]
    image, label, index = ds[2]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and (label, index) == (1, 2)


def test_every_extension_is_accepted(tmp_path):
    for i, ext in enumerate(IMG_EXTENSIONS):
        write_image(tmp_path / f"img{i}{ext.upper() if i % 2 else ext}")
    ds = build_dataset(tmp_path)
    assert len(ds) == len(IMG_EXTENSIONS) == 8 and not ds.labelled
    assert all(ds[i] is not None for i in range(len(ds)))


def test_loose_images_make_the_folder_unlabelled(tmp_path):
    write_image(tmp_path / "top.jpg")
    write_image(tmp_path / "a" / "x.jpg")
    write_image(tmp_path / "a" / "b" / "y.png")
    ds = build_dataset(tmp_path)
    assert ds.classes is None and len(ds) == 3 and set(ds.targets) == {-1}
    assert ds[0][1] == -1


def test_labels_can_be_forced_off_or_required(tmp_path):
    write_image(tmp_path / "tree" / "a" / "x.jpg")
    write_image(tmp_path / "tree" / "b" / "y.jpg")
    forced = build_dataset(tmp_path / "tree", labelled=False)
    assert forced.classes is None and forced.targets == [-1, -1]
    write_image(tmp_path / "flat" / "z.jpg")
    with pytest.raises(ValueError, match="not an ImageFolder tree"):
        build_dataset(tmp_path / "flat", labelled=True)


def test_list_file_without_and_with_labels(tmp_path):
    for name in ("a.jpg", "sub/b.png", "c d.jpg"):
        write_image(tmp_path / "imgs" / name)
    plain = tmp_path / "plain.txt"
    plain.write_text("# comment\nimgs/a.jpg\n\nimgs/sub/b.png\nimgs/c d.jpg\n")
    ds = build_dataset(plain)
    assert ds.classes is None and len(ds) == 3 and ds[2] is not None  # the path with a space is one path

    ints = tmp_path / "ints.txt"
    absolute = (tmp_path / "imgs/sub/b.png").as_posix()  # absolute paths work too
    ints.write_text(f"imgs/a.jpg 2\n{absolute} 0\n")
    ds = build_dataset(ints)
    assert ds.classes == ["0", "1", "2"] and ds.targets == [2, 0]

    names = tmp_path / "names.txt"
    names.write_text("imgs/a.jpg zebra\nimgs/sub/b.png ant\n")
    ds = build_dataset(names)
    assert ds.classes == ["ant", "zebra"] and ds.targets == [1, 0]
    assert build_dataset(names, labelled=False).classes is None


def test_list_file_errors(tmp_path):
    write_image(tmp_path / "a.jpg")
    missing = tmp_path / "missing.txt"
    missing.write_text("a.jpg\nnope1.jpg\nnope2.jpg\n")
    with pytest.raises(FileNotFoundError, match=r"2 of 3 listed files do not exist.*nope1\.jpg.*nope2\.jpg"):
        build_dataset(missing)
    mixed = tmp_path / "mixed.txt"
    write_image(tmp_path / "b.jpg")
    mixed.write_text("a.jpg 0\nb.jpg\n")
    with pytest.raises(ValueError, match="mixes lines"):
        build_dataset(mixed)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="names no images"):
        build_dataset(empty)


def test_bad_roots_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        build_dataset(tmp_path / "does_not_exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.* is empty"):
        build_dataset(tmp_path / "empty")
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "readme.md").write_text("hi")
    (tmp_path / "docs" / "sub" / "data.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"no images found in .*docs.*\.jpg, \.jpeg, \.png"):
        build_dataset(tmp_path / "docs")
    write_image(tmp_path / "single.jpg")
    with pytest.raises(ValueError, match="single image"):
        build_dataset(tmp_path / "single.jpg")


def corrupt_folder(root: Path) -> Path:
    write_image(root / "good1.png")
    write_image(root / "good2.png", colour=(200, 0, 0))
    (root / "text.jpg").write_text("this is not a JPEG")
    write_truncated_jpeg(root / "truncated.jpg")
    return root


def test_corrupt_and_truncated_images_are_skipped_with_one_warning_each(tmp_path):
    ds = build_dataset(corrupt_folder(tmp_path), transform=eval_transform(8, 8))
    names = [p.name for p, _ in ds.samples]
    assert names == ["good1.png", "good2.png", "text.jpg", "truncated.jpg"]
    with pytest.warns(UnreadableImageWarning) as record:
        items = [ds[i] for i in range(len(ds))]
    assert [str(w.message).split(":")[0] for w in record] == [
        f"skipping unreadable image {tmp_path / 'text.jpg'}",
        f"skipping unreadable image {tmp_path / 'truncated.jpg'}",
    ]
    assert items[2] is None and items[3] is None and items[0][0].shape == (3, 8, 8)
    assert ds.num_skipped == 2 and [p.name for p in ds.skipped_paths()] == ["text.jpg", "truncated.jpg"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second epoch neither decodes nor warns again
        assert ds[2] is None and ds[3] is None
    batch = collate_skip_none(items)
    images, labels, indices = batch
    assert images.shape == (2, 3, 8, 8) and indices.tolist() == [0, 1] and labels.tolist() == [-1, -1]
    assert collate_skip_none([None, None]) is None


def test_skipped_count_reaches_the_main_process_from_workers(tmp_path):
    ds = build_dataset(corrupt_folder(tmp_path), transform=eval_transform(8, 8))
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=collate_skip_none)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = list(loader)
    assert sum(len(b[2]) for b in batches if b is not None) == 2
    assert ds.num_skipped == 2  # flagged in the worker process, visible here


def test_verify_flags_bad_files_before_training(tmp_path):
    ds = build_dataset(corrupt_folder(tmp_path))
    with pytest.warns(UnreadableImageWarning):
        assert ds.verify(num_threads=2) == 2
    assert ds[0] is not None and ds[2] is None


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (8, 4), (0, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    image.save(tmp_path / "rotated.jpg", exif=exif.tobytes())
    assert load_image(tmp_path / "rotated.jpg").size == (4, 8)


def test_image_dataset_checks_labels_and_subsets(tmp_path):
    a = write_image(tmp_path / "a.png")
    with pytest.raises(ValueError, match="outside 0..0"):
        ImageDataset([(a, 3)], ["only"])
    ds = ImageDataset([(a, 0), (a, 0)], ["only"], transform=eval_transform(8, 8))
    sub = ds.subset([1])
    assert len(sub) == 1 and sub.classes == ["only"] and sub[0][0].shape == (3, 8, 8)
    assert isinstance(ds.subset([0], transform=None)[0][0], Image.Image)


def test_flowers5(shared_data):
    ds = build_dataset(shared_data / "flowers5")
    assert len(ds) == 4317
    assert ds.classes == ["daisy", "dandelion", "rose", "sunflower", "tulip"]
    counts = torch.bincount(torch.tensor(ds.targets)).tolist()
    assert counts == [764, 1052, 784, 733, 984]
    image, label, _ = ds[0]
    assert image.size == (128, 128) and label == 0
