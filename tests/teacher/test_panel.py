"""Several teachers at once (`teacher.panel`): one teacher listed trains exactly as today; routed rows learn from
their own teacher only; the mixture and the sum are the formulas on both teachers' own logits; a cache and a live
teacher routed; 2 processes with two ZeRO-3 teachers (each rank holds half of each, one gather of each per optimizer
step); and each bad input is one line before anything loads."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from oracles import write_teacher_cache
from panel_common import (
    KEYS,
    assert_same_losses,
    dataset,
    formula,
    full_logits,
    trained,
    trainer_for,
)
from transformers import AutoModelForCausalLM

from trl_distill import DistillationConfig
from trl_distill.cli import main as cli_main
from trl_distill.cli.plan import main as plan_main
from trl_distill.data.batch import extras_of, loss_tokens
from trl_distill.loss.divergences import DIVERGENCES
from trl_distill.run_plan import resolve
from trl_distill.teacher.served import ServedTeacher
from trl_distill.testing import (
    build_tiny_model,
    launch,
    logged,
    read_rank_records,
    synthetic_prompt_completion,
)

WORKER = Path(__file__).parents[1] / "scripts" / "panel_worker.py"


@pytest.fixture(scope="module")
def alone(tiny_pair, tmp_path_factory) -> list[dict]:
    """Today's run: teacher_model_name_or_path, one teacher."""
    tmp = tmp_path_factory.mktemp("alone")
    return trained(trainer_for(tiny_pair, tmp, dataset(), teacher_model_name_or_path=tiny_pair["teacher"]))


def test_one_teacher_listed_trains_as_today(tiny_pair, alone, tmp_path):
    history = trained(trainer_for(tiny_pair, tmp_path, dataset(), teachers=[f"a={tiny_pair['teacher']}"]))
    assert_same_losses(history, alone)
    for step, kd in logged(history, "kd_loss").items():  # its part is the whole KD; its share every token
        assert logged(history, "kd_loss/a")[step] == pytest.approx(kd, rel=1e-6)
        assert logged(history, "teacher_tokens/a")[step] == 1.0


