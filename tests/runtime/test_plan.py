"""`trl-distill plan`: parsing, exact parameter counts, per-GPU arithmetic, recommendations, and a check against
the bytes a real 2-process run (ZeRO-2 student, ZeRO-3 teacher, DeepSpeed on CPU) holds per rank."""

import json
from pathlib import Path

import pytest

from trl_distill.cli.plan import main as plan_main
from trl_distill.runtime import plan, plan_text
from trl_distill.testing import build_tiny_model, build_tokenizer, launch

SCRIPTS = Path(__file__).parents[1] / "scripts"
DOC_CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "planner_configs"
# A few M parameters each, so per-rank byte counts are not dominated by padding
DIMS = {
    "teacher": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4),
    "student": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A tokenizer, a teacher and a student saved with `save_pretrained` (the layout plan_worker.py reads)."""
    directory = tmp_path_factory.mktemp("plan_models")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory / "tokenizer")
    for seed, (size, dims) in enumerate(DIMS.items()):
        build_tiny_model(tokenizer, size, seed=seed, **dims).save_pretrained(directory / size)
    return directory


def run_plan(capsys, *argv) -> dict:
    plan_main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def specs(student="1B", teacher="8B", **dims):
    return plan.load_spec(student, dims), plan.load_spec(teacher, dims)


@pytest.mark.parametrize(
    "text, count",
    [("8B", 8_000_000_000), ("8b", 8_000_000_000), ("600M", 600_000_000), ("8e9", 8_000_000_000),
     ("1.5B", 1_500_000_000), ("125k", 125_000), ("70553706496", 70_553_706_496)],
)
def test_parse_count(text, count):
    assert plan.parse_count(text) == count


@pytest.mark.parametrize("text", ["docs/planner_configs/qwen3-8b", "config.json", "8X", "B", ""])
def test_parse_count_rejects_paths_and_junk(text):
    assert plan.parse_count(text) is None


def test_count_with_dims_and_defaults():
    spec = plan.load_spec("600M", {"hidden": 1024, "layers": 28, "vocab": 151936})
    assert (spec.params, spec.hidden, spec.layers, spec.vocab) == (600_000_000, 1024, 28, 151936)
    guessed = plan.load_spec("8B")  # Llama-like shape guessed from the count
    assert 3500 < guessed.hidden < 5000 and 25 < guessed.layers < 45 and guessed.vocab == 32000


def test_config_path_directory_and_file_count_exactly(models):
    real = sum(p.numel() for p in build_tiny_model(build_tokenizer(), "teacher", **DIMS["teacher"]).parameters())
    for source in (models / "teacher", models / "teacher" / "config.json"):
        spec = plan.load_spec(str(source))
        assert spec.params == real and spec.hidden == 256 and spec.layers == 4 and not spec.tied


def test_public_configs_count_exactly():
    """Published totals of the pairings in docs/planner.md; a tied embedding is counted once."""
    counts = {"llama-3.1-70b": 70_553_706_496, "llama-3.1-8b": 8_030_261_248, "qwen3-0.6b": 596_049_920}
    for name, count in counts.items():
        assert plan.load_spec(str(DOC_CONFIGS / name)).params == count
    assert plan.load_spec(str(DOC_CONFIGS / "qwen3-0.6b")).tied


def test_moe_configs_count_total_and_active_parameters_and_gather_a_layers_experts():
    """Qwen3-30B-A3B and Qwen3-235B-A22B: totals and active counts as published (30.5B / 3.3B, 235B / 22B), the
    largest leaf module one layer's experts (3 E i_moe h), and activations through the k routed experts' width."""
    for name, total, active, (experts, width, hidden) in (
            ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704, (128, 768, 2048)),
            ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520, (128, 1536, 4096))):
        spec = plan.load_spec(str(DOC_CONFIGS / name))
        assert spec.params == total and spec.moe.active_params == active
        assert spec.moe.expert_params == 3 * experts * width * hidden * spec.layers
        assert active == total - spec.moe.expert_params + spec.moe.expert_params * 8 // 128
        assert spec.largest_layer == 3 * experts * width * hidden
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        assert plan.layer_activations(spec, 10) == 10 * (4 * spec.hidden + 2 * q + 2 * kv + 4 * (8 * width + 32))
    assert plan.load_spec(str(DOC_CONFIGS / "qwen3-8b")).moe is None  # dense: as before


def test_missing_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--student", "/no/such/model", "--teacher", "8B"])
    assert exit_info.value.code == 2 and "/no/such/model" in capsys.readouterr().err


@pytest.mark.parametrize("nodes, gpus", [(1, 2), (1, 8), (2, 8), (4, 8)])
def test_zero3_teacher_bytes_per_gpu_and_replicated_total(capsys, nodes, gpus):
    out = run_plan(capsys, "--student", "1B", "--teacher", "70B", "--nodes", str(nodes), "--gpus_per_node",
                   str(gpus), "--dtype", "bf16")
    configs, total = out["configs"], 70_000_000_000 * 2
    assert configs["ours"]["rows"]["teacher_params"] == total // (nodes * gpus)
    assert configs["zero3"]["rows"]["teacher_params"] == total // (nodes * gpus)
    assert configs["replicated"]["rows"]["teacher_params"] == total
    assert configs["offload_teacher"]["rows"]["teacher_params"] == 0
    assert configs["offload_teacher"]["rows"]["gather_buffers"] == configs["ours"]["rows"]["gather_buffers"] > 0


def test_zero3_shard_pads_each_tensor():
    spec = plan.ModelSpec(params=10, hidden=2, layers=1, vocab=2, intermediate=2, heads=1, kv_heads=1, head_dim=2,
                          numels=(3, 7))
    assert plan.zero3_shard(spec, 2) == 2 + 4


def test_matches_deepspeed_estimators():
    """In mixed precision the student's params + grads + Adam equal DeepSpeed's ZeRO-2 estimate (ours adds the
    reduce bucket), and the teacher's shard is the 16-bit term of its ZeRO-3 estimate."""
    student, teacher = specs()
    settings = plan.Settings(nodes=2, gpus_per_node=8, dtype="bf16")
    rows = plan.estimate(student, teacher, settings)
    ds = plan.deepspeed_estimates(student, teacher, settings, "ours")
    ours_student = rows["student_params"] + rows["student_grads"] + rows["optimizer"] - student.hidden**2 * 2
    assert abs(ours_student - ds["student_model_states"]) <= 16
    assert ds["teacher_model_states"] == rows["teacher_params"] + 4 * teacher.largest_layer


