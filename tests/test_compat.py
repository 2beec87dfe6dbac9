"""trl_distill.compat: every private API we use still exists and behaves as relied on in the installed versions, and
the installed versions are the ones pyproject.toml pins (an upgrade that moves one fails here)."""

import importlib
from importlib.metadata import version

import pytest
import torch

from trl_distill import DistillationConfig, DistillationTrainer, compat
from trl_distill.testing import synthetic_prompt_completion, tiny_run_settings


def test_installed_versions_are_the_checked_ones():
    for package, checked in compat.CHECKED_AGAINST.items():
        assert version(package).startswith(checked), (package, version(package), checked)


@pytest.mark.parametrize("owner, hooks", [*compat.OVERRIDDEN_HOOKS.items(), *compat.RELIED_ON.items()])
def test_the_hooks_we_override_still_exist(owner, hooks):
    module, name = owner.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    for hook in hooks:
        assert hasattr(cls, hook), f"{owner}.{hook}"


@pytest.fixture(scope="module")
def trainer(tiny_pair, tmp_path_factory):
    from transformers import AutoTokenizer

    args = DistillationConfig(output_dir=str(tmp_path_factory.mktemp("compat")), **tiny_run_settings(max_steps=1))
    return DistillationTrainer(tiny_pair["student"], tiny_pair["teacher"], args=args,
                               train_dataset=synthetic_prompt_completion(8),
                               processing_class=AutoTokenizer.from_pretrained(tiny_pair["tokenizer"]))


def test_prepare_inputs_moves_a_batch_as_the_training_step_does(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    prepared = trainer.prepared_inputs(batch)
    assert prepared["input_ids"].device == trainer.args.device and torch.equal(prepared["labels"], batch["labels"])


def test_num_items_in_batch_counts_the_shifted_labels(trainer):
    """Row 0's first label is not -100: the unshifted count is 3, the shifted one (what our loss sums over) 2."""
    from trl import SFTTrainer

    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.tensor([[5, -100, 7, 8]])}
    trainer.count_items_over_shifted_labels()  # (the trainer's own set-up already did)
    _, count = SFTTrainer.get_batch_samples(trainer, iter([batch]), 1, trainer.args.device)
    assert int(count) == 2


def test_a_kept_column_survives_the_unused_column_drop(trainer):
    from datasets import Dataset

    dataset = Dataset.from_dict({"input_ids": [[1, 2]], "extra": [1], "junk": [2]})
    trainer._set_signature_columns_if_needed()
    trainer.keep_dataset_column("extra")
    assert trainer._remove_unused_columns(dataset).column_names == ["input_ids", "extra"]
    assert trainer.model_columns(dataset).column_names == ["input_ids", "extra"]


def test_eval_metric_values_are_averaged_into_the_eval_log(trainer):
    trainer.eval_metric_values("kd_loss").extend([1.0, 3.0])
    trainer.model.eval()
    try:
        trainer.log({"eval_loss": 0.5})
    finally:
        trainer.model.train()
    assert trainer.state.log_history[-1]["eval_kd_loss"] == 2.0 and trainer.eval_metric_values("kd_loss") == []


def test_deepspeed_hidden_from_the_evaluation_loop(trainer):
    """(What the evaluation loop does with it is tested where a ZeRO-2 student is evaluated before training:
    tests/test_trainer_distributed.py::test_evaluate_before_and_after_train.)"""
    before = trainer.is_deepspeed_enabled
    with trainer.deepspeed_hidden():
        assert trainer.is_deepspeed_enabled is False
    assert trainer.is_deepspeed_enabled is True and before is False


def test_the_output_dir_of_a_run_without_trials(trainer):
    assert trainer.output_dir_for(None) == trainer.args.output_dir


def test_valid_dict_fields_let_the_cli_pass_json(tmp_path):
    assert "model_init_kwargs" in compat.valid_dict_fields(DistillationConfig)
    args = DistillationConfig(output_dir=str(tmp_path), teacher_model_init_kwargs='{"dtype": "float32"}',
                              report_to="none", bf16=False)
    assert args.teacher_model_init_kwargs == {"dtype": "float32"}


