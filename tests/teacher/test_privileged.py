"""A teacher that sees more than the student (`teacher_prompt`): the KD equals the divergence from
``teacher(teacher_prompt + completion).logits`` aligned on the completion, off and on the policy; a template that
gives back the prompt trains exactly as no teacher prompt; a served teacher reads its own prompt too; what cannot
combine is one line."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from transformers import AutoTokenizer

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.data.batch import extras_of, loss_tokens, take_signal
from trl_distill.rollout.sampling import STUDENT
from trl_distill.run_plan import resolve
from trl_distill.teacher.privileged import TEACHER_PROMPT
from trl_distill.testing import logged, synthetic_prompt_completion, tiny_run_settings

HINT = "{prompt} hint:{completion} =>"  # privileged: the teacher is shown the reference completion


def make(pair, tmp_path, teacher=None, peft_config=None, **overrides) -> DistillationTrainer:
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                                 save_strategy="no", use_cpu=True, kd_temperature_scaling=False, alpha=1.0,
                                 divergence="forward_kl", temperature=1.0)
    settings.update(overrides)
    return DistillationTrainer(pair["student"], teacher if teacher is not None else pair["teacher"],
                               args=DistillationConfig(**settings), train_dataset=synthetic_prompt_completion(16),
                               processing_class=AutoTokenizer.from_pretrained(pair["tokenizer"]),
                               peft_config=peft_config)


def aligned_kd(trainer, batch, teacher_model, prompts: list[list[int]]) -> torch.Tensor:
    """Forward KL per completion token from the student's logits on its row and the teacher's on teacher prompt +
    the same completion tokens, aligned token by token (float64), averaged over the tokens."""
    target, mask = loss_tokens(batch)
    total, count = 0.0, 0
    for b in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][b].sum())
        positions = mask[b].nonzero().squeeze(1)
        if not len(positions):
            continue
        start = int(positions[0]) + 1
        completion = batch["input_ids"][b, start:length]
        s_logits = trainer.model(batch["input_ids"][b:b + 1, :length]).logits[0].double()
        row = torch.cat([torch.tensor(prompts[b]), completion])[None]
        t_logits = teacher_model(row).logits[0].double()
        for position in positions.tolist():
            j = position - start + 1  # the completion token this position predicts
            s = F.log_softmax(s_logits[position], -1)
            t = F.log_softmax(t_logits[len(prompts[b]) + j - 1], -1)
            total, count = total + (t.exp() * (t - s)).sum(), count + 1
    return total / count


@pytest.mark.parametrize("on_policy", [False, True])
def test_the_kd_is_the_teachers_reading_of_its_own_prompt_aligned_on_the_completion(tiny_pair, tmp_path, on_policy):
    trainer = make(tiny_pair, tmp_path, teacher_prompt=HINT, **(dict(lmbda=1.0, max_new_tokens=6) if on_policy else {}))
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    prompts = [p.tolist() for p in extras_of(batch).teacher_prompts]
    if on_policy:
        batch, _ = trainer.sampler.sample(STUDENT, batch)
        trainer.sampler.on_policy = True
    with torch.no_grad():
        want = aligned_kd(trainer, batch, trainer.teacher.inner.module, prompts)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        _, out = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    assert out["kd_loss"].item() == pytest.approx(want.item(), rel=1e-5)
    assert max(map(len, prompts)) > int(batch["attention_mask"].sum(1).max()) // 2  # the hint made them longer


def test_the_teacher_prompt_is_each_rows_own(tiny_pair, tmp_path):
    trainer = make(tiny_pair, tmp_path, teacher_prompt=HINT)
    prepared = trainer.train_dataset
    tokenizer = trainer.processing_class
    raw = synthetic_prompt_completion(16)
    for i in range(3):  # the template reads the row as written: not the EOS SFT appended to the prepared completion
        row = prepared[i]
        assert row["completion"].endswith(tokenizer.eos_token)
        assert row[TEACHER_PROMPT] == tokenizer(HINT.format(**raw[i]))["input_ids"]
        assert tokenizer.eos_token_id not in row[TEACHER_PROMPT]  # (was: "hint: 7</s> =>", an end of text inside)


def test_the_prompt_itself_as_teacher_prompt_trains_as_without(tiny_pair, tmp_path):
    plain = make(tiny_pair, tmp_path / "plain")
    plain.train()
    same = make(tiny_pair, tmp_path / "same", teacher_prompt="prompt")  # the column: the student's own prompt
    same.train()
    for key in ("loss", "kd_loss", "ce_loss"):
        for step, value in logged(plain.state.log_history, key).items():
            assert logged(same.state.log_history, key)[step] == pytest.approx(value, rel=1e-6), (key, step)


def test_a_served_teacher_reads_its_own_prompt(served, tmp_path):
    pair = {"student": served["student"], "teacher": served["teacher"], "tokenizer": served["teacher"]}
    common = dict(max_length=64, teacher_prompt=HINT)
    srv = make(pair, tmp_path / "srv", teacher="teacher", teacher_server=served["url"], **common)  # served name
    live = make(pair, tmp_path / "live", **common)
    batch = srv._prepare_inputs(next(iter(srv.get_train_dataloader())))
    live.get_train_dataloader()
    with torch.no_grad():
        for trainer in (srv, live):
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = 1
        _, out_srv = srv.compute_loss(srv.model, dict(batch), return_outputs=True)
        take_signal(batch)
        _, out_live = live.compute_loss(live.model, dict(batch), return_outputs=True)
    # the server's top-64 buckets of the same teacher reading the same teacher rows: a lower bound of its full KL,
    # close to it for this peaked teacher
    assert 0 < out_srv["kd_loss"].item() <= out_live["kd_loss"].item() * (1 + 1e-4)
    assert out_srv["kd_loss"].item() > 0.5 * out_live["kd_loss"].item()


@pytest.mark.parametrize("overrides, message", [
    (dict(packing=True), "rows cannot be packed"),
    (dict(teachers=["a=./a", "b=./b"], teacher_model_name_or_path=None), "it takes one teacher"),
    (dict(seq_kd=True), "set seq_kd=False"),
])
def test_what_cannot_combine_is_one_line(tmp_path, overrides, message):
    settings = {"output_dir": str(tmp_path), "teacher_prompt": HINT, "teacher_model_name_or_path": "./t", **overrides}
    with pytest.raises(ValueError) as error:
        resolve(DistillationConfig(**settings))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_missing_column_and_the_self_teacher_are_one_line(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match=r"--teacher_prompt 'golden' names a column the train dataset does not have"):
        make(tiny_pair, tmp_path, teacher_prompt="golden")
    with pytest.raises(ValueError, match=r"or a served one, not 'self' or a cache"):
        make(tiny_pair, tmp_path, teacher="self", teacher_prompt=HINT,
             peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


def test_a_whole_number_read_as_a_float_is_written_as_the_file_wrote_it(tiny_pair, tmp_path):
    """A JSON column of numbers with one fraction loads 3 as 3.0: the teacher reads 'The answer is 3.' (was: '3.0.')."""
    data = synthetic_prompt_completion(16)
    data = data.add_column("answer", [2.5] + [float(i) for i in range(1, 16)])
    settings = tiny_run_settings(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1,
                                 save_strategy="no", use_cpu=True, teacher_prompt="{prompt} The answer is {answer}.")
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair["tokenizer"])
    trainer = DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=DistillationConfig(**settings),
                                  train_dataset=data, processing_class=tokenizer)
    prompts = trainer.train_dataset[TEACHER_PROMPT]
    assert prompts[0] == tokenizer(f"{data[0]['prompt']} The answer is 2.5.")["input_ids"]
    assert prompts[3] == tokenizer(f"{data[3]['prompt']} The answer is 3.")["input_ids"]
