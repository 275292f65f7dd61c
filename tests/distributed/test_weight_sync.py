"""The dedicated weight-sync channel: bucketed, any dtype, bit-exact."""

import threading

import torch

from rlhforge.distributed.weight_sync import WeightReceiver, WeightSender, pack_bucket, plan_buckets, unpack_bucket


def test_buckets_by_hand():
    f32, bf16 = torch.float32, torch.bfloat16
    layout = [("a", f32, (4,)), ("b", f32, (2, 2)), ("c", bf16, (3,)), ("d", f32, (10,)), ("e", f32, (1,))]
    # 16 + 16 + 6 = 38 bytes fit in 40; d (40 bytes) fills its own; e starts the next
    assert plan_buckets(layout, 40) == [[0, 1, 2], [3], [4]]
    assert plan_buckets(layout, 10) == [[0], [1], [2], [3], [4]]  # a tensor larger than a bucket goes alone
    tensors = [torch.arange(4.0), torch.ones(2, 2), torch.tensor([1.5, -2.0, 3.25], dtype=bf16)]
    buf = pack_bucket(tensors)
    assert buf.dtype == torch.uint8 and buf.numel() == 38
    back = unpack_bucket(buf, layout[:3])
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(torch.equal(t, b) and t.dtype == b.dtype for t, (_, b) in zip(tensors, back))


def test_channel_round_trip_in_few_collectives():
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}
    state["norm.weight"] = torch.randn(64, generator=g).to(torch.bfloat16)  # odd-sized, other dtype
    state["embed"] = torch.randn(1000, 64, generator=g)  # larger than a bucket
    receiver = WeightReceiver()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("s", WeightSender(*receiver.address, bucket_bytes=64 * 64 * 4 * 3)))
    t.start()
    receiver.connect()
    t.join()
    sender = box["s"]
    out = {}
    t = threading.Thread(target=lambda: out.update(receiver.receive()))
    t.start()
    buckets = sender.send(state)
    t.join()
    assert buckets == 4  # 6 x 16 KiB weights three to a 48 KiB bucket, the norm in a third, the embedding alone
    assert out.keys() == state.keys()
    assert all(torch.equal(out[k], state[k]) and out[k].dtype == state[k].dtype for k in state)
