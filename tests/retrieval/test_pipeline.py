"""End to end on real photos (``retrieval_mini``: one Holidays group, UKBench groups) with a tiny random XCiT.

A random-init backbone is too weak for accuracy claims, so the assertions are exact protocol facts (the
Holidays group of three has mAP 1 once the query is excluded), oracle checks (a byte-identical copy of a
database image is retrieved first by every method), valid ranges, and the JSON/table content.
"""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch

from ssl_xcit.cli.retrieval import main
from ssl_xcit.evaluation.cache import load_cached
from ssl_xcit.models import create_model
from ssl_xcit.retrieval.pipeline import RetrievalConfig, format_table, run_retrieval

ARCH = "xcit_nano_12_p16"
RES = "128"
pytestmark = pytest.mark.filterwarnings("ignore:ASMK codebook k=", "ignore:k-means with k=")


@pytest.fixture(scope="module")
def setup(shared_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    torch.manual_seed(0)
    weights = root / "nano.pth"
    torch.save(create_model(ARCH).state_dict(), weights)
    mini = shared_data / "retrieval_mini"
    train = sorted((shared_data / "flowers5" / "daisy").glob("*.jpg"))[:8]
    (root / "train.txt").write_text("\n".join(map(str, train)) + "\n")
    # Holidays group + UKBench as one JSON benchmark; the last query is a byte-identical copy of ukbench00008
    # stored elsewhere (so it is NOT excluded as "the query itself"): every method must rank its original first.
    db = [mini / "holidays" / f"10000{i}.jpg" for i in range(3)] + [
        mini / "ukbench" / f"ukbench0000{i}.jpg" for i in range(10)
    ]
    shutil.copy(db[11], root / "copy_of_ukbench00008.jpg")
    spec = {
        "database": [str(p) for p in db],
        "queries": [str(db[0]), str(db[3]), str(db[7]), str(root / "copy_of_ukbench00008.jpg")],
        "positives": [[1, 2], [4, 5, 6], [8, 9, 10], [11]],
        "junk": [[], [], [], [12]],
    }
    (root / "mini.json").write_text(json.dumps(spec))
    return {
        "root": root,
        "weights": weights,
        "train": root / "train.txt",
        "mini": mini,
        "cache": root / "cache",
    }


def run_cli(setup, method, dataset="json", data_root=None, *extra):
    out = setup["root"] / f"{dataset}-{method}.json"
    # Query MA 1 (instead of 5) makes the identical-copy oracle a theorem for ASMK: the copy's aggregated
    # signatures equal the original's, the only way to reach the maximal normalised score 1. MA 5 is
    # exercised in test_asmk_index.py.
    if method == "asmk":
        extra = ("--asmk-ma-query", "1", *extra)
    argv = [
        "--weights",
        str(setup["weights"]),
        "--arch",
        ARCH,
        "--dataset",
        dataset,
        "--data-root",
        str(data_root or setup["root"] / "mini.json"),
        "--method",
        method,
        "--resolution",
        RES,
        "--train-images",
        str(setup["train"]),
        "--codebook-size",
        "16",
        "--local-dim",
        "32",
        "--cache-dir",
        str(setup["cache"]),
        "--output",
        str(out),
        *extra,
    ]
    return main(argv), json.loads(out.read_text())


@pytest.mark.parametrize("method", ["cls", "vlad", "asmk"])
def test_json_benchmark_end_to_end(setup, method, capsys):
    result, written = run_cli(setup, method)
    table = capsys.readouterr().out
    m = result["metrics"]
    assert result["n_database"] == 13 and result["n_queries"] == 4 and m["n_queries"] == 4
    assert 0.0 < m["mAP"] <= 1.0 and 0.0 <= m["mP@1"] <= 1.0
    # Oracle: the identical copy retrieves its original first (AP 1) whatever the random weights.
    assert m["aps"][3] == pytest.approx(1.0)
    assert result["top_ranks"][3][0] == 11
    # The query in the database is removed from its own ranking (Holidays style) ...
    assert result["top_ranks"][0][0] == 0  # ... although it is, of course, its own nearest neighbour.
    assert written["metrics"]["mAP"] == pytest.approx(m["mAP"]) and written["method"] == method
    name = {"cls": "CLS token", "vlad": "VLAD", "asmk": "ASMK"}[method]
    assert "Base model" in table and "mini mAP" in table and f"{100 * m['mAP']:.1f}" in table
    assert f"{ARCH}  {name}" in table
    if method == "cls":
        assert result["codebook_size"] is None and result["descriptor_dim"] == 128
    else:
        assert result["codebook_size"] == 16 and result["n_train_images"] == 8
        expected_dim = 16 * 32 if method == "vlad" else 32
        assert result["descriptor_dim"] == expected_dim
        # 128x96 UKBench / 96x128 Holidays at 128 px: 8 x 6 = 48 patch tokens, all kept (< max_local).
        assert result["local_descriptors_per_image"] == 48


def test_feature_cache_is_reused_and_keyed_on_settings(setup):
    first, _ = run_cli(setup, "cls")
    cfg = RetrievalConfig(
        "json",
        str(setup["root"] / "mini.json"),
        weights=str(setup["weights"]),
        arch=ARCH,
        resolution=int(RES),
        cache_dir=str(setup["cache"]),
    )
    again = run_retrieval(cfg)
    assert again["metrics"]["aps"] == first["metrics"]["aps"]
    assert again["timings"]["extract_s"] < 2.0  # served from the cache, no forward pass
    assert len(list(setup["cache"].glob("retrieval-cls-database-*.pt"))) == 1
    entry = next(setup["cache"].glob("retrieval-cls-database-*.pt"))
    assert "features" in torch.load(entry, weights_only=True)["tensors"]
    assert load_cached(setup["cache"], "retrieval-cls-database", {"other": "meta"}) is None


def test_live_model_gets_its_modes_back(setup):
    """A module in training (e.g. DINO's teacher mid-fit) is evaluated in eval mode and handed back unchanged."""
    torch.manual_seed(0)
    model = create_model(ARCH).train()
    model.cls_attn_blocks.eval()  # a mixed state must come back exactly
    before = {name: m.training for name, m in model.named_modules()}
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    cfg = RetrievalConfig("ukbench", str(setup["mini"] / "ukbench"), arch=ARCH, resolution=64, no_cache=True)
    run_retrieval(cfg, model=model)
    assert seen and not any(seen)
    assert {name: m.training for name, m in model.named_modules()} == before


class _Stop(Exception):
    """Raised from inside the first forward pass: the meta device holds no values to finish a run with."""


@pytest.mark.parametrize("method", ["cls", "vlad"])
def test_live_model_gets_its_device_back(setup, method):
    """The model runs on ``config.device`` (meta here; a GPU teacher evaluated on the CPU in use) and is handed
    back on its own device, with its own tensors, also when extraction stops with an error."""
    torch.manual_seed(0)
    model = create_model(ARCH).train()
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def stop(module, args):
        seen.append({t.device.type for t in [*model.parameters(), *model.buffers()]})
        raise _Stop

    model.patch_embed.register_forward_pre_hook(stop)
    cfg = RetrievalConfig(
        "ukbench",
        str(setup["mini"] / "ukbench"),
        method=method,
        weights=str(setup["weights"]),  # keys the run by file: the meta copy has no values to hash
        arch=ARCH,
        resolution=64,
        no_cache=True,
        device="meta",
        train_images=str(setup["train"]),
    )
    with pytest.raises(_Stop):
        run_retrieval(cfg, model=model)
    assert seen == [{"meta"}]  # extract_global (cls) or extract_local (vlad) ran on the requested device
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    for key, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, state[key]), key
    assert all(m.training for m in model.modules())


