"""The memory planner behind `trl-distill plan` (its command line: `cli/plan.py`, its table: `plan_text.py`):
per-GPU memory of a distillation run, estimated for seven setups (ours: ZeRO-2 student + ZeRO-3 teacher; TRL's
replicated teacher with full logits; ZeRO-3 for both; ours with the teacher's parameters or the student's optimizer on
CPU; the teacher served by vLLM elsewhere, 0 teacher bytes here; an FSDP2 student beside an FSDP2 teacher), and the
cheapest DeepSpeed one that fits. S and T: a model directory, a config.json or a count (`8B`). See docs/planner.md.
"""

from __future__ import annotations

import contextlib
import decimal
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, replace

from ..loss.settings import default_chunk_size
from .plan_moe import MoeShape, activation_intermediate, moe_shape

GIB = 1024**3
HEADROOM = 0.10  # CUDA context, NCCL/allocator buffers, fragmentation
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Optimizer bytes per trained parameter: an fp32 master copy (DeepSpeed ZeRO keeps one even in fp32) + states.
OPTIMIZER_BYTES = {"adamw": 12, "sgd": 8}
FP32_GRAD_BYTES = 4  # ZeRO's fp32 copy of its gradient partition, made for the optimizer step
DS_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters (our configs leave it unset)
CHUNK_COPIES = 3  # one chunk of student logits, teacher log-probs and d loss / d logits, all fp32
ROWS = ("teacher_params", "student_params", "student_grads", "optimizer", "gather_buffers", "activations",
        "logits_loss", "teacher_step")
