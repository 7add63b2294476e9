"""``ssl-xcit plan``: a recipe and fit-style overrides read as ``fit`` reads them, the printed plan equal to the
estimator's, and every bad input ended in one or two lines naming it and what is valid."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ssl_xcit.cli import console_main
from ssl_xcit.cli import main as cli_main
from ssl_xcit.cli.plan import apply_overrides, describe, plan_input, read_recipe
from ssl_xcit.trainer.memory_plan import PlanInput, estimate

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.backbone", "xcit_nano_12_p8", "--model.backbone_kwargs", "{depth: 1}", "--model.out_dim=256",
        "--model.head_hidden_dim=64", "--model.head_bottleneck_dim=32", "--data.batch_size=4",
        "--data.global_crops_size=32", "--data.local_crops_number=2", "--data.local_crops_size=16",
        "--trainer.precision=32"]  # fmt: skip


def _plan(*argv: str, config: str | None = None) -> PlanInput:
    recipe = read_recipe(config)
    apply_overrides(recipe, list(argv))
    return plan_input(recipe)


def test_a_distillation_recipe_is_planned_with_its_teachers_shapes(capsys):
    """recipes/distill.yaml with a timm teacher: no download (its architecture only), the student's own
    arguments accepted through Distill's ``**kwargs``, and the teacher held beside the student."""
    import timm

    argv = ["-c", "recipes/distill.yaml", "--model.teacher", "timm:vit_tiny_patch16_224", *TINY]
    plan = _plan(*argv[2:], config=str(REPO / "recipes" / "distill.yaml"))
    assert (
        plan.model_class == "ssl_xcit.dino.distill.Distill"
        and plan.model_args["backbone"] == "xcit_nano_12_p8"
    )
    out = cli_main(["plan", *argv])
    teacher = timm.create_model("vit_tiny_patch16_224", num_classes=0)
    assert out["teachers"] == 4 * sum(p.numel() for p in teacher.parameters())  # float32, frozen, no EMA copy
    assert "teachers" in capsys.readouterr().out


def test_a_recipe_and_its_overrides_are_read_as_fit_reads_them():
    plan = _plan(config=str(REPO / "recipes" / "dino_vit_s16.yaml"))
    assert (plan.batch_size, plan.global_crops_size, plan.local_crops_number, plan.local_crops_size) == (
        64, 224, 8, 96)  # fmt: skip
    assert (plan.precision, plan.strategy, plan.world_size) == ("16-mixed", "ddp", 16)  # 8 devices x 2 nodes
    assert plan.model_args["backbone"] == "vit_small_patch16_224"
    plan = _plan("--trainer.strategy", "fsdp2", "--trainer.precision=bf16-mixed", "--trainer.num_nodes=1",
                 "--model.init_args.activation_checkpointing", "true", "--data.init_args.batch_size=32",
                 config=str(REPO / "recipes" / "dino_vit_s16.yaml"))  # fmt: skip
    assert (plan.strategy, plan.precision, plan.world_size, plan.batch_size) == ("fsdp2", "bf16-mixed", 8, 32)
    assert plan.model_args["activation_checkpointing"] is True
    # No recipe: DINO's and the datamodule's defaults, bf16-mixed on one GPU.
    plan = _plan()
    assert (plan.model_args, plan.batch_size, plan.local_crops_number, plan.precision, plan.world_size) == (
        {}, 64, 8, "bf16-mixed", 1)  # fmt: skip


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_the_printed_plan_is_the_estimate(capsys):
    out = cli_main(["plan", *TINY, "--gpu-memory", "80"])
    printed = capsys.readouterr().out
    expected = estimate(_plan(*TINY))
    assert out["peak"] == expected.peak and out["traced_peak"] == expected.traced_peak and out["fits"] is True
    assert f"{expected.peak / 1e9:8.2f} GB" in printed and "fits 80 GB:   yes" in printed
    below = (expected.peak - 1) / 1e9  # the same plan against a GPU one byte too small
    assert not expected.fits(below) and f"fits {below:g} GB:   NO" in describe(_plan(*TINY), expected, below)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model.backbone", "vit_gigantic"], "unknown backbone 'vit_gigantic'; `ssl-xcit models` lists"),
        (["--data.batch_size", "0"], "batch_size must be an integer >= 1, got 0"),
        (
            ["--trainer.precision", "bf16"],
            "precision 'bf16' cannot be planned; valid: 32, 32-true, bf16-mixed",
        ),
        (["--trainer.strategy", "deepspeed"], "strategy 'deepspeed' cannot be planned; valid: auto, ddp"),
        (["--trainer.devices", "auto"], "--trainer.devices must be an integer >= 1 for a plan, got 'auto'"),
        (["--model.head_dim", "3"], "ssl_xcit.dino.module.DINO has no argument 'head_dim'"),
        (["--batch", "3"], "unknown option '--batch'; ssl-xcit plan takes -c RECIPE, --model.KEY"),
        (["-c", "recipes/nope.yaml"], "recipe 'recipes/nope.yaml' does not exist"),
        (["--gpu-memory", "0"], "--gpu-memory must be > 0 GB, got 0.0"),
        (
            ["--model.class_path", "ssl_xcit.evaluation.linear.probe.LinearProbe"],
            "plans ssl_xcit.dino.module.DINO",
        ),
        (
            [
                "-c",
                "recipes/distill.yaml",
                "--model.teacher",
                "timm:vit_tiny_patch16_224",
                "--model.objective",
                "dinov3",
            ],
            "timm:vit_tiny_patch16_224 has no DINO head, which the dinov3 objective distils from",
        ),  # fmt: skip
    ],
)
def test_bad_inputs_end_in_one_or_two_lines(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        console_main(["plan", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(err) <= 2 and message in err[0], err


@pytest.mark.slow
def test_the_docs_table_command_runs(capsys):
    """docs' ``ssl-xcit plan --table`` command, shrunk to one tiny model (later flags win): a Markdown row of
    four largest batches, each the one a search over full-depth traces gives."""
    import re
    import shlex

    from ssl_xcit.trainer.memory_plan import max_batch

    commands = [
        shlex.split(line)
        for page in sorted((REPO / "docs").glob("*.md"))
        for line in page.read_text().splitlines()
        if line.startswith("ssl-xcit plan --table ")
    ]
    assert commands, "docs name the table's command"
    # 5.1 GB: ~90 MB beside FSDP2's margin on 8 GPUs (1 GB + 2 NCCL communicators x 2 GB), 2 GB more beside DDP's
    tiny = ["--table=xcit_nano_12_p8", "--gpu-memory=5.1", *TINY[2:]]
    for argv in commands:
        rows = cli_main([*argv[1:], *tiny])
        assert [r["backbone"] for r in rows] == ["xcit_nano_12_p8"]
        assert re.search(r"^\| `xcit_nano_12_p8` \| \d+ M \|( \d+ \|){4}$", capsys.readouterr().out, re.M)
    overrides = [a for i, a in enumerate(argv[2:], start=2) if "--table" not in (a, argv[i - 1])]
    plan = _plan(*overrides, *TINY[2:])
    plan = replace(plan, model_args={**plan.model_args, "backbone": "xcit_nano_12_p8"}, strategy="fsdp2")
    # settled by full-depth traces, whatever the shallow copies' guess; DDP's one communicator leaves it more
    assert rows[0]["ddp"] > rows[0]["fsdp2"] == max_batch(plan, 5.1, first=1)[0] > 0