def test_ukbench_ns_score_and_self_retrieval(setup):
    result, _ = run_cli(setup, "cls", "ukbench", setup["mini"] / "ukbench")
    # Every image is its own nearest neighbour, so N-S >= 1 (the query counts in UKBench's top 4).
    assert [r[0] for r in result["top_ranks"]] == list(range(10))
    assert 1.0 <= result["metrics"]["N-S"] <= 4.0
    assert result["metrics"]["n_queries"] == 10


def test_holidays_group_mAP_is_one_with_query_excluded(setup):
    result, _ = run_cli(setup, "vlad", "holidays", setup["mini"] / "holidays", "--multiscale")
    # Two database images remain once the query is excluded, and both are positives.
    assert result["metrics"]["mAP"] == pytest.approx(1.0) and result["metrics"]["n_queries"] == 1
    assert "Holidays mAP" in result["table"] and "100.0" in result["table"]


def test_revisited_layout_with_bbx_crop_and_whitening(setup, shared_data):
    # A miniature R-Oxford-style benchmark (jpg/ + gnd pickle) built from the mini photos in a temporary folder.
    root = setup["root"] / "rmini"
    (root / "jpg").mkdir(parents=True)
    uk = setup["mini"] / "ukbench"
    for i in range(10):
        shutil.copy(uk / f"ukbench0000{i}.jpg", root / "jpg" / f"img{i}.jpg")
    gnd = {
        "imlist": [f"img{i}" for i in range(1, 8)] + ["img9"],
        "qimlist": ["img0", "img8"],
        "gnd": [
            {"bbx": [100.0, 80.0, 500.0, 400.0], "easy": [0, 1], "hard": [2], "junk": [3]},
            {"bbx": [0.0, 0.0, 640.0, 480.0], "easy": [], "hard": [7], "junk": []},
        ],
    }
    with open(root / "gnd_roxford5k.pkl", "wb") as handle:
        pickle.dump(gnd, handle)
    result, written = run_cli(setup, "cls", "roxford5k", root, "--whiten", "--pca-dim", "6")
    m = result["metrics"]
    assert set(m) == {"easy", "medium", "hard"}
    assert m["easy"]["n_queries"] == 1 and m["medium"]["n_queries"] == 2
    for protocol in m.values():
        assert 0 < protocol["mAP"] <= 1 and set(protocol) >= {"mP@1", "mP@5", "mP@10"}
    assert result["descriptor_dim"] == 6
    assert "R-Oxford5k Medium" in result["table"] and "R-Oxford5k Hard" in result["table"]
    assert written["metrics"]["easy"]["aps"][1] is None  # NaN (no easy positive) is written as null