def test_chunked_loss_is_smaller_than_full_logits_at_long_sequences():
    student, teacher = specs(vocab=128256)
    settings = plan.Settings(micro_batch=4, seq_len=8192)
    chunked = plan.logits_bytes(student, settings, chunked=True)
    assert plan.chunk_rows(student, settings) == (1 << 25) // 128256
    assert chunked < plan.logits_bytes(student, settings, chunked=False) / 4


def test_checkpointing_reduces_activations():
    student, teacher = specs()
    off = plan.activation_bytes(student, teacher, plan.Settings(seq_len=2048))
    on = plan.activation_bytes(student, teacher, plan.Settings(seq_len=2048, gradient_checkpointing=True))
    assert on < off / 4


def test_the_once_per_step_teacher_holds_hidden_states_and_its_lm_head(capsys):
    """Teacher hidden states for every token of the step's micro-batches plus its lm_head, held through the step;
    TRL's replicated teacher runs per micro-batch (0 here, its logits are in logits_loss)."""
    student, teacher = specs(vocab=128256)
    one = plan.estimate(student, teacher, plan.Settings(micro_batch=2, seq_len=4096))
    eight = plan.estimate(student, teacher, plan.Settings(micro_batch=2, seq_len=4096, gradient_accumulation=8))
    head, states = teacher.vocab * teacher.hidden * 2, 2 * 4096 * teacher.hidden * 2
    assert one["teacher_step"] == head + states and eight["teacher_step"] == head + 8 * states
    assert plan.estimate(student, teacher, plan.Settings(gradient_accumulation=8), teacher="replicated",
                         chunked=False)["teacher_step"] == 0
    # the teacher's forward runs over the rows of the step (or teacher_batch_size of them), before the student's
    capped = plan.Settings(micro_batch=2, seq_len=4096, gradient_accumulation=8, teacher_batch_size=4)
    assert capped.teacher_rows == 4 and plan.Settings(micro_batch=2, gradient_accumulation=8).teacher_rows == 16
    plan_main(["--student", "1B", "--teacher", "8B", "--gradient_accumulation", "8", "--teacher_batch_size", "4"])
    table = capsys.readouterr().out
    assert "gradient accumulation 8, teacher rows per forward 4" in table
    assert any(line.startswith("teacher_step") for line in table.splitlines())


