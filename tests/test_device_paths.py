"""The paths that must run on a GPU, checked on this CPU with tensors that behave like a GPU's (tests/device_sim.py:
values on the host, CUDA's errors for `.numpy()` of them and for ops that mix them with host tensors).

The simulator is checked first against what CUDA refuses; then each path, with its inputs where training puts them
(the collated batch prepared onto the device, a served signal popped onto it)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from device_sim import DEVICE, on_device, to_device  # tests/ is on sys.path

# ---- The simulator refuses what CUDA refuses, and computes the rest ----


def test_device_tensors_compute_on_the_host_and_refuse_what_cuda_refuses():
    values = torch.arange(6.0).reshape(2, 3)
    stray = torch.empty(2, 3, device="meta")  # made outside the simulator: no values
    with on_device():
        x = to_device(values)
        assert x.device == DEVICE and (x * 2 + torch.tensor(1.0)).tolist() == (values * 2 + 1).tolist()  # 0-dim: ok
        made = torch.zeros(3, device=x.device)
        made[1] = 5
        assert made.device == DEVICE and made.tolist() == [0.0, 5.0, 0.0]
        assert torch.tensor([1, 2], device=DEVICE).device == DEVICE  # built below the dispatcher: made ours too
        assert x[torch.tensor([1])].tolist() == [[3.0, 4.0, 5.0]]  # host indices: CUDA takes them
        back = x.cpu()
        assert type(back) is torch.Tensor and torch.equal(back, values) and int(x.sum()) == 15
        with pytest.raises(TypeError, match="can't convert meta device type tensor to numpy. Use Tensor.cpu()"):
            x.numpy()
        with pytest.raises(TypeError, match="to numpy"):
            np.asarray(x)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            x + torch.ones(3)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            x.index_select(0, torch.tensor([0]))
        with pytest.raises(RuntimeError, match="device type for generator but found 'cpu'"):
            torch.randint(0, 5, (3,), generator=torch.Generator(), device=DEVICE)
        assert x.new_tensor([1, 3]).device == DEVICE
        with pytest.raises(RuntimeError, match="without values"):  # a gap of the simulator is loud, never garbage
            x + stray
        weight = to_device(torch.tensor([1.0, -2.0], requires_grad=True))
        (weight * weight).sum().backward()
        assert weight.grad.tolist() == [2.0, -4.0]


# ---- The teacher cache written from a served teacher ----


def _fake_served_teacher(top_k: int, vocab: int):
    """A `ServedTeacher` whose server answers from a formula (no HTTP): position t of a row of length L gets ids
    ``(t + j) % vocab`` and log-probs ``-(t + 1) / 10 - j``, tail ``-5 - t``."""
    from trl_distill.teacher.served import ServedTeacher

    def top_k_arrays(rows, k, stop=None):
        out = []
        for ids in rows:
            t = np.arange(len(ids) - 1)[:, None]
            j = np.arange(k)[None, :]
            out.append(((t + j) % vocab, (-(t + 1) / 10 - j).astype(np.float64), -5.0 - t[:, 0]))
        return out

    teacher = ServedTeacher("http://127.0.0.1:9", "teacher", top_k=top_k)
    teacher.client.top_k_arrays = top_k_arrays
    teacher.vocab_size = vocab
    return teacher


def test_the_served_teachers_cache_records_read_a_batch_collated_onto_the_device():
    """`cache-teacher --teacher_server`: each record's positions and top-k come back to the host as numpy, whatever
    device the run's collator hands its batch over on (they were `.numpy()` of it: CUDA's TypeError)."""
    from trl_distill.teacher.served import ServedTeacherCollator

    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [5, 9, 9], "labels": [-100, 9, 9]}]
    teacher = _fake_served_teacher(top_k=3, vocab=16)

    def onto_the_device(examples):  # a caller's collator that places its batch on the GPU
        width = max(len(e["input_ids"]) for e in examples)
        pad = {"input_ids": 0, "labels": -100, "attention_mask": 0}
        batch = {key: torch.tensor([e.get(key, [1] * len(e["input_ids"])) + [fill] * (width - len(e["input_ids"]))
                                    for e in examples], device=DEVICE) for key, fill in pad.items()}
        return batch

    teacher.context = SimpleNamespace(collate=ServedTeacherCollator(onto_the_device, teacher))
    try:
        with on_device():
            records = teacher.cache_records(rows, [range(0, 2)], 1, range(0, 2), 3, 1.0)
    finally:
        teacher.close()
    assert [r["row"] for r in records] == [0, 1]
    for record, want_positions in zip(records, ([1, 2], [0, 1]), strict=True):
        assert all(isinstance(record[key], np.ndarray) for key in ("positions", "top_k_ids", "tail_log_prob"))
        assert record["positions"].tolist() == want_positions
        t = np.asarray(want_positions)[:, None]
        assert record["top_k_ids"].tolist() == ((t + np.arange(3)) % 16).tolist()
        np.testing.assert_allclose(record["top_k_log_probs"], -(t + 1) / 10 - np.arange(3), rtol=1e-6)
        np.testing.assert_allclose(record["tail_log_prob"], -5.0 - t[:, 0])


# ---- Paths audited on the device: each gives there what it gives on the host ----


def _both(run, *inputs):
    """`run(*inputs)` on the host, and again under the simulator with every tensor of `inputs` on the device; both
    results as nested lists (`run` returns tensors, or lists / tuples / dicts of them)."""

    def read(value):
        if isinstance(value, torch.Tensor):
            return value.cpu().tolist()
        if isinstance(value, dict):
            return {k: read(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [read(v) for v in value]
        return value

    def place(value):
        if isinstance(value, torch.Tensor):
            return to_device(value)
        return type(value)(place(v) for v in value) if isinstance(value, (list, tuple)) else value

    torch.manual_seed(0)
    host = read(run(*inputs))
    torch.manual_seed(0)
    with on_device():
        device = read(run(*(place(x) for x in inputs)))
    return host, device


@pytest.mark.parametrize("objective", ["divergence", "sampled_token"])
def test_the_cross_tokenizer_teachers_rows_and_signal_on_the_device(objective):
    """Its groups' states laid onto the loss rows, the per-group loss and metrics, and (sampled-token) each sampled
    token's share of its group's log-prob, from a cross-tokenizer batch prepared onto the device."""
    from trl_distill.cross_tokenizer.loss import CrossTokenizerLoss
    from trl_distill.cross_tokenizer.vocabulary import SharedVocabulary
    from trl_distill.loss.diagnostics import LossDiagnostics
    from trl_distill.loss.settings import LossSettings
    from trl_distill.teacher.cross_tokenizer import CrossTokenizerTeacher

    vocab = 8

    class Teacher(CrossTokenizerTeacher):  # its states: seeded random logits at the positions asked for
        def __init__(self):
            shared = SharedVocabulary(torch.arange(6), torch.arange(6), torch.tensor([6, 7]), torch.tensor([6, 7]))
            self.loss = CrossTokenizerLoss(shared)
            self.context = SimpleNamespace(plan=SimpleNamespace(on_policy=SimpleNamespace(objective=objective)))

        def features(self, inputs, positions):
            logits = torch.randn(2, 16, vocab)
            return SimpleNamespace(states=logits.to(positions.device)[:, positions], head=None)

    def run(teacher_ids, groups, lengths, mask, keep, student_logits):
        rows = Teacher().teacher_rows((teacher_ids, teacher_ids > 0, groups, [[1], [2]], lengths), mask, keep)
        signal, settings = rows.signal(None, 4, LossSettings()), LossSettings()
        chunk = signal.chunk(slice(0, 4), torch.float32)
        metrics = LossDiagnostics(student_logits.device)
        signal.observe(metrics, slice(0, 4), student_logits, chunk, None, settings)
        signal.observe_batch(metrics)
        picked = rows.signal(None, 4, settings, picks=keep.new_tensor([1, 3]))
        out = {"is_group": rows.is_group, "loss": signal.per_token(student_logits.log_softmax(-1), chunk, settings),
               "metrics": metrics.sums, "picked": picked.chunk(slice(0, 2), torch.float32)[1]}
        if lengths is not None:
            out["token_logp"] = signal.token_log_probs(chunk, None).nan_to_num(-1.0)
        return out

    groups = torch.tensor([[0, 4, 10], [0, 5, 11], [0, 7, 12], [1, 4, 13], [1, 5, 14]])
    lengths = torch.tensor([[1, 1], [1, 2], [1, 1], [2, 1], [1, 1]]) if objective == "sampled_token" else None
    mask = torch.tensor([[True, False, True], [False, True, True]])
    host, device = _both(run, torch.arange(32).reshape(2, 16) % 7, groups, lengths, mask, torch.tensor([3, 4, 5]),
                         torch.randn(4, vocab))
    assert host["is_group"] == [False, True, True, True] and device == host


@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_the_sampled_token_objective_on_the_device(discount):
    """Rewards, discounted advantages, the task reward's baseline (rewards scored on the host) and the clipped
    surrogate, over a live teacher's rows on the device."""
    from trl_distill.loss.dense import DenseTeacherSignal
    from trl_distill.loss.sampled_token import SampledTokenJob, SampledTokenSettings, sampled_token_signal
    from trl_distill.loss.settings import LossSettings

    vocab, width = 10, 4

    def run(teacher_states, states, rows, labels, old):
        teacher = DenseTeacherSignal(teacher_states, None, vocab, 1.0)
        job = SampledTokenJob(SampledTokenSettings(discount=discount), torch.tensor([1.0, 0.0], dtype=torch.float64))
        signal = sampled_token_signal(teacher, job, rows, labels, width, states, None, vocab, 4, old)
        chunk = signal.chunk(slice(0, 6), torch.float32)
        return signal.per_token(states.index_select(0, rows).log_softmax(-1), chunk, LossSettings()), list(
            job.stats.values())

    host, device = _both(run, torch.randn(6, vocab), torch.randn(8, vocab), torch.tensor([1, 2, 3, 5, 6, 7]),
                         torch.randint(0, vocab, (6,)), torch.randn(6))
    assert device == host