def test_bad_inputs_are_clear_errors(setup, tmp_path):
    with pytest.raises(SystemExit):  # argparse lists the valid choices
        run_cli(setup, "gem")
    with pytest.raises(ValueError, match="unknown retrieval method 'gem'; valid: cls, vlad, asmk"):
        RetrievalConfig("json", "x.json", method="gem").validate()
    with pytest.raises(ValueError, match="--method vlad learns PCA and a codebook: give --train-images"):
        RetrievalConfig("json", "x.json", method="vlad").validate()
    # 8 training images (128x128 flowers) x 64 tokens = 512 descriptors < k = 1000.
    with pytest.raises(ValueError, match=r"codebook size k=1000 is larger than the 512 training descriptors"):
        run_cli(setup, "vlad", "json", None, "--codebook-size", "1000")
    spec = json.loads((setup["root"] / "mini.json").read_text())
    spec["database"][5] = str(tmp_path / "missing.jpg")
    (tmp_path / "bad.json").write_text(json.dumps(spec))
    with pytest.raises(
        FileNotFoundError, match=r"1 of 14 benchmark image files are missing:\n  .*missing.jpg"
    ):
        run_cli(setup, "cls", "json", tmp_path / "bad.json")
    (tmp_path / "gnd_rparis6k.pkl").write_bytes(pickle.dumps({"imlist": [], "qimlist": ["q"]}))
    with pytest.raises(ValueError, match=r"malformed ground truth .* missing keys \['gnd'\]"):
        run_cli(setup, "cls", "rparis6k", tmp_path)


