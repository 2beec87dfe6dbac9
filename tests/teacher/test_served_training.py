"""A teacher served by a real vLLM server (the session fixture `served`): `cache-teacher --teacher_server` writes the
cache the ZeRO-3 teacher writes, and training against the live server computes the losses training from either
cache computes."""

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from oracles import write_teacher_cache  # tests/ is on sys.path

from trl_distill import DistillationConfig, DistillationTrainer
from trl_distill.cache.shards import flat, read_shard
from trl_distill.teacher import ServedTeacher
from trl_distill.teacher.served import loss_rows
from trl_distill.testing import launch, logged, synthetic_prompt_completion

ROOT = Path(__file__).parents[2]
K = 8
ROWS = 24


def run_config(tmp: Path, name: str, **overrides) -> DistillationConfig:
    kwargs = dict(output_dir=str(tmp / "runs" / name), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
                  learning_rate=2e-3, lr_scheduler_type="constant", seed=0, alpha=0.5, max_length=64, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True)
    return DistillationConfig(**{**kwargs, **overrides})


def read_cache(directory: Path) -> dict:
    manifest = json.loads((directory / "manifest.json").read_text())
    tables = [read_shard(str(directory / shard["file"])) for shard in sorted(manifest["shards"],
                                                                             key=lambda s: s["index"])]
    columns = {name: np.concatenate([np.asarray(flat(t.column(name))) for t in tables])
               for name in ("positions", "top_k_ids", "top_k_log_probs", "tail_log_prob")}
    rows = np.concatenate([t.column("row").to_numpy() for t in tables])
    return {"manifest": manifest, "row": rows, **columns}


def recorded(events: list, name: str, function):
    def call(*args, **kwargs):
        events.append(name)
        return function(*args, **kwargs)

    return call


@pytest.fixture(scope="module")
def caches(served, tmp_path_factory):
    """The same k = 8 float32 cache written twice by the CLI, on 2 processes each: from the ZeRO-3 teacher
    (DeepSpeed on CPU) and from the vLLM server (3 requests in flight per process)."""
    tmp = tmp_path_factory.mktemp("served_caches")
    data = tmp / "data.jsonl"
    synthetic_prompt_completion(ROWS).to_json(data)
    common = ["--model_name_or_path", served["student"], "--dataset_name", str(data), "--bf16", "false",
              "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true", "--max_length",
              "64", "--cache_top_k", str(K), "--cache_shard_rows", "8", "--cache_batch_size", "3",
              "--cache_log_prob_dtype", "float32"]
    launch("trl_distill", "cache-teacher", *common, "--teacher_model_name_or_path", served["teacher"], "--deepspeed",
           str(ROOT / "configs/deepspeed/zero2_student.json"), "--teacher_cache", str(tmp / "zero3"),
           launcher_args=("-m",), timeout=300)
    result = launch("trl_distill", "cache-teacher", *common, "--teacher_server", served["url"],
                    "--teacher_model_name_or_path", "teacher", "--teacher_server_concurrency", "3", "--teacher_cache",
                    str(tmp / "server"), launcher_args=("-m",), timeout=300)
    assert "Teacher cache written to" in result.stdout
    return {"tmp": tmp, "zero3": tmp / "zero3", "server": tmp / "server"}