def test_accelerator_state_is_kept_around_a_prepare():
    """`prepare` registers a model and ties an engine; inside `accelerator_state_kept` neither outlives the block."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    models = list(compat.prepared_models(accelerator))
    accelerator.prepare(torch.nn.Linear(2, 2))
    assert len(compat.prepared_models(accelerator)) == len(models) + 1
    compat.prepared_models(accelerator)[:] = models
    accelerator.deepspeed_engine_wrapped = wrapped = object()  # (a DeepSpeed Accelerator's: the student engine)
    with compat.accelerator_state_kept(accelerator):
        accelerator.prepare(torch.nn.Linear(2, 2))
    assert compat.prepared_models(accelerator) == models and accelerator.deepspeed_engine_wrapped is wrapped


def test_partial_state_fields_and_their_reset():
    import subprocess
    import sys

    code = ("from accelerate import PartialState\nfrom trl_distill import compat\nPartialState(cpu=True)\n"
            "assert compat.partial_state_fields()['num_processes'] == 1\ncompat.reset_accelerate_state()\n"
            "assert compat.partial_state_fields() == {}\nprint('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_zero3_privates_on_a_plain_and_a_faked_parameter():
    """(On real ZeRO-3 parameters: tests/teacher/test_zero3_loading.py, where `zero3_partition` and
    `partitioned_construction` load each rank's partition, and tests/test_trainer_distributed.py.)"""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    plain = torch.nn.Parameter(torch.randn(3))
    assert not compat.is_zero3_partitioned(plain) and compat.zero3_partition(plain) is None
    plain.ds_id, plain.ds_status = 0, ZeroParamStatus.NOT_AVAILABLE
    assert compat.is_zero3_partitioned(plain)
    plain.ds_status = ZeroParamStatus.AVAILABLE
    assert not compat.is_zero3_partitioned(plain)


def test_cpu_bf16_units_as_the_cpu_reports_them():
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    assert compat.cpu_has_bf16_units() == bool({"avx512_bf16", "amx_tile"} & flags)


def test_every_compat_function_is_exercised_here():
    import ast
    from pathlib import Path

    source = Path(compat.__file__).read_text()
    public = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)
              and not node.name.startswith("_")}
    mine = Path(__file__).read_text()
    assert sorted(name for name in public if f"compat.{name}(" not in mine and name != "partitioned_construction") == []