def test_several_teachers_routed_and_summed_on_the_device():
    """Routed: the rows' order and each teacher's edges, its chunks, parts and metrics (a teacher with no rows
    among them); summed and mixed: their per-token losses."""
    from trl_distill.loss.combined import MixtureSignal, RoutedSignal, SumSignal, routed_order
    from trl_distill.loss.dense import DenseTeacherSignal
    from trl_distill.loss.diagnostics import LossDiagnostics
    from trl_distill.loss.settings import LossSettings

    vocab, settings = 10, LossSettings()

    def run(route, first, second, logits, labels):
        order, bounds = routed_order(route, 3)
        teachers = [DenseTeacherSignal(s, None, vocab, 1.0) for s in (first, second, first[:0])]
        routed, metrics, kd = RoutedSignal(teachers, order, bounds), LossDiagnostics(logits.device), []
        for part in (slice(0, 3), slice(3, 6)):
            chunk = routed.chunk(part, torch.float32)
            routed.observe(metrics, part, logits[part], chunk, labels[part], settings)
            kd.append(routed.per_token(logits[part].log_softmax(-1), chunk, settings))
            routed.tally(part, kd[-1].sum())
        routed.observe_batch(metrics)
        pair = [DenseTeacherSignal(s, None, vocab, 1.0) for s in (first, second)]
        summed, mixed = SumSignal(pair, [0.3, 0.7]), MixtureSignal(pair, [0.3, 0.7])
        return (order, bounds, kd, routed.parts[:2], metrics.sums,
                summed.per_token(logits[:3].log_softmax(-1), summed.chunk(slice(0, 3), torch.float32), settings),
                mixed.per_token(logits[:3].log_softmax(-1), mixed.chunk(slice(0, 3), torch.float32), settings))

    host, device = _both(run, torch.tensor([1, 0, 1, 0, 0, 1]), torch.randn(3, vocab), torch.randn(3, vocab),
                         torch.randn(6, vocab), torch.randint(0, vocab, (6,)))
    assert host[1] == [0, 3, 6, 6] and device == host


