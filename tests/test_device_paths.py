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