def test_the_server_written_cache_equals_the_zero3_written_one(caches):
    zero3, server = read_cache(caches["zero3"]), read_cache(caches["server"])
    settings = ("tokenizer_hash", "vocab_size", "top_k", "temperature", "max_length", "log_prob_dtype",
                "dataset_fingerprint", "num_rows", "shard_rows", "complete")
    assert {k: server["manifest"][k] for k in settings} == {k: zero3["manifest"][k] for k in settings}
    assert server["manifest"]["teacher"] == "teacher" and server["manifest"]["complete"]
    assert [s["tokens"] for s in server["manifest"]["shards"]] == [s["tokens"] for s in zero3["manifest"]["shards"]]
    for name in ("row", "positions", "top_k_ids"):  # the same loss tokens, and the same top-k ids in the same order
        assert np.array_equal(server[name], zero3[name]), name
    assert len(zero3["tail_log_prob"]) == sum(s["tokens"] for s in zero3["manifest"]["shards"]) > 300
    np.testing.assert_allclose(server["top_k_log_probs"], zero3["top_k_log_probs"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.exp(server["tail_log_prob"]), np.exp(zero3["tail_log_prob"]), atol=1e-4, rtol=0)


def test_students_from_either_cache_and_from_the_live_server_get_the_same_losses(served, caches):
    tmp, data = caches["tmp"], synthetic_prompt_completion(ROWS)
    losses, events = {}, []
    runs = {"zero3": dict(teacher_cache=str(caches["zero3"])), "server": dict(teacher_cache=str(caches["server"])),
            "live": dict(teacher_server=served["url"], teacher_server_top_k=K)}
    for name, teacher in runs.items():
        trainer = DistillationTrainer(served["student"], args=run_config(tmp, name, **teacher), train_dataset=data)
        if name == "live":  # record when each batch's request goes out and when its loss is computed
            assert isinstance(trainer.teacher, ServedTeacher) and trainer.teacher.name == "teacher"
            trainer.teacher.request = recorded(events, "request", trainer.teacher.request)
            trainer.compute_loss = recorded(events, "loss", trainer.compute_loss)
        trainer.train()
        losses[name] = {key: logged(trainer.state.log_history, key) for key in ("loss", "kd_loss", "ce_loss")}
    assert list(losses["zero3"]["loss"]) == [1, 2, 3, 4] and losses["zero3"]["kd_loss"][1] > 0.1
    for name in ("server", "live"):
        for key, want in losses["zero3"].items():
            got = losses[name][key]
            assert list(got) == list(want) and max(abs(got[s] - want[s]) for s in want) <= 1e-4, (name, key, got, want)
    # the next batch's request is out before this batch's loss: the answer arrives while the student computes
    assert events[:3] == ["request", "request", "loss"] and events.count("loss") == 4


def torch_calls_on(prefix: str):
    """A `threading.setprofile` hook that records each torch function or tensor method a thread named `prefix...`
    calls (threads started after it is set), and the set it records into."""
    calls = set()

    def profile(frame, event, arg):
        if event == "c_call" and threading.current_thread().name.startswith(prefix):
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or type(owner).__module__
            if str(module).split(".")[0] == "torch" or isinstance(owner, torch.Tensor):
                calls.add(arg.__qualname__)

    return profile, calls


def test_the_request_threads_call_no_torch(served, tmp_path):
    """A daemon thread inside a torch op as the interpreter exits aborts the process (-6; it once failed CI after
    a fault stopped training): the served teacher's request threads parse the reply into numpy arrays, and the
    tensors are built where the loss reads them. Every torch call a thread named ``served-teacher-*`` makes while
    training is recorded: none. The same hook sees the torch calls of `fetch` (arrays and tensors) on such a thread."""
    profile, calls = torch_calls_on("served-teacher")
    threading.setprofile(profile)
    try:
        trainer = DistillationTrainer(served["student"], args=run_config(tmp_path, "threads", max_steps=2,
                                      teacher_server=served["url"], teacher_server_top_k=K),
                                      train_dataset=synthetic_prompt_completion(8))
        trainer.train()
        assert len(logged(trainer.state.log_history, "kd_loss")) == 2
        assert calls == set(), calls
        batch = next(iter(trainer.get_train_dataloader()))
        rows, positions = loss_rows(batch)
        thread = threading.Thread(target=trainer.teacher.fetch, args=(rows, positions), name="served-teacher-check")
        thread.start()
        thread.join()
    finally:
        threading.setprofile(None)
    assert {"from_numpy", "float"} <= {name.rsplit(".", 1)[-1] for name in calls}, calls


def test_accumulation_dataloader_workers_and_evaluation_against_the_live_server(served, caches):
    """Gradient accumulation 2 (a step's two micro-batches requested together) and 2 DataLoader workers (which
    fetch in the worker) train as from the cache; evaluation scores the eval split through the server too: before
    any update, over all rows in one batch, its kd_loss is the first step's."""
    tmp, data = caches["tmp"], synthetic_prompt_completion(ROWS)
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, dataloader_num_workers=2)
    losses = {}
    for name, teacher in (("ga_cache", dict(teacher_cache=str(caches["server"]))),
                          ("ga_live", dict(teacher_server=served["url"], teacher_server_top_k=K))):
        trainer = DistillationTrainer(served["student"], args=run_config(tmp, name, **teacher, **settings),
                                      train_dataset=data)
        trainer.train()
        losses[name] = logged(trainer.state.log_history, "kd_loss")
    assert list(losses["ga_live"]) == [1, 2, 3, 4]
    assert max(abs(losses["ga_live"][s] - losses["ga_cache"][s]) for s in losses["ga_cache"]) <= 1e-4
    whole = dict(per_device_train_batch_size=ROWS, per_device_eval_batch_size=ROWS, max_steps=1, eval_strategy="no")
    trainer = DistillationTrainer(served["student"], args=run_config(tmp, "eval", teacher_server=served["url"],
                                  teacher_server_top_k=K, **whole), train_dataset=data, eval_dataset=data)
    evaluated = trainer.evaluate()["eval_kd_loss"]
    trainer.train()
    assert evaluated == pytest.approx(logged(trainer.state.log_history, "kd_loss")[1], rel=1e-5) and evaluated > 0.1