def test_a_served_teacher_costs_the_students_gpus_nothing_but_its_top_k(capsys):
    """`served` (--teacher_server): no teacher parameters, gathers, working set or step pass on the student's GPUs;
    the student's rows as in `ours`, plus the micro-batch's top-k signal (int64 ids, fp32 log-probs, k = 64)."""
    student, teacher = specs(vocab=128256)
    settings = plan.Settings(micro_batch=2, seq_len=4096, gradient_accumulation=8)
    ours = plan.estimate(student, teacher, settings)
    served = plan.estimate(student, teacher, settings, teacher="served")
    assert served["teacher_params"] == served["gather_buffers"] == served["teacher_step"] == 0
    for row in ("student_params", "student_grads", "optimizer"):
        assert served[row] == ours[row], row
    assert served["activations"] <= ours["activations"]
    assert served["logits_loss"] == ours["logits_loss"] + 2 * 4096 * 64 * 12
    assert plan.deepspeed_estimates(student, teacher, settings, "served")["teacher_model_states"] == 0
    args = ["--student", str(DOC_CONFIGS / "qwen3-0.6b"), "--teacher", str(DOC_CONFIGS / "qwen3-8b"),
            "--gpus_per_node", "8", "--gpu_memory_gb", "16", "--micro_batch", "2"]
    result = run_plan(capsys, *args)
    assert [name for name, setup in result["configs"].items() if setup["fits"]] == ["served"]
    assert result["recommendation"]["config"] != "served"  # it needs GPUs of its own: named, never recommended
    plan_main(args)
    assert "Or serve the teacher with vLLM on other GPUs (--teacher_server)" in capsys.readouterr().out


def test_does_not_fit_flagged_and_recommendation_changes(capsys):
    args = ["--student", str(DOC_CONFIGS / "llama-3.1-8b"), "--teacher", str(DOC_CONFIGS / "llama-3.1-70b"),
            "--nodes", "2", "--gpus_per_node", "8", "--seq_len", "4096", "--micro_batch", "1"]
    roomy = run_plan(capsys, *args, "--gpu_memory_gb", "80")
    assert not roomy["configs"]["replicated"]["fits"]  # 131 GiB of teacher on every GPU
    assert roomy["recommendation"]["config"] == "ours" and roomy["recommendation"]["settings"] is None
    tight = run_plan(capsys, *args, "--gpu_memory_gb", "60")
    assert not tight["configs"]["ours"]["fits"] and tight["recommendation"]["config"] == "zero3"
    tighter = run_plan(capsys, *args, "--gpu_memory_gb", "40")
    assert not any(c["fits"] for c in tighter["configs"].values())
    assert tighter["recommendation"]["settings"] == {"gradient_checkpointing": "on"}
    plan_main([*args, "--gpu_memory_gb", "40"])
    table = capsys.readouterr().out
    assert "NO" in table and "Nothing fits as given" in table and "--gradient_checkpointing on" in table