# The setups compared: name -> (description, options of `estimate`)
CONFIGS = {
    "ours": ("ZeRO-2 student + ZeRO-3 teacher, chunked loss", dict(student_stage=2, teacher="zero3")),
    "replicated": ("ZeRO-2 student + replicated teacher, full logits (TRL)",
                   dict(student_stage=2, teacher="replicated", chunked=False)),
    "zero3": ("ZeRO-3 student + ZeRO-3 teacher, chunked loss", dict(student_stage=3, teacher="zero3")),
    "offload_teacher": ("ours + teacher parameters on CPU", dict(student_stage=2, teacher="offload")),
    "offload_optimizer": ("ours + student optimizer on CPU", dict(student_stage=2, teacher="zero3", offload_opt=True)),
    "served": ("ZeRO-2 student + teacher served by vLLM elsewhere (--teacher_server), top-k loss",
               dict(student_stage=2, teacher="served")),
    "fsdp2": ("FSDP2 student (reshard_after_forward false) + FSDP2 teacher, chunked loss",
              dict(teacher="zero3", engine="fsdp2")),
}
SERVED_TOP_K = 64  # --teacher_server_top_k's default: ids (int64) and log-probs (fp32) per loss token
LIMIT = 10**15  # the largest count, size or dimension planned: past it the arithmetic leaves float range
# Cheapest first: least communication, then the least PCIe traffic; "replicated" (TRL's) is never recommended, nor
# "served" (it needs a vLLM server on other GPUs: the recommendation names it only when nothing else fits).
PREFERENCE = ("ours", "zero3", "offload_optimizer", "offload_teacher")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about one model. `numels` (every tensor's size) is known from a config."""

    params: int
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    largest_layer: int = 0  # parameters of the largest leaf module: what ZeRO-3 gathers at once
    numels: tuple[int, ...] = ()
    source: str = ""
    moe: MoeShape | None = None  # a Mixture-of-Experts model: experts, active parameters (`plan_moe`)


@dataclass(frozen=True)
class Settings:
    """The hardware and the training shape (the CLI's flags)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    dtype: str = "bf16"
    micro_batch: int = 1
    seq_len: int = 4096
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    loss_chunk_size: int | None = None
    gradient_accumulation: int = 1
    teacher_batch_size: int | None = None  # rows per teacher forward in the once-per-step pass; None: all of them
    sequence_parallel: int = 1  # ranks that split each sequence (Ulysses): each holds seq_len / this of its positions

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node", "gpu_memory_gb", "micro_batch", "seq_len", "loss_chunk_size",
                     "gradient_accumulation", "teacher_batch_size", "sequence_parallel"):
            check_size(name, getattr(self, name))
        if self.gpus % self.sequence_parallel:
            raise ValueError(f"sequence_parallel {self.sequence_parallel} must divide the {self.gpus} GPUs.")

    @property
    def per_rank(self) -> Settings:
        """The shape one rank computes on: its shard of each sequence's positions under sequence parallelism."""
        return replace(self, seq_len=-(-self.seq_len // self.sequence_parallel), sequence_parallel=1)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def teacher_rows(self) -> int:
        """Rows the teacher runs at once: every row of the optimizer step, or `teacher_batch_size` of them."""
        rows = self.micro_batch * self.gradient_accumulation
        return min(self.teacher_batch_size or rows, rows)

    @property
    def budget(self) -> int:
        return int(self.gpu_memory_gb * GIB * (1 - HEADROOM))


def check_size(name: str, value) -> None:
    """A count or size of the plan (`name` as the message calls it) is None, or a finite number in (0, `LIMIT`]."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}.")
    if value > LIMIT:
        shown = f"{value:g}" if isinstance(value, float) else str(value) if value < 10**20 else "a longer number"
        raise ValueError(f"{name} must be at most {LIMIT:.0e} (past it the estimate is meaningless), got {shown}.")


# ---- Models ----

def parse_count(text: str) -> int | None:
    """`8B`, `600M`, `1.5b`, `8e9`, `125k` -> a parameter count; None when `text` is not a count. A count that is
    not in [1, `LIMIT`] (``0``, ``1e400``) is a `ValueError`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", str(text), flags=re.IGNORECASE)
    if not match:
        return None
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[match.group(2).lower()]
    number = decimal.Decimal(match.group(1))  # exact: float("1e400") is inf, and int(inf) an OverflowError
    with decimal.localcontext() as exact:
        exact.prec = 60
        value = number * scale if number.adjusted() <= 30 else None
    if value is None or value > LIMIT:
        raise ValueError(f"{text.strip()!r} is more parameters than this planner plans (at most {LIMIT:.0e}).")
    count = int(value.to_integral_value(rounding=decimal.ROUND_HALF_EVEN))
    if count < 1:
        raise ValueError(f"{text.strip()!r} is {count} parameters: a model to plan needs at least one.")
    return count


def spec_from_config(path: str) -> ModelSpec:
    """Count parameters exactly by building the model on the meta device (no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    numels = tuple(p.numel() for p in model.parameters())  # shared (tied) tensors are listed once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    text = config.get_text_config()
    heads = text.num_attention_heads
    return ModelSpec(
        params=sum(numels), hidden=text.hidden_size, layers=text.num_hidden_layers, vocab=text.vocab_size,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        tied=bool(getattr(text, "tie_word_embeddings", False)), largest_layer=largest, numels=numels, source=path,
        moe=moe_shape(config, model),
    )


def spec_from_count(count: int, hidden=None, layers=None, vocab=None, intermediate=None, heads=None,
                    kv_heads=None) -> ModelSpec:
    """A Llama-shaped model of `count` parameters; missing dims follow hidden/layers ~ 128 and a SwiGLU MLP."""
    for name, value in (("parameter count", count), ("hidden", hidden), ("layers", layers), ("vocab", vocab),
                        ("intermediate", intermediate), ("heads", heads), ("kv_heads", kv_heads)):
        check_size(name, value)
    hidden = hidden or max(128, round((count * 128 / 12) ** (1 / 3) / 128) * 128)
    layers = layers or max(1, round(count / (12 * hidden**2)))
    vocab = vocab or 32000
    intermediate = intermediate or math.ceil(8 * hidden / 3 / 256) * 256
    heads = heads or max(1, hidden // 128)
    return ModelSpec(
        params=count, hidden=hidden, layers=layers, vocab=vocab, intermediate=intermediate, heads=heads,
        kv_heads=kv_heads or heads, head_dim=hidden // heads, largest_layer=max(vocab, intermediate) * hidden,
        source=f"{count:,} parameters (dims assumed where not given)",
    )


def load_spec(source: str, dims: dict | None = None) -> ModelSpec:
    """A model directory, a config.json file or a parameter count (then `dims` may give its shape)."""
    count = parse_count(source)
    if count is not None:
        return spec_from_count(count, **(dims or {}))
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise FileNotFoundError(f"{source!r} is a directory without a config.json.")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source!r} is neither a model directory, a config.json nor a count like 8B.")
    return spec_from_config(source)


# ---- Components, in bytes per GPU ----

def zero3_shard(spec: ModelSpec, gpus: int) -> int:
    """Elements one rank holds: ZeRO-3 pads every tensor's partition up to ceil(numel / N)."""
    return sum(-(-n // gpus) for n in spec.numels) if spec.numels else -(-spec.params // gpus)


def zero3_gathered(spec: ModelSpec) -> int:
    """Elements live at once under ZeRO-3: the prefetch bucket (0.9 h^2, as "auto" fills it) beside the largest
    layer, bounded by stage3_max_live_parameters, plus the parameters small enough to persist (<= 10 h)."""
    prefetch = int(0.9 * spec.hidden**2)
    live = min(prefetch + spec.largest_layer, max(DS_MAX_LIVE_PARAMETERS, spec.largest_layer))
    small = [n for n in spec.numels if n <= 10 * spec.hidden] if spec.numels else [spec.hidden] * (2 * spec.layers + 1)
    return live + sum(small)


def layer_activations(spec: ModelSpec, tokens: int) -> int:
    """Elements one Llama-style layer keeps for backward (flash/SDPA attention, no [T, T] scores): two norm
    inputs and outputs (4h), q and attention output (2 h_q), k and v (2 h_kv), gate, up, silu(gate), their
    product (4i)."""
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    intermediate = activation_intermediate(spec.intermediate, spec.layers, spec.moe)  # MoE: the routed experts'
    return int(tokens * (4 * spec.hidden + 2 * q + 2 * kv + 4 * intermediate))


def activation_bytes(student: ModelSpec, teacher: ModelSpec | None, s: Settings, step_pass: bool = True) -> int:
    """Student activations (all layers, or with checkpointing each layer's input plus one recomputed layer), or
    the frozen teacher's one-layer working set if larger: over the rows it runs at once (`Settings.teacher_rows`)
    with the once-per-step pass, which runs before the student's forward; over one micro-batch otherwise (then with
    the teacher's last hidden states for the micro-batch's loss; the pass keeps those in `teacher_step_bytes`)."""
    tokens = s.micro_batch * s.seq_len
    per_layer = layer_activations(student, tokens)
    if s.gradient_checkpointing:
        kept = student.layers * tokens * student.hidden + per_layer
    else:
        kept = student.layers * per_layer
    kept += 2 * tokens * student.hidden  # embedding output, final norm output (the loss's input)
    if teacher is None:  # a served teacher runs elsewhere
        return kept * DTYPE_BYTES[s.dtype]
    if step_pass:
        return max(kept, layer_activations(teacher, s.teacher_rows * s.seq_len)) * DTYPE_BYTES[s.dtype]
    return (max(kept, layer_activations(teacher, tokens)) + tokens * teacher.hidden) * DTYPE_BYTES[s.dtype]


def teacher_step_bytes(teacher: ModelSpec, s: Settings) -> int:
    """What the once-per-step teacher pass holds while the student trains on the step's micro-batches: the
    teacher's last hidden states at every loss token of the step (at most every token of every micro-batch) and its
    lm_head, gathered once for the step (`trl_distill.teacher.step_pass`)."""
    tokens = s.gradient_accumulation * s.micro_batch * s.seq_len
    return (tokens * teacher.hidden + teacher.vocab * teacher.hidden) * DTYPE_BYTES[s.dtype]


def chunk_rows(student: ModelSpec, s: Settings) -> int:
    """Rows per loss chunk, as `chunked_distillation_loss` picks them: ~2^25 fp32 logits unless given."""
    return min(s.loss_chunk_size or default_chunk_size(student.vocab), s.micro_batch * s.seq_len)


def logits_bytes(student: ModelSpec, s: Settings, chunked: bool) -> int:
    """Chunked: one chunk's fp32 logits/gradient plus the fused loss's fp32 [V, H_s] lm_head gradient sums (KD
    and CE) and its hidden-state gradients. Full (TRL): [B*T, V] fp32 logits of both models plus their gradient."""
    tokens = s.micro_batch * s.seq_len
    if not chunked:
        return CHUNK_COPIES * tokens * student.vocab * 4
    head_grads = 2 * student.vocab * student.hidden * 4 + 2 * tokens * student.hidden * DTYPE_BYTES[s.dtype]
    return CHUNK_COPIES * chunk_rows(student, s) * student.vocab * 4 + head_grads


def each_teacher(teacher_spec: ModelSpec | tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
    """One teacher or several (`teachers`, each its own ZeRO-3 engine) as a tuple."""
    return teacher_spec if isinstance(teacher_spec, tuple) else (teacher_spec,)


def teacher_held(teacher: ModelSpec, mode: str, gpus: int) -> int:
    """Elements of one teacher's parameters a GPU holds in `mode` (zero3, replicated, offload, served)."""
    return {"zero3": zero3_shard(teacher, gpus), "replicated": teacher.params}.get(mode, 0)


def estimate(student: ModelSpec, teacher_spec: ModelSpec | tuple[ModelSpec, ...], s: Settings, student_stage: int = 2,
             teacher: str = "zero3", offload_opt: bool = False, chunked: bool = True,
             engine: str = "deepspeed") -> dict[str, int]:
    """Per-GPU bytes of each component for one setup (see `CONFIGS`). Several teachers (a tuple): each holds its
    own shard and, through the step, its own hidden states and lm_head (the sums); they run one after another, so
    the gather buffers and the working set are the largest one's. `engine` "fsdp2": the model states as FSDP2
    holds them (`fsdp2_model_states`); the rest as ours."""
    b, n = DTYPE_BYTES[s.dtype], s.gpus
    teachers = each_teacher(teacher_spec)
    shard = -(-student.params // n)
    rows = dict.fromkeys(ROWS, 0)
    rows["teacher_params"] = sum(teacher_held(t, teacher, n) for t in teachers) * b
    rows["student_params"] = (zero3_shard(student, n) if student_stage == 3 else student.params) * b
    bucket = student.hidden**2 * b  # reduce_bucket_size "auto" = h^2
    rows["student_grads"] = bucket + (0 if offload_opt else shard * (b + FP32_GRAD_BYTES))
    rows["optimizer"] = 0 if offload_opt else shard * OPTIMIZER_BYTES[s.optimizer]
    gathered = max(zero3_gathered(t) for t in teachers) if teacher in ("zero3", "offload") else 0
    rows["gather_buffers"] = (gathered + (zero3_gathered(student) if student_stage == 3 else 0)) * b
    step_pass = teacher != "replicated"  # TRL runs its teacher per micro-batch
    s = s.per_rank if chunked else s  # what grows with the sequence, on this rank's positions (TRL: no SP)
    rows["activations"] = max(activation_bytes(student, None if teacher == "served" else t, s, step_pass)
                              for t in teachers)
    rows["logits_loss"] = logits_bytes(student, s, chunked)
    if teacher == "served":  # no teacher here: each micro-batch's top-k signals arrive with the batch
        rows["logits_loss"] += len(teachers) * s.micro_batch * s.seq_len * SERVED_TOP_K * (8 + 4)
    if teacher in ("zero3", "offload"):
        rows["teacher_step"] = sum(teacher_step_bytes(t, s) for t in teachers)
    if engine == "fsdp2":
        rows.update(fsdp2_model_states(student, teachers, s))
    return rows


def decoder_layer(spec: ModelSpec) -> int:
    """Parameters of one decoder layer (what FSDP2 gathers at once for a layer, every expert of an MoE layer)."""
    return (spec.params - spec.vocab * spec.hidden * (1 if spec.tied else 2)) // max(spec.layers, 1)


def fsdp2_model_states(student: ModelSpec, teachers: tuple[ModelSpec, ...], s: Settings) -> dict[str, int]:
    """The rows FSDP2 holds otherwise than DeepSpeed. The student (accelerate's FSDP2, reshard_after_forward false:
    every layer stays gathered from its forward to its backward): its 1/N fp32 parameters (accelerate keeps the
    trained ones in fp32 under mixed precision; they are the optimizer's master copy), the whole model gathered in the
    run's dtype, 1/N fp32 gradients plus one layer's before its reduce-scatter, and the optimizer's moments on 1/N.
    Each teacher: its 1/N rows; one group gathered and the next prefetched, a group being a decoder layer or its
    (untied) input embeddings; the root (final norm, lm_head) is gathered through the step, in `teacher_step`."""
    b, n = DTYPE_BYTES[s.dtype], s.gpus
    shard = zero3_shard(student, n)
    layer = max(max(decoder_layer(t), 0 if t.tied else t.vocab * t.hidden) for t in teachers)
    return {
        "teacher_params": sum(zero3_shard(t, n) for t in teachers) * b,
        "student_params": shard * 4 + student.params * b,
        "student_grads": shard * 4 + decoder_layer(student) * b,
        "optimizer": shard * (OPTIMIZER_BYTES[s.optimizer] - 4),
        "gather_buffers": 2 * layer * b,
    }


def deepspeed_estimates(student: ModelSpec, teacher: ModelSpec, s: Settings, name: str) -> dict[str, int]:
    """DeepSpeed's own model-state estimators (16-bit weights, fp32 Adam) for the student and the teacher.

    The teacher is never trained and DeepSpeed has no inference estimator: its ZeRO-3 estimate is taken with the
    optimizer "offloaded" (GPU = 16-bit shard + 4 x largest layer), its replicated one from the ZeRO-2 estimator
    with the optimizer offloaded (GPU = its 16-bit weights)."""
    with contextlib.redirect_stdout(sys.stderr):  # importing DeepSpeed logs; keep --json output clean
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2
    opts = CONFIGS[name][1]
    hw = dict(num_gpus_per_node=s.gpus_per_node, num_nodes=s.nodes)
    if opts.get("student_stage", 2) == 3:
        student_gpu = zero3(student.params, student.largest_layer, cpu_offload=False, cpu_offload_params=False, **hw)[1]
    else:
        student_gpu = zero2(student.params, cpu_offload=opts.get("offload_opt", False), **hw)[1]
    mode, teacher_gpu = opts.get("teacher", "zero3"), 0
    for one in each_teacher(teacher):  # several teachers: the sum of their engines
        if mode == "replicated":
            teacher_gpu += zero2(one.params, cpu_offload=True, **hw)[1]
        elif mode != "served":
            teacher_gpu += zero3(one.params, one.largest_layer, cpu_offload=True, cpu_offload_params=mode == "offload",
                                 **hw)[1]
    return {"student_model_states": int(student_gpu), "teacher_model_states": int(teacher_gpu)}


# ---- Plan ----

def evaluate(student: ModelSpec, teacher: ModelSpec, s: Settings) -> dict[str, dict]:
    """Every setup's rows, total and whether it fits the budget."""
    setups = {}
    for name, (description, opts) in CONFIGS.items():
        rows = estimate(student, teacher, s, **opts)
        total = sum(rows.values())
        setups[name] = {"description": description, "rows": rows, "total": total, "fits": total <= s.budget}
    return setups


def first_fit(setups: dict[str, dict]) -> str | None:
    return next((name for name in PREFERENCE if setups[name]["fits"]), None)


def recommend(student: ModelSpec, teacher: ModelSpec, s: Settings, setups: dict[str, dict]) -> dict:
    """The cheapest setup that fits; if none does, the first smaller micro batch / checkpointing that makes one fit."""
    name = first_fit(setups)
    if name is not None:
        return {"config": name, "settings": None, "total": setups[name]["total"]}
    micro = s.micro_batch
    while micro >= 1:
        for checkpointing in dict.fromkeys((s.gradient_checkpointing, True)):
            trial = replace(s, micro_batch=micro, gradient_checkpointing=checkpointing)
            if trial == s:
                continue
            trial_setups = evaluate(student, teacher, trial)
            name = first_fit(trial_setups)
            if name is not None:
                changed = {"micro_batch": micro} if micro != s.micro_batch else {}
                changed.update({"gradient_checkpointing": "on"} if checkpointing > s.gradient_checkpointing else {})
                return {"config": name, "settings": changed, "total": trial_setups[name]["total"]}
        micro //= 2
    return {"config": None, "settings": None, "total": None}


def plan(student: ModelSpec, teacher: ModelSpec, s: Settings, deepspeed_check: bool = True) -> dict:
    """Estimates for every setup, DeepSpeed's cross-check and the recommendation, as one JSON-ready dict."""
    setups = evaluate(student, teacher, s)
    if deepspeed_check:
        for name, setup in setups.items():
            if CONFIGS[name][1].get("engine", "deepspeed") == "deepspeed":  # (DeepSpeed's estimators: its setups)
                setup["deepspeed"] = deepspeed_estimates(student, teacher, s, name)
    teachers = each_teacher(teacher)
    roles = [("teacher", teachers[0])] if len(teachers) == 1 else [(f"teacher {i + 1}", t) for i, t in
                                                                     enumerate(teachers)]
    models = {role: {k: v for k, v in asdict(spec).items() if k != "numels"} for role, spec in [("student", student),
                                                                                              *roles]}
    for role, spec in roles if len(teachers) > 1 else ():  # several: each teacher's own part of ours' rows
        models[role]["ours"] = {"teacher_params": teacher_held(spec, "zero3", s.gpus) * DTYPE_BYTES[s.dtype],
                                "teacher_step": teacher_step_bytes(spec, s)}
    return {"settings": asdict(s), "gpus": s.gpus, "budget": s.budget, "headroom": HEADROOM, "models": models,
            "chunk_rows": chunk_rows(student, s), "teacher_rows": s.teacher_rows, "configs": setups,
            "recommendation": recommend(student, teacher, s, setups)}