def test_rows_routed_to_one_teacher_learn_from_it_alone(tiny_pair, second_teacher, alone, tmp_path):
    """Every row names teacher a or none (a row naming none learns from the first listed): b, listed and loaded,
    changes no loss."""
    history = trained(trainer_for(tiny_pair, tmp_path, dataset(["a", None, ""]),
                                  teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"]))
    assert_same_losses(history, alone)
    assert set(logged(history, "kd_loss/b").values()) == {0.0}
    assert set(logged(history, "teacher_tokens/b").values()) == {0.0}


@pytest.mark.parametrize("combine, weights, divergence", [
    ("route", None, "forward_kl"), ("route", None, "jsd"), ("mixture", [0.25, 0.75], "forward_kl"),
    ("mixture", [0.5, 0.5], "reverse_kl"), ("sum", [0.25, 0.75], "forward_kl"), ("sum", [1.0, 2.0], "tvd"),
])
def test_each_way_of_combining_equals_its_formula(tiny_pair, second_teacher, tmp_path, combine, weights, divergence):
    trainer = trainer_for(tiny_pair, tmp_path, dataset(["a", "b", "b"]), divergence=divergence,
                          teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"], teacher_combine=combine,
                          teacher_weights=weights)
    batch = next(iter(trainer.get_train_dataloader()))
    if combine == "route":
        assert sorted(set(extras_of(batch).route.tolist())) == [0, 1]  # rows of both teachers in this batch
    else:
        assert extras_of(batch).route is None
    teachers = [trainer.teacher.members[name].module for name in ("a", "b")]
    with torch.no_grad():
        expected, parts = formula(trainer, batch, teachers, divergence)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # (set by the training loop)
        _, outputs = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    assert outputs["kd_loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    counted = trainer.teacher.kd_parts()
    if parts is None:
        assert counted is None and trainer.teacher.own_metrics() is None  # a mixture is one teacher: no parts
        return
    # each teacher's own diagnostics: its KL at T = 1 over the rows it teaches (routed) or all rows (sum)
    _, mask = loss_tokens(batch)
    with torch.no_grad():
        s_logp = F.log_softmax(full_logits(trainer.model, batch), -1)[mask]
        per_row = extras_of(batch).route[:, None].expand_as(mask)[mask] if combine == "route" else None
        assert list(trainer.teacher.own_metrics()) == ["a", "b"]
        for i, (name, measured) in enumerate(trainer.teacher.own_metrics().items()):
            t_logp = F.log_softmax(full_logits(teachers[i], batch), -1)[mask]
            kl = DIVERGENCES["forward_kl"](s_logp, t_logp, 0.5, 0.1)
            kl = kl if per_row is None else kl[per_row == i]
            assert measured.means()["kl_teacher_student"] == pytest.approx(kl.mean().item(), rel=1e-5), name
    total = sum(part for part, _ in counted.values())
    for (part, _), want in zip(counted.values(), parts):
        assert (outputs["kd_loss"] * part / total).item() == pytest.approx(want.item(), rel=1e-5, abs=1e-9)


def test_a_cache_and_a_live_teacher_routed(tiny_pair, second_teacher, tmp_path):
    """Teacher b read from a float32 cache of its whole distribution (k = V) trains as teacher b live."""
    data = dataset(["a", "b"])
    writer = trainer_for(tiny_pair, tmp_path / "writer", data, teacher=second_teacher)
    write_teacher_cache(writer, str(tmp_path / "cache_b"), top_k=writer.vocab_size, log_prob_dtype="float32")
    live = trained(trainer_for(tiny_pair, tmp_path / "live", data,
                               teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"]))
    cached = trained(trainer_for(tiny_pair, tmp_path / "cached", data,
                                 teachers=[f"a={tiny_pair['teacher']}", f"b=cache:{tmp_path / 'cache_b'}"]))
    assert_same_losses(cached, live, rel=1e-5)
    for key in ("kd_loss/a", "kd_loss/b", "teacher_tokens/b"):
        for step, value in logged(live, key).items():
            assert logged(cached, key)[step] == pytest.approx(value, rel=1e-5, abs=1e-9), (key, step)


def test_a_live_and_a_served_teacher_mixed(served, tmp_path):
    """The weighted sum of a live teacher's divergence and a vLLM server's (top-64): at the first step each part is its
    weight times that teacher's KD alone (the same batch, the same student)."""
    pair = {"student": served["student"], "tokenizer": served["teacher"]}
    common = dict(max_steps=1, temperature=1.0, max_length=64)
    teachers = [f"live={served['teacher']}", f"srv={served['url']}"]
    mixed = trained(trainer_for(pair, tmp_path / "mixed", dataset(), teacher_combine="sum",
                                teacher_weights=[0.25, 0.75], teachers=teachers, **common))
    live = trained(trainer_for(pair, tmp_path / "live", dataset(), teacher_model_name_or_path=served["teacher"],
                               **common))
    srv = trained(trainer_for(pair, tmp_path / "srv", dataset(), teacher_server=served["url"], **common))
    parts = {name: logged(mixed, f"kd_loss/{name}")[1] for name in ("live", "srv")}
    assert parts["live"] == pytest.approx(0.25 * logged(live, "kd_loss")[1], rel=1e-5)
    assert parts["srv"] == pytest.approx(0.75 * logged(srv, "kd_loss")[1], rel=1e-5)
    assert logged(mixed, "kd_loss")[1] == pytest.approx(parts["live"] + parts["srv"], rel=1e-6)
    assert logged(srv, "kd_loss")[1] < logged(live, "kd_loss")[1]  # the top-64 buckets: a lower bound of the full KL


def test_a_routed_server_is_asked_for_its_own_rows_only(served, tmp_path, monkeypatch):
    """Routed live + served: each collated batch asks the server for the served teacher's rows only (nothing when it
    has none), and the run trains exactly as when the server was asked for every row and the loss picked its own."""
    pair = {"student": served["student"], "tokenizer": served["teacher"]}
    common = dict(temperature=1.0, max_length=64, per_device_train_batch_size=3)
    data = dataset(["live", "srv", "srv", "live", "live", "live"])  # batches of 3 with 0, 1, 2 served rows
    teachers = [f"live={served['teacher']}", f"srv={served['url']}"]
    runs, asked = {}, {}
    for own in (True, False):
        monkeypatch.setattr(ServedTeacher, "routes_own_rows", own)  # False: the earlier path, every row asked for
        trainer = trainer_for(pair, tmp_path / str(own), data, teachers=teachers, **common)
        member = trainer.teacher.members["srv"]
        sent, request = [], member.request
        member.request = lambda batch, *a, sent=sent, request=request: sent.append(len(batch["input_ids"])) or \
            request(batch, *a)
        routes = [extras_of(batch).route.tolist() for batch in trainer.get_train_dataloader()]
        asked[own] = (sent[:len(routes)], routes)
        runs[own] = trained(trainer)
    sent, routes = asked[True]
    want = [route.count(1) for route in routes if 1 in route]
    assert sent[:len(want)] == want and any(1 not in route for route in routes)
    assert any(route.count(1) >= 2 for route in routes)  # rows kept in order within a request, checked below
    assert asked[False][0] == [len(route) for route in asked[False][1]]
    assert_same_losses(runs[True], runs[False], rel=1e-6)
    assert any(v > 0 for v in logged(runs[True], "kd_loss/srv").values())


@pytest.mark.distributed
def test_two_zero3_teachers_on_two_processes(tiny_pair, second_teacher, tmp_path, capsys):
    """ZeRO-2 student, teachers a and b each in its own ZeRO-3 plugin: each rank holds half of each teacher's
    parameters (the bytes `trl-distill plan` gives each), and DeepSpeed fetches each partitioned parameter of each
    teacher once per optimizer step (gradient accumulation 2; the first step also runs the logit check)."""

    def run_plan(argv):
        capsys.readouterr()
        plan_main(argv)
        return json.loads(capsys.readouterr().out)

    launch(WORKER, str(Path(tiny_pair["teacher"]).parent), second_teacher, str(tmp_path), timeout=300)
    records = read_rank_records(tmp_path)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_pair["teacher"])
    numel = sum(p.numel() for p in teacher.parameters())
    for rec in records:
        assert rec["plugins"] == ["student", "teacher:a", "teacher:b"]
        for name in ("a", "b"):
            share = rec["shares"][name]
            assert share["total"] == numel and share["held"] == numel // 2 and share["bytes_held"] == numel * 2
            assert share["materialized"] < numel // 100  # only the persistent small tensors, gathered
        assert len(rec["fetches_per_step"]) == 3
        for step in rec["fetches_per_step"][1:]:
            for name in ("a", "b"):
                partitioned = {k: v for k, v in step[name].items() if k not in rec["persistent"][name]}
                assert len(partitioned) == 4 * 7 + 2 and set(partitioned.values()) == {1}, (name, partitioned)
        for entry in (h for h in rec["log_history"] if "kd_loss" in h and "train_runtime" not in h):
            assert entry["kd_loss/a"] + entry["kd_loss/b"] == pytest.approx(entry["kd_loss"], rel=1e-6)
            assert entry["teacher_tokens/a"] + entry["teacher_tokens/b"] == pytest.approx(1.0)
            assert 0 < entry["teacher_tokens/b"] < entry["teacher_tokens/a"]  # a third of the rows are b's
            shares = [entry[f"teacher_tokens/{name}"] for name in ("a", "b")]  # each teacher's own metrics: their
            for metric in ("kl_teacher_student", "teacher_ce"):  # token-weighted mean is the run's
                mean = sum(share * entry[f"{metric}/{name}"] for share, name in zip(shares, ("a", "b")))
                assert mean == pytest.approx(entry[metric], rel=1e-6), metric
    planned = run_plan(["--student", tiny_pair["student"], "--teacher", tiny_pair["teacher"], second_teacher,
                        "--gpus_per_node", "2", "--dtype", "fp32", "--json"])  # `trl-distill plan` of this run
    for role, name in (("teacher 1", "a"), ("teacher 2", "b")):
        assert planned["models"][role]["ours"]["teacher_params"] == records[0]["shares"][name]["bytes_held"]
    steps = [[h for h in rec["log_history"] if "train_runtime" not in h] for rec in records]
    assert json.dumps(steps[0]) == json.dumps(steps[1])  # every rank logs the same reduced values


# ---- Bad input: one line each, before anything loads ----

@pytest.mark.parametrize("overrides, message", [
    (dict(teacher_combine="mixture", teacher_weights=[0.5, -0.1, 0.6]), "teacher_weights must be finite and >= 0"),
    (dict(teacher_combine="mixture", teacher_weights=[0.5, 0.3, 0.1]), "must sum to 1; [0.5, 0.3, 0.1] sum to 0.9"),
    (dict(teacher_combine="sum", teacher_weights=[1.0, 2.0]), "teacher_weights has 2 weights for 3 teachers"),
    (dict(teacher_weights=[0.5, 0.25, 0.25]), "routing takes each row's teacher from the routing column"),
    (dict(teacher_combine="mixture"), "and ['c'] give their top-k only"),
    (dict(lmbda=0.5), "and the teachers ['c'] are caches of the dataset's completions only"),
    (dict(teacher_model_name_or_path="x"), "not both"),
])
def test_bad_settings_are_one_line_as_the_config_is_built(tmp_path, overrides, message):
    settings = dict(output_dir=str(tmp_path), teachers=["a=./a", "b=./b", "c=cache:./c"], **overrides)
    with pytest.raises(ValueError) as error:
        resolve(DistillationConfig(**settings))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_unknown_teacher_in_the_column_is_one_line_before_the_student_loads(tiny_pair, second_teacher, tmp_path,
                                                                             monkeypatch):
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a) or 1 / 0)
    with pytest.raises(ValueError, match=r"Row 2 of the train dataset names the teacher 'physics' in 'teacher'; the "
                                         r"teachers are \['a', 'b'\]"):
        trainer_for(tiny_pair, tmp_path, dataset(["a", "b", "physics"]),
                    teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"])
    assert loads == [] and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"needs the train dataset's column 'teacher' naming each row's teacher"):
        trainer_for(tiny_pair, tmp_path, dataset(), teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"])
    assert loads == []


def test_an_output_dir_inside_a_listed_teacher_is_refused(tiny_pair, second_teacher, tmp_path):
    before = sorted(p.name for p in Path(second_teacher).iterdir())
    with pytest.raises(ValueError, match=r"is inside the teacher b \(--teachers\)"):
        trainer_for(tiny_pair, tmp_path, dataset(["a", "b"]), output_dir=str(Path(second_teacher) / "run"),
                    teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"])
    assert sorted(p.name for p in Path(second_teacher).iterdir()) == before  # nothing written there


def test_teachers_with_other_tokenizers_are_one_line_naming_them(tiny_pair, tmp_path, capsys):
    from trl_distill.testing import build_tokenizer

    other = build_tokenizer(300, corpus=["an entirely different corpus of words for merges"] * 8)
    paths = []
    for name in ("x", "y"):
        model = build_tiny_model(other, "teacher")
        model.save_pretrained(tmp_path / name)
        other.save_pretrained(tmp_path / name)
        paths.append(f"{name}={tmp_path / name}")
    data = tmp_path / "data.jsonl"
    dataset(["x", "y"], rows=8).to_json(str(data))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--model_name_or_path", tiny_pair["student"], "--teachers", *paths, "--dataset_name", str(data),
                  "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--report_to", "none", "--bf16",
                  "false"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trl-distill: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1
    assert "The teachers ['x', 'y'] have another tokenizer than the student's" in errors[0]


def test_the_command_line_and_a_recipe_list_teachers(tiny_pair, second_teacher, tmp_path, capsys):
    """`--teachers NAME=SOURCE ...` and a recipe's list of dicts (one with its own `from_pretrained` arguments) train
    the same student alike: the same logged losses, each teacher's part logged. A teacher's own DeepSpeed config
    without a DeepSpeed student is one line naming that teacher."""
    data = tmp_path / "data.jsonl"
    dataset(["a", "b"], rows=16).to_json(str(data))
    common = ["--model_name_or_path", tiny_pair["student"], "--dataset_name", str(data), "--max_steps", "2",
              "--report_to", "none", "--bf16", "false", "--gradient_checkpointing", "false", "--logging_steps", "1",
              "--save_strategy", "no", "--use_cpu", "true", "--teacher_combine", "sum", "--disable_tqdm", "true"]
    cli_main([*common, "--output_dir", str(tmp_path / "flags"), "--teachers", f"a={tiny_pair['teacher']}",
              f"b={second_teacher}", "--teacher_weights", "0.5", "0.25"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"teachers:\n  - name: a\n    model: {tiny_pair['teacher']}\n  - name: b\n    model: "
                      f"{second_teacher}\n    init_kwargs: {{dtype: float32}}\nteacher_weights: [0.5, 0.25]\n")
    cli_main([*common, "--output_dir", str(tmp_path / "recipe"), "--config", str(recipe)])
    histories = [json.loads((tmp_path / run / "trainer_state.json").read_text())["log_history"]
                 for run in ("flags", "recipe")]
    for key in (*KEYS, "kd_loss/a", "kd_loss/b"):
        got, want = logged(histories[1], key), logged(histories[0], key)
        assert len(want) == 2 and got == pytest.approx(want, rel=1e-6), key
    recipe.write_text(f"teachers:\n  - name: a\n    model: {tiny_pair['teacher']}\n    deepspeed: "
                      "configs/deepspeed/zero3_teacher.json\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*common, "--output_dir", str(tmp_path / "ds"), "--config", str(recipe)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trl-distill: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1
    assert "teacher a's `deepspeed` is set but the student does not use DeepSpeed" in errors[0]


def test_datasets_named_after_the_teachers_route_as_a_whole(tiny_pair, second_teacher, tmp_path):
    """`train_dataset={"a": ..., "b": ...}` (CLI: `--dataset_name a=PATH,b=PATH`) trains as the one dataset whose
    teacher column names each row's dataset; a name that is no teacher's is one line."""
    from datasets import concatenate_datasets

    teachers = [f"a={tiny_pair['teacher']}", f"b={second_teacher}"]
    parts = {"a": synthetic_prompt_completion(16, seed=3), "b": synthetic_prompt_completion(16, seed=4)}
    named = trained(trainer_for(tiny_pair, tmp_path / "named", parts, teachers=teachers, max_steps=2))
    one = concatenate_datasets([d.add_column("teacher", [k] * len(d)) for k, d in parts.items()])
    together = trained(trainer_for(tiny_pair, tmp_path / "one", one, teachers=teachers, max_steps=2))
    for key in (*KEYS, "kd_loss/a", "kd_loss/b", "teacher_tokens/a"):
        assert logged(named, key) == logged(together, key) and len(logged(named, key)) == 2, key
    for name, part in parts.items():
        part.to_json(str(tmp_path / f"{name}.jsonl"))
    cli_main(["--model_name_or_path", tiny_pair["student"], "--teachers", *teachers, "--dataset_name",
              f"a={tmp_path / 'a.jsonl'},b={tmp_path / 'b.jsonl'}", "--output_dir", str(tmp_path / "cli"),
              "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none", "--bf16", "false",
              "--gradient_checkpointing", "false", "--logging_steps", "1", "--save_strategy", "no", "--use_cpu",
              "true", "--disable_tqdm", "true", "--learning_rate", "2e-3", "--lr_scheduler_type", "constant",
              "--alpha", "0.5", "--temperature", "2.0", "--kd_temperature_scaling", "false", "--seed", "0"])
    history = json.loads((tmp_path / "cli" / "trainer_state.json").read_text())["log_history"]
    for key in (*KEYS, "teacher_tokens/a"):
        assert logged(history, key) == pytest.approx(logged(named, key), rel=1e-6), key
    with pytest.raises(ValueError, match=r"\['physics'\] name no teacher of \['a', 'b'\]"):
        trainer_for(tiny_pair, tmp_path / "bad", {"a": parts["a"], "physics": parts["b"]}, teachers=teachers)


def test_evaluation_routes_its_rows_too(tiny_pair, second_teacher, tmp_path):
    """An eval split routed like the train split: its KD is each row's own teacher's (a split all of one teacher's
    rows evaluates as that teacher alone), and a dict of eval splits is evaluated apart."""
    teachers = [f"a={tiny_pair['teacher']}", f"b={second_teacher}"]
    held_out = synthetic_prompt_completion(8, seed=9)
    trainer = trainer_for(tiny_pair, tmp_path / "panel", dataset(["a", "b"]), teachers=teachers, max_steps=1,
                          eval_strategy="no")
    as_a = trainer.evaluate(held_out.add_column("teacher", ["a"] * 8))
    as_b = trainer.evaluate(held_out.add_column("teacher", ["b"] * 8))
    alone = trainer_for(tiny_pair, tmp_path / "alone", dataset(), teacher_model_name_or_path=second_teacher,
                        max_steps=1, eval_strategy="no")
    assert as_b["eval_kd_loss"] == pytest.approx(alone.evaluate(held_out)["eval_kd_loss"], rel=1e-6)
    assert as_a["eval_kd_loss"] != pytest.approx(as_b["eval_kd_loss"], rel=1e-3)
    assert as_a["eval_ce_loss"] == pytest.approx(as_b["eval_ce_loss"], rel=1e-6)  # the same student


def test_a_teacher_with_another_tokenizer_routed_beside_one_with_the_students(tiny_pair, other_teacher, tmp_path):
    """Rows routed to a cross-tokenizer teacher learn from it as they would from it alone; a mixture with it is one
    line (a mixture needs one vocabulary)."""
    teachers = [f"a={tiny_pair['teacher']}", f"x={other_teacher}"]
    routed = trained(trainer_for(tiny_pair, tmp_path / "routed", dataset(["x"]), teachers=teachers))
    alone = trained(trainer_for(tiny_pair, tmp_path / "alone", dataset(), teacher_model_name_or_path=other_teacher))
    assert_same_losses(routed, alone)
    assert "aligned_token_share/x" in routed[0] and routed[0]["teacher_tokens/x"] == 1.0
    split = trained(trainer_for(tiny_pair, tmp_path / "split", dataset(["a", "x"]), teachers=teachers))
    for entry in split[:-1]:
        assert entry["kd_loss/a"] + entry["kd_loss/x"] == pytest.approx(entry["kd_loss"], rel=1e-6)
        assert 0 < entry["teacher_tokens/x"] < 1
    with pytest.raises(ValueError, match="a mixture of distributions needs one vocabulary"):
        trainer_for(tiny_pair, tmp_path / "mixed", dataset(), teachers=teachers, teacher_combine="mixture")
