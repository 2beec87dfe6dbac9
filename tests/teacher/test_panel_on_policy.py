"""Several teachers on the student's own samples (MOPD): routed rows of the student's samples learn from their own
teacher (each live teacher's forward runs on its rows only), a served teacher scores its rows of them, TRL's
`teacher_id` column routes like ours, and resuming with another set of teachers is one line."""

from pathlib import Path

import pytest
import torch
from panel_common import (
    assert_same_losses,
    dataset,
    formula,
    trained,
    trainer_for,
)
from side_channels import side_channels
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import EXTRAS, extras_of, loss_tokens
from trl_distill.rollout.sampling import STUDENT
from trl_distill.run_plan import resolve
from trl_distill.testing import launch, logged, read_rank_records, tiny_run_settings

WORKER = Path(__file__).parents[1] / "scripts" / "panel_worker.py"
ON_POLICY = dict(lmbda=1.0, max_new_tokens=6, divergence="reverse_kl", alpha=1.0)


def counting_forwards(trainer) -> dict[str, list[int]]:
    """Each live teacher's forward calls, by the rows each one ran on."""
    rows = {}
    for name, member in trainer.teacher.members.items():
        rows[name] = []
        forward = member.features

        def counted(model_inputs, positions=None, forward=forward, seen=rows[name]):
            seen.append(model_inputs["input_ids"].shape[0])
            return forward(model_inputs, positions)

        member.features = counted
    return rows


