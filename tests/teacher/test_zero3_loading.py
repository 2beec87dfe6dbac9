"""The partition-wise teacher loader: its file reading, and what loading costs each of 2 ranks in memory (its use in
training: tests/test_trainer_distributed.py)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trl_distill.teacher import zero3_loading as loading
from trl_distill.teacher.zero3_loading import _read_flat, _read_into, loadable, safetensors_index
from trl_distill.testing import build_tiny_model, build_tokenizer, launch, read_rank_records

WORKER = Path(__file__).parents[1] / "scripts" / "load_memory_worker.py"


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


def test_reads_the_stored_dtype_and_refuses_what_it_cannot_load(tmp_path, monkeypatch):
    values = torch.randn(7, 3).to(torch.bfloat16)
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    path, entry, start = safetensors_index(str(tmp_path))["w"]
    assert torch.equal(_read_flat(path, entry, start, 4, 10), values.reshape(-1)[4:14])
    # into a partition of another dtype: converted through a bounded buffer (here 3 values at a time)
    monkeypatch.setattr(loading, "_CHUNK_BYTES", 6)
    target = torch.full((10,), float("nan"))
    assert _read_into(target, path, entry, start, 4) == 20  # bytes read from the file
    assert torch.equal(target, values.reshape(-1)[4:14].float())
    assert loadable(str(tmp_path), {})
    assert not loadable(str(tmp_path), {"quantization_config": object()})
    assert not loadable("meta-llama/Llama-3.1-8B", {})  # a hub id: from_pretrained downloads and loads it
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    assert not loadable(str(tmp_path), {})


def test_a_partition_off_the_cpu_is_filled_through_one_bounded_host_buffer(tmp_path, monkeypatch):
    """A GPU's partition cannot be a `pread` target (2755ed6 called `.numpy()` on it and crashed on CUDA): it is
    filled chunk by chunk from one host buffer of at most `_CHUNK_BYTES`, reused for every tensor of the load. `meta`
    stands for the device here: nothing is read back from it, and any host view of it raises as CUDA's does."""
    values = torch.randn(40).to(torch.bfloat16)
    save_file({"w": values, "v": values.float()}, str(tmp_path / "model.safetensors"))
    index = safetensors_index(str(tmp_path))
    monkeypatch.setattr(loading, "_CHUNK_BYTES", 16)  # 8 bf16 values or 4 float32 ones a chunk
    reads = []
    pread = loading._pread_exact
    monkeypatch.setattr(loading, "_pread_exact", lambda fd, view, offset, path: (reads.append(len(view)),
                                                                                 pread(fd, view, offset, path)))
    on_device = torch.empty(30, dtype=torch.bfloat16, device="meta")  # the file's dtype: 2755ed6 read into it
    assert _read_into(on_device, *index["w"], 5) == 60
    assert reads == [16, 16, 16, 12]
    reads.clear()
    staging = loading.HostStaging("meta")
    for name, dtype in (("w", torch.bfloat16), ("v", torch.float32)):
        target = torch.empty(30, dtype=dtype, device="meta")
        path, entry, start = index[name]
        assert _read_into(target, path, entry, start, 5, staging) == 30 * target.element_size()
    assert reads == [16, 16, 16, 12] + [16] * 7 + [8]  # every read fits the buffer; 30 values each
    assert staging._buffer.device.type == "cpu" and staging._buffer.numel() == 16  # one buffer for both tensors
    # the same path into host memory (a float32 partition of a bf16 file) reads the right values
    target = torch.full((30,), float("nan"))
    _read_into(target, *index["w"], 5, loading.HostStaging())
    assert torch.equal(target, values[5:35].float())
    with pytest.raises(ValueError, match="HostStaging"):
        loading._bytes_of(torch.empty(4, device="meta"))


@pytest.mark.distributed
def test_loading_grows_each_rank_by_its_partitions_only(tmp_path):
    """2 processes: building and filling the ZeRO-3 teacher grows a rank's memory (peak RSS) by its partitions, not
    by a whole module on top. DeepSpeed's own zero.Init broadcasts each module whole from rank 0 (the contrast run):
    the receiving rank's peak then carries the largest module (a 64 MiB embedding) on top of its partitions."""
    model = build_tiny_model(build_tokenizer(), "teacher", vocab_size=32768, hidden_size=512, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4)
    model.save_pretrained(tmp_path / "teacher")
    runs = {}
    for mode in ("ours", "broadcast"):
        launch(WORKER, str(tmp_path / "teacher"), str(tmp_path / mode), *(["broadcast"] if mode == "broadcast" else []),
               timeout=180, own_launch=True)  # a rank's memory growth: measured in a process of its own
        runs[mode] = read_rank_records(tmp_path / mode)
    for rec in runs["ours"]:
        assert rec["held"] * 2 >= rec["total"] and rec["largest"] == 64 << 20
        assert rec["growth"] - rec["held"] <= rec["largest"] / 4, rec  # no whole module on top of the partitions
    assert max(r["growth"] - r["held"] for r in runs["broadcast"]) >= 0.75 * runs["broadcast"][1]["largest"]
    # the same values loaded either way, each rank its own half
    assert [r["checksum"] for r in runs["ours"]] == [r["checksum"] for r in runs["broadcast"]]
