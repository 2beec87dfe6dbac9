"""The partition-wise teacher loader's file reading (its 2-process use: tests/test_trainer_distributed.py)."""

import torch
from safetensors.torch import save_file

from trl_distill.testing import build_tiny_model, build_tokenizer
from trl_distill.zero3_loading import _read_flat, loadable, safetensors_index


def test_index_covers_a_sharded_checkpoint_and_reads_any_flat_range(tmp_path):
    model = build_tiny_model(build_tokenizer(), "teacher")
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several files and an index
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    entries = safetensors_index(str(tmp_path))
    state = model.state_dict()
    assert set(entries) == set(state)
    generator = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        flat = tensor.reshape(-1)
        first = int(torch.randint(0, flat.numel(), (1,), generator=generator))
        count = int(torch.randint(0, flat.numel() - first + 1, (1,), generator=generator))
        path, entry, start = entries[name]
        assert torch.equal(_read_flat(path, entry, start, first, count), flat[first : first + count]), name


def test_reads_the_stored_dtype_and_refuses_what_it_cannot_load(tmp_path):
    values = torch.randn(7, 3).to(torch.bfloat16)
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    path, entry, start = safetensors_index(str(tmp_path))["w"]
    assert torch.equal(_read_flat(path, entry, start, 4, 10), values.reshape(-1)[4:14])
    assert loadable(str(tmp_path), {})
    assert not loadable(str(tmp_path), {"quantization_config": object()})
    assert not loadable("meta-llama/Llama-3.1-8B", {})  # a hub id: from_pretrained downloads and loads it
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    assert not loadable(str(tmp_path), {})