def test_teacher_rows_of_a_batch_on_the_device():
    """A teacher prompt's rows (its prompts stay on the host), a served teacher's request rows and a routed
    teacher's own rows, from a batch prepared onto the device."""
    from trl_distill.data.batch import EXTRAS, MicroBatchExtras
    from trl_distill.teacher.base import TeacherSource
    from trl_distill.teacher.panel import own_rows
    from trl_distill.teacher.privileged import PrivilegedTeacher, teacher_rows
    from trl_distill.teacher.served import loss_rows

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]  # host tensors, as the collator made them

    class Inner(TeacherSource):  # the core only: no collator of its own (its `pop_batch` is never asked)
        def for_batch(self, inputs, own, mask, keep):
            return SimpleNamespace(inputs=inputs, mask=mask, keep=keep)

        def pop_batch(self, inputs):
            return None

        refused = {}

    privileged = PrivilegedTeacher(Inner(), "teacher_prompt", SimpleNamespace(pad_token_id=0))

    def run(ids, attention, labels):
        batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
        mask, keep = labels[:, 1:] != -100, torch.arange(ids.shape[1] - 1, device=ids.device)
        popped = {"labels": labels, EXTRAS: MicroBatchExtras(teacher_prompts=prompts)}
        extras = privileged.pop_batch(popped)  # as the trainer pops them: the prompts, the completions' starts
        shifted = privileged.for_batch({"input_ids": ids, "attention_mask": attention}, extras, mask, keep)
        served_rows, positions = loss_rows(batch)
        return (teacher_rows(batch, prompts, 0), shifted.inner.inputs, shifted.mask, served_rows,
                [p.tolist() for p in positions], own_rows(batch, ids[:, 1] == 9), own_rows(batch, ids[:, 0] == 0))

    host, device = _both(run, torch.tensor([[5, 6, 7, 8, 0], [5, 9, 9, 0, 0]]),
                         torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
                         torch.tensor([[-100, -100, 7, 8, -100], [-100, 9, 9, -100, -100]]))
    assert host[0]["input_ids"] == [[1, 2, 3, 7, 8], [4, 9, 9, 0, 0]] and device == host