class AdaptersOff:
    """The LoRA student's base (what the 'self' teacher is), called like a model."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, **inputs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**inputs)


def test_the_students_own_base_routed_beside_a_teacher_on_its_samples(tiny_pair, tmp_path):
    """'self' as one of several teachers (a LoRA student): on every step's samples the KD is each row's own teacher's
    reverse KL from the models' own logits (the base: the student with its adapters off), the base runs on its own
    rows only, and its part is 0 on the first step (LoRA starts as the identity) and not after."""
    from peft import LoraConfig

    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                                 save_strategy="no", use_cpu=True, kd_temperature_scaling=False, learning_rate=5e-2,
                                 teachers=[f"a={tiny_pair['teacher']}", "base=self"], **ON_POLICY)
    trainer = DistillationTrainer(tiny_pair["student"], args=DistillationConfig(**settings),
                                  train_dataset=dataset(["a", "base"]),
                                  processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]),
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    forwards = counting_forwards(trainer)
    checks, compute_loss = [], trainer.compute_loss

    def checked(model, inputs, return_outputs=False, num_items_in_batch=None):
        teachers = [trainer.teacher.members["a"].module, AdaptersOff(trainer.model)]
        with torch.no_grad():
            expected, _ = formula(trainer, dict(inputs), teachers, "reverse_kl")
        calls, route = len(forwards["base"]), extras_of(inputs).route.tolist()
        loss, outputs = compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        checks.append((outputs["kd_loss"].item(), expected.item(), forwards["base"][calls:], max(route.count(1), 1)))
        return (loss, outputs) if return_outputs else loss

    trainer.compute_loss = checked
    history = trained(trainer)
    assert len(checks) == 3
    for kd, expected, ran, rows in checks:
        assert kd == pytest.approx(expected, rel=1e-4, abs=1e-9)
        assert ran == [rows]
    base = logged(history, "kd_loss/base")
    assert base[1] == 0.0 and base[3] > 0


def test_on_policy_routed_losses_are_each_teacher_on_its_own_rows_at_every_step(tiny_pair, second_teacher, tmp_path):
    """Every step's sampled batch: each teacher's part of the logged KD is that teacher alone on its rows of the
    student's samples (1e-6), and the reverse KL from both models' own logits (float64); each teacher's forward ran
    on its rows only (an idle row when it has none)."""
    paths = {"a": tiny_pair["teacher"], "b": second_teacher}
    trainer = trainer_for(tiny_pair, tmp_path, dataset(["a", "b", "b"]), max_steps=4,
                          teachers=[f"{name}={path}" for name, path in paths.items()], **ON_POLICY)
    alone = {name: trainer_for(tiny_pair, tmp_path / name, dataset(), teacher_model_name_or_path=path, **ON_POLICY)
             for name, path in paths.items()}
    for single in alone.values():
        single.get_train_dataloader()  # prepares its teacher
        single.current_gradient_accumulation_steps = 1
    forwards = counting_forwards(trainer)
    checks, compute_loss = [], trainer.compute_loss

    def checked(model, inputs, return_outputs=False, num_items_in_batch=None):
        teachers = [member.module for member in trainer.teacher.members.values()]
        route = extras_of(inputs).route
        with torch.no_grad():
            expected, parts = formula(trainer, dict(inputs), teachers, "reverse_kl")
            own = {name: alone[name].compute_loss(model, {k: v[route == i] for k, v in inputs.items() if k != EXTRAS},
                                                  return_outputs=True)[1]["kd_loss"].item()
                   for i, name in enumerate(paths) if (route == i).any()}
        tokens = loss_tokens(inputs)[1].sum(1)
        shares = {name: int(tokens[route == i].sum()) / int(tokens.sum()) for i, name in enumerate(paths)}
        calls = {name: len(seen) for name, seen in forwards.items()}
        loss, outputs = compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        ran = {name: seen[calls[name]:] for name, seen in forwards.items()}
        checks.append((outputs["kd_loss"].item(), expected.item(), trainer.teacher.kd_parts(), parts, own, shares,
                       route.tolist(), ran))
        return (loss, outputs) if return_outputs else loss

    trainer.compute_loss = checked
    history = trained(trainer)
    assert [h["on_policy_fraction"] for h in history if "on_policy_fraction" in h] == [1.0] * 4
    assert len(checks) == 4
    for kd, expected, counted, parts, own, shares, route, ran in checks:
        assert kd == pytest.approx(expected, rel=1e-4)  # fp32 against float64 (a KL of close distributions)
        total = sum(float(part) for part, _ in counted.values())
        for i, name in enumerate(paths):
            mine = kd * float(counted[name][0]) / total
            assert mine == pytest.approx(parts[i].item(), rel=1e-4, abs=1e-9)
            assert mine == pytest.approx(own.get(name, 0.0) * shares[name], rel=1e-6, abs=1e-12), name
            assert ran[name] == [max(route.count(i), 1)], (name, route, ran)  # one forward, on its own rows
    assert sorted({i for *_, route, _ in checks for i in route}) == [0, 1]
    for step, kd in logged(history, "kd_loss").items():
        assert logged(history, "kd_loss/a")[step] + logged(history, "kd_loss/b")[step] == pytest.approx(kd, rel=1e-6)


def test_the_once_per_step_pass_runs_each_teacher_on_its_own_rows(tiny_pair, second_teacher, tmp_path):
    """Off the policy, the teacher runs once per optimizer step: each routed teacher over its own rows of the step's
    micro-batches only, its losses as before (the whole batch through both teachers)."""
    teachers = [f"a={tiny_pair['teacher']}", f"b={second_teacher}"]
    stepped = trainer_for(tiny_pair, tmp_path / "step", dataset(["a", "b", "b"]), teachers=teachers,
                          gradient_accumulation_steps=2, per_device_train_batch_size=3)
    forwards = counting_forwards(stepped)
    history = trained(stepped)
    assert len(forwards["a"]) == len(forwards["b"]) == 3  # one forward per optimizer step each
    # 3 steps of 2 micro-batches of 3 rows: each row through its own teacher (an idle row for a micro-batch without
    # one of the teacher's rows), not all 18 through both
    assert sum(forwards["a"]) + sum(forwards["b"]) <= 18 + 6
    plain = trained(trainer_for(tiny_pair, tmp_path / "plain", dataset(["a", "b", "b"]), teachers=teachers,
                                gradient_accumulation_steps=2, per_device_train_batch_size=3,
                                teacher_step_pass=False))
    assert_same_losses(history, plain, rel=1e-5)


def test_trl_teacher_id_column_routes_as_ours(tiny_pair, second_teacher, tmp_path):
    teachers = [f"a={tiny_pair['teacher']}", f"b={second_teacher}"]
    ours = trained(trainer_for(tiny_pair, tmp_path / "ours", dataset(["a", "b", "b"]), teachers=teachers))
    trl = dataset(["a", "b", "b"]).rename_column("teacher", "teacher_id")
    theirs = trained(trainer_for(tiny_pair, tmp_path / "trl", trl, teachers=teachers))
    assert_same_losses(theirs, ours)
    assert logged(theirs, "teacher_tokens/b")[1] > 0


def test_resuming_with_another_set_of_teachers_is_one_line(tiny_pair, second_teacher, tmp_path):
    teachers = [f"a={tiny_pair['teacher']}", f"b={second_teacher}"]
    trained(trainer_for(tiny_pair, tmp_path, dataset(["a", "b"]), teachers=teachers, max_steps=1,
                        save_strategy="steps", save_steps=1))
    swapped = [f"a={second_teacher}", f"b={tiny_pair['teacher']}"]
    trainer = trainer_for(tiny_pair, tmp_path, dataset(["a", "b"]), teachers=swapped, max_steps=2,
                          save_strategy="steps", save_steps=1)
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    message = str(error.value)
    assert "\n" not in message and "other distillation settings (teacher:" in message
    assert f"a={tiny_pair['teacher']},b={second_teacher} (route)" in message and "--resume_allow_changes" in message


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_kd=True), "seq_kd samples the completions from the teacher, and several teach"),
    (dict(lmbda=0.5), "and the teachers ['c'] are caches of the dataset's completions only"),
])
def test_what_several_teachers_on_policy_cannot_do_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError) as error:
        resolve(DistillationConfig(output_dir=str(tmp_path), teachers=["a=./a", "c=cache:./c"], **overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def rows_sent(member) -> list[int]:
    """The rows of each request a served teacher sends (recorded as it is asked)."""
    sent, ask = [], member.request

    def counted(batch, *args):
        sent.append(len(batch["input_ids"]))
        return ask(batch, *args)

    member.request = counted
    return sent


def test_a_served_teacher_scores_its_rows_of_the_students_samples(served, tmp_path):
    """Routed live + served on the student's samples: the server is asked for the served teacher's own rows only,
    its part is the served teacher alone on its rows of the same samples (its top-64, fetched for the sampled rows);
    the live one's is the formula on its rows."""
    pair = {"student": served["student"], "tokenizer": served["teacher"]}
    common = dict(temperature=1.0, max_length=64, **ON_POLICY)
    panel = trainer_for(pair, tmp_path / "panel", dataset(["live", "srv"]), teachers=[
        f"live={served['teacher']}", f"srv={served['url']}"], **common)
    alone = trainer_for(pair, tmp_path / "alone", dataset(), teacher_server=served["url"], **common)
    sent = rows_sent(panel.teacher.members["srv"])
    batch = panel._prepare_inputs(next(iter(panel.get_train_dataloader())))
    alone.get_train_dataloader()
    route = extras_of(batch).route
    assert sent[0] == int((route == 1).sum())  # the dataset's rows: its own only (the loader may collate ahead)
    before = len(sent)
    sampled, _ = panel.sampler.sample(STUDENT, batch)
    assert side_channels(batch) == side_channels(sampled) == [EXTRAS]  # the route and the server's signal, in one key
    route = extras_of(sampled).route.clone()
    assert sorted(set(route.tolist())) == [0, 1]
    assert sent[before:] == [int((route == 1).sum())]  # the samples: its own only
    mine = {k: v[route == 1] for k, v in sampled.items() if k in ("input_ids", "attention_mask", "labels")}
    alone.teacher.score_sampled(mine)
    panel.model.train(), alone.model.train()
    panel.current_gradient_accumulation_steps = alone.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        _, out = panel.compute_loss(panel.model, dict(sampled), return_outputs=True)
        _, out_alone = alone.compute_loss(alone.model, mine, return_outputs=True)
    parts = panel.teacher.kd_parts()
    total = sum(float(part) for part, _ in parts.values())
    share = {name: out["kd_loss"].item() * float(part) / total for name, (part, _) in parts.items()}
    n, n_srv = int(loss_tokens(sampled)[1].sum()), int(loss_tokens(mine)[1].sum())
    assert share["srv"] == pytest.approx(out_alone["kd_loss"].item() * n_srv / n, rel=1e-5)
    with torch.no_grad():  # (the formula's second part would be the served model's full distribution: not used)
        expected_live = formula(panel, sampled, [panel.teacher.members["live"].module, served["model"]],
                                "reverse_kl")[1]
    assert share["live"] == pytest.approx(expected_live[0].item(), rel=1e-5)


