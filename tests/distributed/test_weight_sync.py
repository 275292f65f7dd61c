"""The dedicated weight-sync channel: bucketed, any dtype, bit-exact."""

import threading

import torch

from rlhforge.backend.collective import SyncGroup, free_port, pack_bucket, plan_buckets, state_fingerprint, unpack_bucket


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


def _join(world: int, **kwargs) -> dict:
    """``world`` members of a new sync group on loopback, each joined from its own thread: {rank: SyncGroup}."""
    port = free_port()
    groups: dict = {}
    joins = [threading.Thread(target=lambda r=r: groups.setdefault(r, SyncGroup("127.0.0.1", port, r, world, **kwargs)))
             for r in range(world)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(timeout=60)
    assert sorted(groups) == list(range(world))
    return groups


def test_group_broadcast_to_two_receivers_in_few_collectives():
    """Rank 0 (the actor's) sends once; both receivers (two engines) get every tensor bit-exact."""
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}
    state["norm.weight"] = torch.randn(64, generator=g).to(torch.bfloat16)  # odd-sized, other dtype
    state["embed"] = torch.randn(1000, 64, generator=g)  # larger than a bucket
    groups = _join(3)
    out: dict = {1: {}, 2: {}}
    recv = [threading.Thread(target=lambda r=r: out[r].update(groups[r].receive())) for r in (1, 2)]
    for t in recv:
        t.start()
    buckets = groups[0].send(state, bucket_bytes=64 * 64 * 4 * 3)
    for t in recv:
        t.join(timeout=60)
    assert buckets == 4  # 6 x 16 KiB weights three to a 48 KiB bucket, the norm in a third, the embedding alone
    for r in (1, 2):
        assert list(out[r]) == list(state)
        assert all(torch.equal(out[r][k], state[k]) and out[r][k].dtype == state[k].dtype for k in state)
    assert state_fingerprint(out[1]) == state_fingerprint(state)


def test_fingerprint_sees_every_byte_and_ignores_order():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    assert state_fingerprint(a) == state_fingerprint(list(reversed(list(a.items()))))
    b = dict(a, w=a["w"].clone())
    b["w"][1, 2] = torch.nextafter(b["w"][1, 2], torch.tensor(100.0))  # one ulp
    assert state_fingerprint(b) != state_fingerprint(a)
    assert state_fingerprint({"w": a["w"].reshape(3, 2), "b": a["b"]}) != state_fingerprint(a)  # shape counts


def test_streamed_buckets_follow_the_bucket_plan():
    from rlhforge.backend.collective import stream_buckets

    bf16 = torch.bfloat16
    state = {"a": torch.arange(4.0), "b": torch.ones(2, 2), "c": torch.tensor([1.5, -2.0, 3.25], dtype=bf16),
             "d": torch.arange(10.0), "e": torch.tensor([7.0])}
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    got = list(stream_buckets(state, 40))
    assert [[n for n, _, _ in entries] for entries, _, _ in got] == [[layout[i][0] for i in b]
                                                                     for b in plan_buckets(layout, 40)]
    assert [last for _, _, last in got] == [False, False, True]
    back = {n: t for entries, buf, _ in got for n, t in unpack_bucket(buf, entries)}
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)
    assert list(stream_buckets({}, 40)) == [([], None, True)]


def test_a_member_that_never_answers_ends_the_sync_at_its_deadline():
    """Issue 30, bug 7: a dead engine left actor rank 0 in the group's 30-minute timeout. Each wait now has
    the sync's deadline (``--vllm.sync_timeout_s``), well before the group's own timeout: rank 0 gets
    ``SyncTimeout`` in bounded time and the group is aborted; a new group then syncs as usual."""
    import time

    import pytest

    from rlhforge.backend.collective import SyncTimeout, watchdog_timeout_s

    assert watchdog_timeout_s(2.0) > 2.0  # the group's own timeout comes after the waits' deadline
    groups = _join(2, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(SyncTimeout, match="no progress within 2 s"):
        groups[0].send({"w": torch.ones(4)}, 1 << 20)  # member 1 never receives (a dead engine)
    assert time.monotonic() - t0 < 20  # the deadline, not 30 minutes (NCCL's watchdog would get 34 s)
    # the next sync opens a new group and completes
    fresh, out = _join(2, timeout_s=30.0), {}
    recv = threading.Thread(target=lambda: out.update(fresh[1].receive()))
    recv.start()
    fresh[0].send({"w": torch.arange(4.0)}, 1 << 20)
    recv.join(timeout=60)
    assert torch.equal(out["w"], torch.arange(4.0))