def test_format_table_matches_table_d4_shape():
    rows = [
        {
            "arch": "xcit_small_12_p16",
            "method": m,
            "codebook_size": k,
            "resolution": 768,
            "protocol": "revisited",
            "dataset": "roxford5k",
            "metrics": {"medium": {"mAP": med}, "hard": {"mAP": hard}},
        }
        for m, k, med, hard in (
            ("cls", None, 0.301, 0.087),
            ("vlad", 256, 0.366, 0.116),
            ("asmk", 65536, 0.4, 0.15),
        )
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == [
        "Base",
        "model",
        "Method",
        "k",
        "Resolution",
        "R-Oxford5k",
        "Medium",
        "R-Oxford5k",
        "Hard",
    ]
    assert lines[2].split() == ["xcit_small_12_p16", "CLS", "token", "-", "768", "30.1", "8.7"]
    assert lines[4].split() == ["xcit_small_12_p16", "ASMK", "65536", "768", "40.0", "15.0"]
    assert np.isfinite(len(lines))


def test_eval_config_parses_and_flags_override_it():
    from pathlib import Path

    from ssl_xcit.cli.retrieval import parse_config

    config_file = Path(__file__).resolve().parents[2] / "eval" / "retrieval.yaml"
    cfg = parse_config(
        ["--config", str(config_file), "--weights", "w.pth", "--method", "asmk", "--resolution", "512"]
    )
    assert (cfg.method, cfg.resolution, cfg.weights) == ("asmk", 512, "w.pth")
    assert (cfg.max_local, cfg.local_dim, cfg.asmk_alpha, cfg.asmk_ma_query, cfg.codebook_size) == (
        1000,
        128,
        3.0,
        5,
        None,
    )
    cfg.train_images = "database"
    cfg.validate()


def test_config_file_errors(tmp_path):
    from ssl_xcit.cli.retrieval import parse_config

    (tmp_path / "c.yaml").write_text("dataset: holidays\ncodebook: 12\n")
    with pytest.raises(ValueError, match=r"unknown keys \['codebook'\] in .*c.yaml; valid: .*codebook_size"):
        parse_config(["--config", str(tmp_path / "c.yaml")])
    with pytest.raises(FileNotFoundError, match="retrieval config not found"):
        parse_config(["--config", str(tmp_path / "none.yaml")])
    with pytest.raises(SystemExit, match="missing --data-root"):
        parse_config(["--dataset", "holidays", "--weights", "w.pth"])


def test_a_module_passed_in_is_keyed_on_its_tensors_not_on_config_weights(setup, tmp_path):
    cfg = RetrievalConfig(
        "json",
        str(setup["root"] / "mini.json"),
        weights=str(setup["weights"]),
        arch=ARCH,
        resolution=int(RES),
        cache_dir=str(tmp_path / "cache"),
        progress=False,
    )
    run_retrieval(cfg)
    torch.manual_seed(5)
    other = create_model(ARCH)  # other weights, with the same config.weights beside them
    run_retrieval(cfg, model=other)
    entries = sorted((tmp_path / "cache").glob("retrieval-cls-database-*.pt"))
    assert len(entries) == 2  # no stale hit on the file's entry
    a, b = (torch.load(e, weights_only=True)["tensors"]["features"] for e in entries)
    assert not torch.allclose(a, b)


def test_train_images_from_a_prepared_dataset_give_the_same_codebook(setup, tmp_path):
    """``--train-images`` of a prepared dataset (the list file's images as records) learns the same PCA and
    codebook as the files themselves: identical VLAD results, from descriptors extracted and cached anew."""
    from ssl_xcit.data.shards import prepare_shards

    prepare_shards(setup["train"], tmp_path / "train_shards", progress=False)
    files, _ = run_cli(setup, "vlad")
    before = set(setup["cache"].glob("retrieval-local-train-*.pt"))
    shards, _ = run_cli(setup, "vlad", "json", None, "--train-images", str(tmp_path / "train_shards"))
    assert len(set(setup["cache"].glob("retrieval-local-train-*.pt")) - before) == 1  # its own cache entry
    assert shards["n_train_images"] == files["n_train_images"] == 8
    assert shards["metrics"]["aps"] == files["metrics"]["aps"] and shards["top_ranks"] == files["top_ranks"]


@pytest.mark.parametrize(("dataset", "method"), [("ukbench", "cls"), ("holidays", "vlad")])
def test_a_prepared_benchmark_database_ranks_as_its_folder(setup, tmp_path, dataset, method):
    from ssl_xcit.data.shards import prepare_shards

    shards = tmp_path / f"{dataset}_shards"
    prepare_shards(setup["mini"] / dataset, shards, progress=False, print_summary=False)
    folder, _ = run_cli(setup, method, dataset, setup["mini"] / dataset)
    prepared, _ = run_cli(setup, method, dataset, shards)
    assert prepared["n_database"] == folder["n_database"] and prepared["n_queries"] == folder["n_queries"]
    assert prepared["metrics"]["aps"] == folder["metrics"]["aps"]
    assert prepared["top_ranks"] == folder["top_ranks"]