def test_sampled_rows_rendered_for_a_teacher_of_another_tokenizer_on_the_device():
    """The student's samples (on the device) re-rendered and aligned for a teacher of another tokenizer: its ids and
    groups land on the samples' device, the same as from host rows."""
    from trl_distill.data.batch import EXTRAS, CrossTokenizerBatch, MicroBatchExtras, extras_of
    from trl_distill.teacher.cross_tokenizer import CrossTokenizerTeacher
    from trl_distill.testing import build_sentencepiece_style_tokenizer, build_tokenizer

    student, other = build_tokenizer(), build_sentencepiece_style_tokenizer(vocab_size=300)
    teacher = CrossTokenizerTeacher.__new__(CrossTokenizerTeacher)  # its tokenizers and settings only
    teacher.student_tokenizer, teacher.teacher_tokenizer = student, other
    teacher.settings = SimpleNamespace(max_length=64, prompt=None)
    teacher.sampled_rows = {"rows": 0, "unaligned": 0}
    prompt, completion = student("the cat sat")["input_ids"], student(" on the mat")["input_ids"]
    cross = CrossTokenizerBatch(None, None, None, [other("the cat sat")["input_ids"]], None)
    source = {EXTRAS: MicroBatchExtras(cross_tokenizer=cross)}

    def run(ids, labels):
        batch = {"input_ids": ids, "labels": labels}
        teacher.score_sampled(batch, source)
        cross = extras_of(batch).cross_tokenizer
        assert all(x.device == ids.device for x in cross if isinstance(x, torch.Tensor))
        return tuple(cross)

    host, device = _both(run, torch.tensor([prompt + completion + [student.eos_token_id]]),
                         torch.tensor([[-100] * len(prompt) + completion + [student.eos_token_id]]))
    assert len(host[2]) > 2 and device == host


def test_the_generation_eval_of_completions_sampled_on_the_device():
    """Completions and the teacher's scores of them on the device: the eval's counts, verifiers and teacher NLL are
    the host's."""
    from datasets import Dataset

    from trl_distill.evaluation.generation import EvalSettings, GenerationEvaluation
    from trl_distill.evaluation.verifiers import resolve_verifiers
    from trl_distill.loss.diagnostics import LossDiagnostics
    from trl_distill.rollout.sampling import Sampling
    from trl_distill.testing import build_tokenizer

    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
    answer = tokenizer("2")["input_ids"] + [tokenizer.eos_token_id]

    def run(device):
        settings = EvalSettings(resolve_verifiers(["last_number"], "answer", None), "answer", 2,
                                Sampling(4, 1.0, 1.0, None), 1, None, 0)

        def sample(batch, sampling):
            return batch, [torch.tensor(answer, device=device) for _ in range(len(batch["input_ids"]))]

        def score(batch):
            scored = LossDiagnostics(device)
            scored.add("teacher_ce", torch.tensor([1.5, 2.5], device=device))
            return scored

        def collate(rows):
            return {"input_ids": torch.ones(len(rows), 2, dtype=torch.long, device=device)}

        evaluation = GenerationEvaluation(settings, tokenizer, 0, 1, collate, sample, score, lambda t: t, False)
        metrics = evaluation.run(dataset)
        metrics.pop("generation_runtime")
        return metrics

    host = run("cpu")
    with on_device():
        device = run(DEVICE)
    assert host["pass@1"] == 0.5 and host["teacher_nll"] == 2.0 and device == host