@pytest.mark.distributed
def test_two_zero3_teachers_on_the_students_samples_on_two_processes(tiny_pair, second_teacher, tmp_path):
    """ZeRO-2 student, teachers a and b each partitioned over 2 ranks (ZeRO-3), every step on the student's samples:
    on each rank each teacher's forward ran once per micro-batch, on that rank's rows of it (an idle row when it has
    none: the ranks' gathers stay matched), and both ranks log the same reduced values."""
    launch(WORKER, str(Path(tiny_pair["teacher"]).parent), second_teacher, str(tmp_path), "on-policy", timeout=300)
    records = read_rank_records(tmp_path)
    for rec in records:
        assert rec["plugins"] == ["student", "teacher:a", "teacher:b"]
        assert len(rec["micro_batches"]) == 4  # 2 steps of 2 micro-batches
        for micro in rec["micro_batches"]:
            for i, name in enumerate(("a", "b")):
                assert micro["ran"][name] == [max(micro["route"].count(i), 1)], micro
        entries = [h for h in rec["log_history"] if "kd_loss" in h and "train_runtime" not in h]
        assert [h["on_policy_fraction"] for h in entries] == [1.0, 1.0]
        for entry in entries:
            assert entry["kd_loss/a"] + entry["kd_loss/b"] == pytest.approx(entry["kd_loss"], rel=1e-6)
            assert entry["kd_loss"] > 0
    routes = [m["route"] for rec in records for m in rec["micro_batches"]]
    assert any(r.count(0) == 0 or r.count(1) == 0 for r in routes)  # some micro-batch lacks a teacher: idle row
    steps = [[h for h in rec["log_history"] if "train_runtime" not in h] for rec in records]
    assert steps[0] == steps[1]


