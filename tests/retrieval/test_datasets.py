"""Benchmark loaders, ground-truth validation and the image scaling convention."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
from PIL import Image

from ssl_xcit.retrieval.datasets import (
    ImageList,
    check_files_exist,
    list_images,
    load_dataset,
    load_holidays,
    load_json_benchmark,
    load_resized,
    load_revisited_gnd,
    load_rotations,
    load_ukbench,
    target_size,
)


def test_target_size_rounds_each_side_to_nearest_patch_multiple():
    # 1000x700 at R=768: 768 x 537.6 -> 537.6 / 16 = 33.6 -> 34 patches = 544.
    assert target_size(1000, 700, 768 / 1000, 16) == (768, 544)
    assert target_size(1000, 10, 0.5, 16) == (496, 16)  # never below one patch (500/16 = 31.25 -> 31)
    assert target_size(640, 480, 1.2, 8) == (768, 576)


def test_load_image_resizes_longer_side(tmp_path):
    Image.new("RGB", (1000, 700), "red").save(tmp_path / "a.png")
    assert load_resized(tmp_path / "a.png", 768, 16).size == (768, 544)
    assert load_resized(tmp_path / "a.png", 224, 16).size == (224, 160)  # 156.8 -> 9.8 -> 10 patches


def test_query_crop_keeps_scale_of_full_image_and_content(tmp_path):
    im = Image.new("RGB", (1000, 800), "black")
    im.paste((0, 255, 0), (100, 100, 600, 400))
    im.save(tmp_path / "q.png")
    out = load_resized(tmp_path / "q.png", 500, 16, bbx=(100.0, 100.0, 600.0, 400.0))
    # Full image -> longer side 500 is a 0.5 scale; the 500x300 crop becomes 250x150 -> 256x144.
    assert out.size == (256, 144)
    pixels = np.asarray(out).reshape(-1, 3)
    assert np.abs(pixels - [0, 255, 0]).max() <= 2


def test_exif_orientation_is_honoured(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.new("RGB", (400, 200), "blue").save(tmp_path / "e.jpg", exif=exif)
    assert load_resized(tmp_path / "e.jpg", 128, 16).size == (64, 128)
    assert load_resized(tmp_path / "e.jpg", 128, 16, exif_transpose=False).size == (128, 64)


def test_holidays_mini_groups_draft_decode_and_rotation(shared_data, tmp_path):
    root = shared_data / "retrieval_mini" / "holidays"
    ds = load_holidays(root)
    assert [p.name for p in ds.database] == ["100000.jpg", "100001.jpg", "100002.jpg"]
    assert [p.name for p in ds.queries] == ["100000.jpg"]
    assert ds.query_db_index == [0] and ds.gnd[0]["ok"].tolist() == [1, 2]
    # 3264x2448 photos, decoded through JPEG draft: 100000 is stored 2448x3264 (portrait).
    assert load_resized(ds.database[0], 768, 16).size == (576, 768)
    assert load_resized(ds.database[2], 768, 16).size == (768, 576)
    rot = tmp_path / "rotations.txt"
    rot.write_text("# upright corrections\n100000 90\n")
    rotated = load_holidays(root, rotations=rot)
    assert rotated.rotations == {"100000": 90}
    x, _ = ImageList(rotated.database, 768, 16, rotations=rotated.rotations)[0]
    assert tuple(x.shape) == (3, 576, 768)


def test_rotation_list_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("100000 45\n")
    with pytest.raises(ValueError, match="bad.txt:1: expected 'name angle' with angle a multiple of 90"):
        load_rotations(bad)
    with pytest.raises(FileNotFoundError, match="rotation list not found"):
        load_rotations(tmp_path / "nope.txt")


def test_holidays_group_without_query_is_an_error(tmp_path, shared_data):
    shutil.copy(shared_data / "retrieval_mini" / "holidays" / "100001.jpg", tmp_path / "100001.jpg")
    with pytest.raises(ValueError, match=r"groups \[1000\] have no query"):
        load_holidays(tmp_path)


def test_ukbench_groups(shared_data):
    ds = load_ukbench(shared_data / "retrieval_mini" / "ukbench")
    assert ds.groups == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert ds.gnd[0]["ok"].tolist() == [1, 2, 3] and ds.gnd[9]["ok"].tolist() == [8]
    assert ds.query_db_index == list(range(10))


def test_real_revisited_gnd_loads_and_missing_images_are_listed(shared_data, tmp_path):
    gnd = shared_data / "revisitop" / "gnd_roxford5k.pkl"
    cfg = load_revisited_gnd(gnd)
    assert len(cfg["imlist"]) == 4993 and len(cfg["qimlist"]) == 70
    assert cfg["gnd"][0]["bbx"] == pytest.approx((136.5, 34.1, 648.5, 955.7))
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("roxford5k", tmp_path, gnd_path=gnd)
    message = str(err.value)
    assert "5063 of 5063 roxford5k image files are missing" in message
    assert "... and 5053 more" in message and "ashmolean_000283.jpg" not in message.split("more")[1]


def _write_gnd(path, cfg):
    with open(path, "wb") as handle:
        pickle.dump(cfg, handle)
    return path


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"imlist": ["a"], "qimlist": ["q"]}, r"missing keys \['gnd'\]"),
        ({"imlist": ["a"], "qimlist": ["q"], "gnd": []}, "gnd has 0 entries but qimlist has 1"),
        (
            {
                "imlist": ["a"],
                "qimlist": ["q"],
                "gnd": [{"bbx": [0, 0, 5, 5], "easy": [3], "hard": [], "junk": []}],
            },
            r"gnd\[0\]\['easy'\] has indices \[3\] outside the database range \[0, 1\)",
        ),
        (
            {"imlist": ["a"], "qimlist": ["q"], "gnd": [{"bbx": [0, 0, 5, 5], "easy": [0], "junk": []}]},
            r"gnd\[0\] \(query 'q'\) lacks keys \['hard'\]",
        ),
        (
            {
                "imlist": ["a"],
                "qimlist": ["q"],
                "gnd": [{"bbx": [5, 0, 1, 5], "easy": [0], "hard": [], "junk": []}],
            },
            r"bbx'\] must be \[x1, y1, x2, y2\]",
        ),
        ([1, 2], "expected a dict"),
    ],
)
def test_malformed_revisited_gnd(tmp_path, cfg, match):
    with pytest.raises(ValueError, match="malformed ground truth in .*" + match):
        load_revisited_gnd(_write_gnd(tmp_path / "gnd_x.pkl", cfg))


def test_not_a_pickle_is_malformed(tmp_path):
    (tmp_path / "gnd.pkl").write_text("hello")
    with pytest.raises(ValueError, match="not a readable pickle"):
        load_revisited_gnd(tmp_path / "gnd.pkl")


class _CreatesAFile:
    """Unpickling calls ``open(target, "w")``: what a malicious ground-truth file could run."""

    def __init__(self, target) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_ground_truth_pickle_naming_a_global_is_refused_before_it_runs(tmp_path):
    target = tmp_path / "created_by_unpickling"
    cfg = {"imlist": ["a"], "qimlist": ["q"], "gnd": [_CreatesAFile(target)]}
    gnd = _write_gnd(tmp_path / "gnd_evil.pkl", cfg)
    with pytest.raises(ValueError) as err:
        load_revisited_gnd(gnd)
    assert not target.exists()
    message = str(err.value)
    assert "\n" not in message and str(gnd) in message and "refused global io.open" in message


def test_real_revisited_gnd_files_hold_no_global(shared_data):
    for name, n_db in (("roxford5k", 4993), ("rparis6k", 6322)):
        cfg = load_revisited_gnd(shared_data / "revisitop" / f"gnd_{name}.pkl")
        assert len(cfg["imlist"]) == n_db and len(cfg["qimlist"]) == 70


def test_json_benchmark_resolves_paths_names_and_query_in_database(shared_data, tmp_path):
    uk = shared_data / "retrieval_mini" / "ukbench"
    spec = {
        "root": str(uk),
        "database": [f"ukbench0000{i}.jpg" for i in range(4)],
        "queries": ["ukbench00000.jpg", {"path": "ukbench00001.jpg", "bbx": [10, 10, 300, 200]}],
        "positives": [[1, 2, 3], ["ukbench00000.jpg", 2]],
        "junk": [[], [3]],
    }
    (tmp_path / "b.json").write_text(json.dumps(spec))
    ds = load_json_benchmark(tmp_path / "b.json")
    assert ds.query_db_index == [0, 1]
    assert ds.gnd[1]["ok"].tolist() == [0, 2] and ds.gnd[1]["junk"].tolist() == [3]
    assert ds.query_bbx == [None, (10.0, 10.0, 300.0, 200.0)]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"positives": None}, r"missing keys \['positives'\]"),
        ({"positives": [[0]]}, r"'positives' must be a list with one list per query \(2\), got 1"),
        (
            {"positives": [[0], ["nope.jpg"]]},
            r"positives\[1\] names 'nope.jpg', which is not in the database",
        ),
        ({"positives": [[0], [7]]}, r"positives\[1\] has indices \[7\] outside the database range"),
        ({"queries": ["a.jpg", {"bbx": [0, 0, 1, 1]}]}, r"queries\[1\] is an object without 'path'"),
    ],
)
def test_malformed_json_benchmark(tmp_path, change, match):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.jpg")
    spec = {"database": ["a.jpg", "a.jpg"], "queries": ["a.jpg", "a.jpg"], "positives": [[0], [1]]}
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    (tmp_path / "b.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="malformed ground truth in .*b.json: " + match):
        load_json_benchmark(tmp_path / "b.json")


def test_ukbench_style_json_with_query_among_its_positives_is_rejected(shared_data, tmp_path):
    # UKBench groups written naively: every image is a query and a database image, and its group (itself
    # included) is its positives. Before the check the pipeline made the query junk too, and AP was inf.
    uk = shared_data / "retrieval_mini" / "ukbench"
    names = [f"ukbench0000{i}.jpg" for i in range(8)]
    groups = [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    spec = {"root": str(uk), "database": names, "queries": names, "positives": groups}
    (tmp_path / "uk.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"positives\[0\] lists query 0 itself \(database index 0\)"):
        load_json_benchmark(tmp_path / "uk.json")
    spec["positives"] = [[j for j in g if j != i] for i, g in enumerate(groups)]
    (tmp_path / "uk.json").write_text(json.dumps(spec))
    ds = load_json_benchmark(tmp_path / "uk.json")
    assert ds.gnd[5]["ok"].tolist() == [4, 6, 7] and ds.query_db_index == list(range(8))


def test_json_positive_that_is_also_junk_is_rejected(tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.jpg")
    Image.new("RGB", (32, 32)).save(tmp_path / "b.jpg")
    spec = {"database": ["a.jpg", "b.jpg"], "queries": ["q.jpg"], "positives": [[0, 1]], "junk": [[1]]}
    Image.new("RGB", (32, 32)).save(tmp_path / "q.jpg")
    (tmp_path / "b.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"positives\[0\] and junk\[0\] share database indices \[1\]"):
        load_json_benchmark(tmp_path / "b.json")


def test_missing_image_is_listed(tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.jpg")
    spec = {"database": ["a.jpg", "gone.jpg"], "queries": ["a.jpg"], "positives": [[1]]}
    (tmp_path / "b.json").write_text(json.dumps(spec))
    with pytest.raises(FileNotFoundError, match=r"1 of 2 benchmark image files are missing:\n  .*gone.jpg"):
        load_json_benchmark(tmp_path / "b.json")


def test_check_files_exist_lists_first_ten_and_count(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        check_files_exist([tmp_path / f"{i}.jpg" for i in range(25)], "test")
    assert "25 of 25 test files are missing" in str(err.value)
    assert "9.jpg" in str(err.value) and "10.jpg" not in str(err.value) and "and 15 more" in str(err.value)


def test_corrupt_image_names_the_file(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="cannot read image .*bad.jpg"):
        load_resized(tmp_path / "bad.jpg", 128, 16)


def test_unknown_dataset_and_training_set_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown retrieval dataset 'oxford'; valid: roxford5k"):
        load_dataset("oxford", tmp_path)
    with pytest.raises(FileNotFoundError, match="no images"):
        list_images(tmp_path)
    (tmp_path / "list.txt").write_text("missing.jpg\n")
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        list_images(tmp_path / "list.txt")