def test_gloo_group_broadcasts_between_two_members_outside_the_default_group():
    import threading
    from datetime import timedelta

    from trl_distill.testing import free_port

    port, received = free_port(), {}
    master = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30),
                                        wait_for_workers=False)

    def member():
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        group = compat.gloo_group(store, 1, 2, 30)
        tensor = torch.zeros(5)
        group.broadcast(tensor, 0).wait()
        received["tensor"] = tensor

    thread = threading.Thread(target=member)
    thread.start()
    group = compat.gloo_group(master, 0, 2, 30)
    group.broadcast(torch.arange(5.0), 0).wait()
    thread.join(timeout=30)
    assert received["tensor"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert not torch.distributed.is_initialized()  # the default group was never touched


def test_the_attention_registry_and_model_classes_sequence_parallelism_reads():
    from transformers import BloomConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert compat.core_attention("sdpa") is sdpa_attention_forward
    assert compat.causal_lm_class(LlamaConfig()) is LlamaForCausalLM
    assert compat.uses_attention_interface(LlamaForCausalLM)
    assert not compat.uses_attention_interface(compat.causal_lm_class(BloomConfig()))


def test_deepspeed_sequence_groups_are_read_and_put_back():
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp
    from deepspeed.utils import groups

    found = compat.deepspeed_sequence_groups()
    assert found == (groups.mpu, sp._SEQUENCE_PARALLEL_GROUP, sp._SEQUENCE_DATA_PARALLEL_GROUP)
    marks = (object(), object(), object())
    try:
        compat.restore_deepspeed_sequence_groups(marks)
        assert (groups.mpu, sp._SEQUENCE_PARALLEL_GROUP, sp._SEQUENCE_DATA_PARALLEL_GROUP) == marks
        assert compat.deepspeed_sequence_groups() == marks
    finally:
        compat.restore_deepspeed_sequence_groups(found)
    assert compat.deepspeed_sequence_groups() == found


def test_an_earlier_accelerators_deepspeed_plugins_are_seen_and_forgotten():
    """accelerate refuses a new Accelerator's DeepSpeed plugins while an earlier one's are held; forgetting the
    accelerator state drops them and keeps the process state."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    saved, process = dict(AcceleratorState._shared_state), dict(PartialState._shared_state)
    plugins = {"student": object()}
    try:
        AcceleratorState._shared_state["deepspeed_plugins"] = plugins
        assert compat.earlier_deepspeed_plugins() is plugins
        compat.forget_accelerator_state()
        assert compat.earlier_deepspeed_plugins() is None and AcceleratorState._shared_state == {}
        assert PartialState._shared_state == process
    finally:
        AcceleratorState._shared_state.clear()
        AcceleratorState._shared_state.update(saved)


def test_checkpoint_conversions_read_transformers_own_mapping():
    """Mixtral's per-expert tensors: renamed, stacked, gate and up concatenated (what `expert_layout` relies on)."""
    mixtral = compat.checkpoint_conversions("mixtral")
    assert ("rename", [".block_sparse_moe."], [".mlp."], []) in mixtral
    assert ("convert", [".experts.*.w1.weight", ".experts.*.w3.weight"], [".experts.gate_up_proj"],
            [("MergeModulelist", 0), ("Concatenate", 1)]) in mixtral
    assert ("convert", [".experts.*.w2.weight"], [".experts.down_proj"], [("MergeModulelist", 0)]) in mixtral
    assert compat.checkpoint_conversions("llama") is None


def test_the_attention_override_and_its_removal():
    """`attention_override`: None while sdpa runs transformers' own; what was registered over it after; an installed
    `ShardedAttention` puts back what it replaced, and leaves no entry where there was none."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trl_distill.model.sharded_attention import install_sharded_attention

    assert compat.attention_override("sdpa") is None
    sharded = install_sharded_attention("sdpa", lambda: True)
    assert compat.attention_override("sdpa") is sharded and ALL_ATTENTION_FUNCTIONS["sdpa"] is sharded
    assert sharded.core is compat.core_attention("sdpa")
    sharded.uninstall()
    assert compat.attention_override("sdpa") is None

    def wrapper(*args, **kwargs):  # (accelerate's Ulysses wrapper stands there under sequence parallelism)
        return None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper
    try:
        sharded = install_sharded_attention("sdpa", lambda: True)
        sharded.uninstall()
        assert compat.attention_override("sdpa") is wrapper
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def test_sequence_parallelism_hidden_restores_the_state():
    from types import SimpleNamespace

    state = SimpleNamespace(parallelism_config="sp")
    accelerator = SimpleNamespace(state=state)
    with compat.sequence_parallelism_hidden(accelerator):
        assert state.parallelism_config is None
    assert state.parallelism_config == "sp"


def test_another_version_than_the_checked_one_is_one_line_not_a_refusal(monkeypatch, caplog):
    """pyproject.toml allows newer versions; compat says which version it was checked against, in one line."""
    assert compat.note_other_versions() is None and compat.other_versions() == {}  # the suite runs on them
    monkeypatch.setitem(compat.CHECKED_AGAINST, "torch", "2.99")
    with caplog.at_level("WARNING", logger="trl_distill"):
        line = compat.note_other_versions()
    assert line == (f"trl_distill.compat was checked against torch 2.99; found torch {version('torch')}. The private "
                    "APIs it wraps may have moved: tests/test_compat.py checks each one.")
    assert [r.getMessage() for r in caplog.records] == [line]


def test_every_pin_says_why_and_only_a_wrapped_library_is_capped():
    """Lower bounds: what the suite runs on; an upper bound only for a library whose private API compat wraps."""
    import re
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    text = pyproject.read_text()
    for requirement in tomllib.loads(text)["project"]["dependencies"]:
        line = next(line for line in text.splitlines() if f'"{requirement}"' in line)
        assert "#" in line, f"{requirement}: no comment saying why"
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        assert ("<" in requirement) == (name in compat.CHECKED_AGAINST), requirement
        if name in compat.CHECKED_AGAINST:
            assert f">={compat.CHECKED_AGAINST[name]}" in requirement, requirement


# ---- liger-kernel 0.8.5 (benchmarks/gpu's loss table; not a dependency) ----

def _liger_jsd_class():
    """`LigerFusedLinearJSD` as installed (when it imports here: its kernels need Triton), else a class with the
    parameters of its ``__init__`` and ``forward`` read from liger-kernel's own source, installed or in the wheel
    `make gpu-wheels` downloads into .whl/ (annotations and defaults dropped, bodies empty); skips when neither is."""
    import ast
    import importlib.util
    import zipfile
    from pathlib import Path

    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except ImportError:
        pass
    else:
        return LigerFusedLinearJSD, f"liger-kernel {version('liger-kernel')}, imported"
    relative = "liger_kernel/transformers/fused_linear_jsd.py"
    sources = []  # (where, its source text)
    found = importlib.util.find_spec("liger_kernel")  # the installed package's folder, without running it
    for folder in (found.submodule_search_locations or []) if found else []:
        if (Path(folder).parent / relative).is_file():
            sources.append((f"liger-kernel {version('liger-kernel')}", (Path(folder).parent / relative).read_text()))
    for wheel in sorted((Path(__file__).resolve().parents[1] / ".whl").glob("liger_kernel-*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            sources.append((wheel.name, archive.read(relative).decode()))
    for where, text in sources:
        tree = ast.parse(text)
        cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "LigerFusedLinearJSD")
        cls.body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("__init__", "forward")]
        cls.bases, cls.keywords, cls.decorator_list = [], [], []
        for method in cls.body:
            arguments = method.args
            for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                             arguments.kwarg]:
                if argument is not None:
                    argument.annotation = None
            arguments.defaults = [ast.Constant(None) for _ in arguments.defaults]
            arguments.kw_defaults = [d if d is None else ast.Constant(None) for d in arguments.kw_defaults]
            method.body, method.decorator_list, method.returns = [ast.Pass()], [], None
        namespace: dict = {}
        exec(compile(ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[])), where, "exec"), namespace)
        return namespace["LigerFusedLinearJSD"], where
    pytest.skip("liger-kernel is neither installed nor in .whl/ (make gpu-wheels, or pip download "
                f"liger-kernel=={compat.LIGER_CHECKED} --no-deps -d .whl)")


def test_the_liger_call_is_pinned_to_liger_kernels_own_signature():
    """compat's recorded signature of `LigerFusedLinearJSD` is liger-kernel's: installed, or read from its source."""
    module_class, where = _liger_jsd_class()
    problem = compat.liger_jsd_signature_problem(module_class)
    assert problem is None, f"{where}: {problem}"
    if where.endswith(".whl"):  # the wheel of the version checked carries exactly the recorded signature
        assert where.startswith(f"liger_kernel-{compat.LIGER_CHECKED}-"), where


def test_the_liger_call_passes_no_labels_and_refuses_another_signature_in_one_line():
    calls = []

    class Checked(torch.nn.Module):  # liger-kernel 0.8.5's parameters
        def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None):
            super().__init__()
            self.settings = (jsd_beta, temperature)

        def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
            calls.append((self.settings, shift_labels))
            return (student_input @ student_weight.T).sum() + (teacher_input @ teacher_weight.T).sum()

    class Before(Checked):  # the forward of liger-kernel before `shift_labels` (what the first GPU run expected)
        def forward(self, student_input, student_weight, teacher_input, teacher_weight):
            return super().forward(student_input, student_weight, teacher_input, teacher_weight, None)

    hs, ws, ht, wt = torch.ones(2, 3), torch.ones(5, 3), torch.ones(2, 4), torch.ones(5, 4)
    loss = compat.liger_fused_linear_jsd(1.0, temperature=2.0, module_class=Checked)
    assert loss(hs, ws, ht, wt).item() == 2 * 5 * 3 + 2 * 5 * 4
    assert calls == [((1.0, 2.0), None)]
    with pytest.raises(RuntimeError) as refused:
        compat.liger_fused_linear_jsd(0.0, module_class=Before)
    message = str(refused.value)
    assert "\n" not in message and f"liger-kernel {compat.LIGER_CHECKED}" in message
    assert "Before.forward takes (student_input, student_weight, teacher_input, teacher_weight) and" in message


def test_fsdp_on_cpu_processes_gives_the_state_what_accelerate_drops_on_cpu():
    """accelerate 1.15 leaves a multi-CPU run `MULTI_CPU` without its FSDP plugin; the state gets FSDP, the plugin, its
    mixed precision, and the process state's type (which a later `AcceleratorState()` copies back). Another type (one
    process: `NO`; a GPU run: FSDP already) is left alone. (The 2-process FSDP2 tests run it for real.)"""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    alone = SimpleNamespace(distributed_type=DistributedType.NO, mixed_precision="no", fsdp_plugin=None)
    assert compat.fsdp_on_cpu_processes(SimpleNamespace(state=alone), plugin) is False
    assert alone.distributed_type == DistributedType.NO and alone.fsdp_plugin is None
    state = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="bf16", fsdp_plugin=None)
    shared = PartialState._shared_state
    before = shared.get("distributed_type", "absent")
    try:
        assert compat.fsdp_on_cpu_processes(SimpleNamespace(state=state), plugin) is True
        assert state.distributed_type == DistributedType.FSDP and state.fsdp_plugin is plugin
        assert shared["distributed_type"] == DistributedType.FSDP
        assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    finally:
        if before == "absent":
            shared.pop("distributed_type", None)
        else:
            shared["distributed_type"] = before