@pytest.mark.parametrize("combine, weights", [("mixture", [0.25, 0.75]), ("sum", [1.0, 2.0])])
def test_mixed_and_summed_teachers_on_the_students_samples_are_their_formulas(tiny_pair, second_teacher, tmp_path,
                                                                             combine, weights):
    trainer = trainer_for(tiny_pair, tmp_path, dataset(), teachers=[f"a={tiny_pair['teacher']}", f"b={second_teacher}"],
                          teacher_combine=combine, teacher_weights=weights, **ON_POLICY)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    sampled, completions = trainer.sampler.sample(STUDENT, batch)
    assert not torch.equal(sampled["input_ids"][:, :batch["input_ids"].shape[1]], batch["input_ids"])
    teachers = [member.module for member in trainer.teacher.members.values()]
    with torch.no_grad():
        expected, _ = formula(trainer, sampled, teachers, "reverse_kl")
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        _, outputs = trainer.compute_loss(trainer.model, dict(sampled), return_outputs=True)
    assert outputs["kd_loss"].item() == pytest.approx(expected.item(), rel=1e-4)


def test_a_teacher_of_another_tokenizer_routed_on_the_students_samples(tiny_pair, other_teacher, tmp_path):
    """Routed live + cross-tokenizer teacher on the student's samples: the cross-tokenizer teacher re-reads its rows
    of the samples in its own tokens (its forward on the whole batch, the loss picking its rows); every step's parts
    add up to the KD and each teacher teaches its rows."""
    teachers = [f"live={tiny_pair['teacher']}", f"other={other_teacher}"]
    history = trained(trainer_for(tiny_pair, tmp_path, dataset(["live", "other"]), teachers=teachers, **ON_POLICY))
    assert [h["on_policy_fraction"] for h in history if "on_policy_fraction" in h] == [1.0] * 3
    for step, kd in logged(history, "kd_loss").items():
        parts = [logged(history, f"kd_loss/{name}")[step] for name in ("live", "other")]
        assert sum(parts) == pytest.approx(kd, rel=1e-6) and all(part > 0 for part in parts)
        assert 0 < logged(history, "teacher_tokens/other")[step] < 1
