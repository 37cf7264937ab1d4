"""The weight-update group's pure parts: buckets, the flattened layout, request bodies, config."""

from __future__ import annotations

import pytest
import torch

from rollouts.config import ConfigError, config_from_dict
from rollouts.engine_kinds import ENGINE_KINDS
from rollouts.inference.protocol import WeightGroupSpec
from rollouts.inference.sglang_wire import distributed_update_body, init_group_body
from rollouts.inference.vllm import transfer_init_info, transfer_update_info
from rollouts.weights.distributed import rank_offsets
from rollouts.weights.distributed_pool import choose_backend, distributed_sync_for
from rollouts.wire.weight_group import (
    BucketBuffer,
    TensorSpec,
    flatten,
    plan_buckets,
    spec_of,
    specs_from_request,
    unflatten,
)

# the request fields of SGLang 0.5.21's io_struct (InitWeightsUpdateGroupReqInput,
# UpdateWeightsFromDistributedReqInput) and vLLM's NCCL init / update infos (0.27 and 0.33)
SGLANG_INIT = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "group_name",
    "backend",
}
SGLANG_UPDATE = {
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
    "weight_version", "load_format", "selector", "torch_empty_cache",
}  # fmt: skip
VLLM_INIT_027 = {"master_address", "master_port", "rank_offset", "world_size"}
VLLM_UPDATE_027 = {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes",
                   "packed_num_buffers"}  # fmt: skip


def _spec(name: str, numel: int, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=(numel,))


def test_buckets_keep_order_and_size_and_a_big_tensor_goes_alone() -> None:
    specs = [_spec("a", 10), _spec("b", 10), _spec("c", 100), _spec("d", 5), _spec("e", 5)]
    buckets = plan_buckets(specs, bucket_bytes=80)  # 40 + 40 fit, 400 alone, 20 + 20
    assert [[s.name for s in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_buckets(specs, bucket_bytes=10**9) == [tuple(specs)]


def test_flatten_and_unflatten_round_trip_mixed_dtypes() -> None:
    tensors = {
        "w": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "h": torch.randn(2, 2).to(torch.float16).t(),  # not contiguous
    }
    specs = [spec_of(k, v) for k, v in tensors.items()]
    flat = flatten(tensors.values())
    assert flat.dtype == torch.uint8 and flat.numel() == 12 * 4 + 5 * 2 + 4 * 2
    buffer = BucketBuffer("cpu")
    into = flatten(tensors.values(), out=buffer.take(flat.numel()))
    assert torch.equal(into, flat)
    assert buffer.take(10).data_ptr() == into.data_ptr()  # reused, not reallocated
    for (name, got), (want_name, want) in zip(unflatten(flat, specs), tensors.items(), strict=True):
        assert name == want_name and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_specs_from_request_name_the_bad_field() -> None:
    ok = specs_from_request(["x"], ["torch.bfloat16"], [[2, 3]])
    assert ok == [TensorSpec(name="x", dtype="bfloat16", shape=(2, 3))]
    with pytest.raises(ValueError, match="dtypes"):
        specs_from_request(["x"], ["complex7"], [[2]])
    with pytest.raises(ValueError, match="1 names, 2 dtypes"):
        specs_from_request(["x"], ["float32", "float32"], [[2]])
    with pytest.raises(ValueError, match="shapes"):
        specs_from_request(["x"], ["float32"], ["2"])


def test_request_bodies_use_the_servers_field_names() -> None:
    group = WeightGroupSpec(master_address="10.0.0.1", master_port=29500, world_size=3)
    init = init_group_body(group, rank_offset=2)
    assert set(init) == SGLANG_INIT and init["rank_offset"] == 2 and init["world_size"] == 3
    bucket = [_spec("a", 4), TensorSpec(name="b", dtype="bfloat16", shape=(2, 2))]
    update = distributed_update_body(bucket, group_name="g", version="7", flush_cache=False)
    assert set(update) <= SGLANG_UPDATE and update["load_format"] is None
    assert update["dtypes"] == ["float32", "bfloat16"] and update["shapes"] == [[4], [2, 2]]
    assert set(transfer_init_info(group, 1)) <= VLLM_INIT_027
    info = transfer_update_info(bucket)
    assert set(info) <= VLLM_UPDATE_027 and info["dtype_names"] == ["float32", "bfloat16"]


def test_rank_offsets_put_the_trainer_first_and_engines_after() -> None:
    assert rank_offsets([1, 1]) == [1, 2]
    assert rank_offsets([2, 1, 4]) == [1, 3, 4]


def test_weight_sync_config_is_checked_and_resolved() -> None:
    assert distributed_sync_for(config_from_dict({})) is None  # disk by default
    dist = distributed_sync_for(config_from_dict({"weight_sync": {"method": "distributed"}}))
    assert dist is not None and dist.options.backend == "gloo" and dist.options.device == "cpu"
    assert dist.options.bucket_bytes == 256 * 2**20
    with pytest.raises(ConfigError) as info:
        distributed = {"bucket_mb": 0, "master_port": 70000}
        config_from_dict({"weight_sync": {"method": "nccl", "distributed": distributed}})
    text = str(info.value)
    assert "weight_sync.method = 'nccl'" in text and "weight_sync.distributed.bucket_mb = 0" in text
    assert "weight_sync.distributed.master_port = 70000" in text


def test_auto_backend_is_nccl_only_between_distinct_gpus() -> None:
    sglang, builtin, vllm = (ENGINE_KINDS[name] for name in ("sglang", "builtin", "vllm"))
    assert choose_backend("auto", False, sglang, "cpu") == "gloo"  # trainer on CPU
    assert choose_backend("auto", True, sglang, "cpu") == "nccl"  # servers on their own GPUs
    assert choose_backend("auto", True, builtin, "cuda") == "gloo"  # the trainer's own GPU
    assert choose_backend("auto", True, builtin, "cuda:0") == "gloo"
    assert choose_backend("auto", True, builtin, "cuda:1") == "nccl"
    assert choose_backend("gloo", True, vllm, "cpu") == "gloo"  # as asked