def test_help_lists_every_input(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: trl-distill plan")
    for flag in ("--student", "--teacher", "--nodes", "--gpus_per_node", "--gpu_memory_gb", "--dtype", "--micro_batch",
                 "--seq_len", "--optimizer", "--gradient_checkpointing", "--loss_chunk_size", "--json",
                 "--gradient_accumulation", "--teacher_batch_size", "--sequence_parallel",
                 "--student_hidden_size", "--student_layers", "--student_vocab", "--teacher_hidden_size",
                 "--teacher_intermediate_size", "--teacher_kv_heads", "headroom", "12 bytes"):
        assert flag in text, flag


@pytest.mark.distributed
def test_estimate_matches_a_real_two_process_run(models, tmp_path, capsys):
    """Teacher shard, student parameters and ZeRO-2 optimizer state per rank, as planned vs as held (fp32)."""
    launch(SCRIPTS / "plan_worker.py", str(models), str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    out = run_plan(capsys, "--student", str(models / "student"), "--teacher", str(models / "teacher"), "--nodes", "1",
                   "--gpus_per_node", "2", "--dtype", "fp32", "--micro_batch", "2", "--seq_len", "64")
    rows = out["configs"]["ours"]["rows"]
    for rec in ranks:
        assert rec["world_size"] == 2 and rec["optimizer_class"] == "AdamW"
        assert not rec["fp32_partition_aliases_params"]  # a real fp32 master copy, even without mixed precision
        optimizer = rec["fp32_partition_bytes"] + rec["moment_bytes"]
        # The planner's formulas for these rows are exact byte counts, and the bytes held match them to the byte
        # (measured on both ranks: teacher shard 5,513,728, student 2,892,288, optimizer 1,446,144 + 2,892,288)
        assert rec["teacher_shard_bytes"] == rows["teacher_params"] == 5_513_728
        assert rec["student_param_bytes"] == rows["student_params"] == 2_892_288
        assert optimizer == rows["optimizer"] == 4_338_432  # 12 bytes x P_s/2: fp32 master + two AdamW moments
        # the planner's replicated teacher is the whole teacher
        assert rec["teacher_total_bytes"] == out["configs"]["replicated"]["rows"]["teacher_params"]


def test_docs_tables_are_current():
    """docs/planner.md shows the planner's output for the Llama pair; regenerate it when the formulas change."""
    docs = (DOC_CONFIGS.parent / "planner.md").read_text()
    student, teacher = (plan.load_spec(str(DOC_CONFIGS / name)) for name in ("llama-3.1-8b", "llama-3.1-70b"))
    settings = plan.Settings(nodes=2, gpus_per_node=8, gpu_memory_gb=80, micro_batch=1, seq_len=4096)
    table = plan_text.format_plan(plan.plan(student, teacher, settings, deepspeed_check=False))
    for line in table.splitlines():
        if line.startswith((*plan.ROWS, "total", "Recommendation")):
            assert line in docs


def test_several_teachers_hold_the_sum_of_their_shards(capsys):
    """`--teacher 8B 7B` (`teachers`): each teacher's ZeRO-3 shard and step rows add up; they run one after another,
    so the gather buffers and the working set are the larger one's; each teacher's own part is printed."""
    common = ("--student", "1B", "--gpus_per_node", "8", "--gradient_accumulation", "4")
    both = run_plan(capsys, *common, "--teacher", "8B", "7B")
    alone = {t: run_plan(capsys, *common, "--teacher", t)["configs"] for t in ("8B", "7B")}
    for setup, result in both["configs"].items():
        rows = result["rows"]
        for row in ("teacher_params", "teacher_step"):
            assert rows[row] == alone["8B"][setup]["rows"][row] + alone["7B"][setup]["rows"][row], (setup, row)
        for row in ("gather_buffers", "activations", "student_params", "optimizer"):
            assert rows[row] == max(alone[t][setup]["rows"][row] for t in alone), (setup, row)
        if setup == "fsdp2":  # (DeepSpeed's estimators: its own setups only)
            continue
        assert result["deepspeed"]["teacher_model_states"] == pytest.approx(
            sum(alone[t][setup]["deepspeed"]["teacher_model_states"] for t in alone), abs=2)
    assert [m for m in both["models"]] == ["student", "teacher 1", "teacher 2"]
    for role, count in (("teacher 1", "8B"), ("teacher 2", "7B")):
        assert both["models"][role]["ours"]["teacher_params"] == alone[count]["ours"]["rows"]["teacher_params"]
    plan_main(["--student", "1B", "--teacher", "8B", "7B"])
    printed = capsys.readouterr().out
    assert "teacher 2: 7.000B params" in printed and "in ours: teacher_params" in printed


def test_sequence_parallel_splits_what_grows_with_the_sequence(capsys):
    """`--sequence_parallel 4`: each GPU holds a quarter of every sequence's positions: the activations, the loss and
    the step's teacher states are those of seq_len / 4; weights, gradients and optimizer state do not move; TRL's
    column (no sequence parallelism) stays whole. The long-sequence rows show each length both ways."""
    common = ("--student", "1B", "--teacher", "8B", "--gpus_per_node", "8")
    whole = run_plan(capsys, *common, "--seq_len", "32768")
    split = run_plan(capsys, *common, "--seq_len", "32768", "--sequence_parallel", "4")
    quarter = run_plan(capsys, *common, "--seq_len", "8192")
    for row in ("activations", "logits_loss", "teacher_step"):
        assert split["configs"]["ours"]["rows"][row] == quarter["configs"]["ours"]["rows"][row]
        assert split["configs"]["ours"]["rows"][row] < whole["configs"]["ours"]["rows"][row]
    for row in ("teacher_params", "student_params", "student_grads", "optimizer", "gather_buffers"):
        assert split["configs"]["ours"]["rows"][row] == whole["configs"]["ours"]["rows"][row]
    assert split["configs"]["replicated"] == whole["configs"]["replicated"]
    longest = split["long_sequences"]
    assert [r["seq_len"] for r in longest] == [32768 * 2**i for i in range(5)]
    assert longest[0]["without"]["total"] == whole["configs"]["ours"]["total"]
    assert longest[0]["with"]["total"] == split["configs"]["ours"]["total"]
    # the activations are linear in the length: doubling it doubles them, with SP as without
    growth = [r["with"]["growing"] for r in longest]
    assert growth[1] / growth[0] == pytest.approx(2, rel=0.1)
    plan_main([*common, "--seq_len", "32768", "--sequence_parallel", "4"])
    text = capsys.readouterr().out
    assert "Long sequences" in text and "sequence parallel 4" in text


def test_a_sequence_parallel_size_that_does_not_divide_the_gpus_is_one_line(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--student", "1B", "--teacher", "8B", "--gpus_per_node", "8", "--sequence_parallel", "3"])
    assert "sequence_parallel 3 must divide the 8 GPUs" in capsys.readouterr().err


def test_on_one_gpu_the_plan_says_the_teacher_is_held_whole(capsys):
    """Issue 55: the run holds a one-process teacher whole (no ZeRO-3 hooks); the plan says so in one line, and only
    there."""
    one = ["--student", "1B", "--teacher", "3B", "--nodes", "1", "--gpus_per_node", "1", "--gpu_memory_gb", "141"]
    plan_main(one)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Recommendation")]
    assert line.startswith("Recommendation: ours") and line.endswith(
        "On 1 GPU the teacher is held whole: nothing to partition over, so no ZeRO-3 hooks (teacher_deepspeed keeps "
        "ZeRO-3).")
    plan_main([*one[:-4], "--gpus_per_node", "8", "--gpu_memory_gb", "141"])
    assert "held whole" not in capsys.readouterr().out