def test_a_lora_student_against_the_server_starts_where_the_full_student_does(served, caches):
    """LoRA starts as the identity (B = 0): the first step's kd_loss and ce_loss of a LoRA student trained live
    against the server equal the full student's trained from the server's own cache."""
    from peft import LoraConfig

    tmp, data, losses = caches["tmp"], synthetic_prompt_completion(ROWS), {}
    runs = {"cache": ({"teacher_cache": str(caches["server"])}, None),
            "lora": ({"teacher_server": served["url"], "teacher_server_top_k": K},
                     LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))}
    for name, (teacher, peft_config) in runs.items():
        trainer = DistillationTrainer(served["student"], args=run_config(tmp, f"{name}_lora_cell", max_steps=2,
                                                                          **teacher),
                                      train_dataset=data, peft_config=peft_config)
        trainer.train()
        losses[name] = {key: logged(trainer.state.log_history, key) for key in ("kd_loss", "ce_loss")}
    for key, want in losses["cache"].items():
        assert want[1] > 0.01 and abs(losses["lora"][key][1] - want[1]) <= 1e-4, key


def test_a_cache_from_the_server_resumes_byte_identically(served, tmp_path):
    """Python API, default packed encoding: a write stopped after its first shard, run again, equals one that was
    never stopped."""
    data = synthetic_prompt_completion(ROWS)

    def writer(name):
        return DistillationTrainer(served["student"], args=run_config(tmp_path, name, teacher_server=served["url"]),
                                   train_dataset=data)

    write_teacher_cache(writer("whole"), str(tmp_path / "whole"), top_k=K, shard_rows=10, batch_size=4)

    def stop(index):
        if index == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_teacher_cache(writer("stopped"), str(tmp_path / "stopped"), top_k=K, shard_rows=10, on_shard=stop)
    assert not json.loads((tmp_path / "stopped" / "manifest.json").read_text())["complete"]
    write_teacher_cache(writer("resumed"), str(tmp_path / "stopped"), top_k=K, shard_rows=10)
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "stopped").iterdir()} == whole and len(whole) == 4


@pytest.mark.parametrize("change, message", [
    (dict(teacher_model_name_or_path="other"), r"serves \['teacher'\], not 'other': pass the served name"),
    (dict(teacher_server_top_k=65), r"restart it with `vllm serve \.\.\. --max-logprobs 65`"),
    (dict(max_length=200), "takes at most 128 tokens per request"),
])
def test_a_server_that_does_not_fit_the_run_is_one_clear_error(served, tmp_path, change, message):
    args = run_config(tmp_path, "bad", teacher_server=served["url"], **change)
    with pytest.raises(ValueError, match=message):
        DistillationTrainer(served["student"], args=args, train_dataset=synthetic_prompt_completion(8))
    shutil.rmtree(tmp_path / "bad", ignore_errors=True)


def test_two_processes_train_against_the_live_server_as_from_its_cache(served, caches):
    """The command line on 2 processes (ZeRO-2 student, no teacher engine): each rank requests its own rows; the
    logged losses equal those of the same run from the cache the server wrote."""
    tmp = caches["tmp"]
    common = ["--model_name_or_path", served["student"], "--dataset_name", str(tmp / "data.jsonl"), "--bf16", "false",
              "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true", "--max_length",
              "64", "--deepspeed", str(ROOT / "configs/deepspeed/zero2_student.json"), "--max_steps", "3",
              "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_strategy", "steps",
              "--save_steps", "3", "--learning_rate", "2e-3"]
    history = {}
    for name, teacher in (("live", ["--teacher_server", served["url"], "--teacher_server_top_k", str(K)]),
                          ("cached", ["--teacher_cache", str(caches["server"])])):
        result = launch("trl_distill", *common, *teacher, "--output_dir", str(tmp / f"cli_{name}"),
                        launcher_args=("-m",), timeout=300)
        assert "teacher DeepSpeed config" not in result.stdout  # one engine: the student's
        state = json.loads((tmp / f"cli_{name}" / "checkpoint-3" / "trainer_state.json").read_text())
        history[name] = {key: logged(state["log_history"], key) for key in ("loss", "kd_loss")}
    assert list(history["live"]["loss"]) == [1, 2, 3] and history["live"]["kd_loss"][1] > 0.1
    for key, want in history["cached"].items():
        got = history["live"][key]
        assert max(abs(got[s] - want[s]) for s in want) <= 1e-4, (key, got, want)
    assert (tmp / "cli_live" / "model.safetensors").exists()
