import json

from rlhforge.backend.checkpoint import latest_checkpoint, list_checkpoints, rotate_checkpoints


def _fake(root, step, size=0):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (d / "blob").write_bytes(b"x" * size)
    return d


def test_rotation_by_count_keeps_protected_and_newest(tmp_path):
    for s in (1, 2, 3, 4, 5):
        _fake(tmp_path, s)
    (tmp_path / "step_9.tmp").mkdir()  # an interrupted save is not a checkpoint
    rotate_checkpoints(tmp_path, max_num=2, protected=("step_1",))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 4, 5]
    assert latest_checkpoint(tmp_path).name == "step_5"


def test_rotation_by_disk_budget(tmp_path):
    for s in (1, 2, 3):
        _fake(tmp_path, s, size=400_000)
    # budget of ~0.9 MB holds two 0.4 MB checkpoints
    rotate_checkpoints(tmp_path, max_num=10, max_mem_gb=900_000 / 2**30)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    # the newest is never removed, even over budget
    rotate_checkpoints(tmp_path, max_num=10, max_mem_gb=1e-9)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]


def test_latest_marker_wins_and_falls_back(tmp_path):
    for s in (1, 2):
        _fake(tmp_path, s)
    (tmp_path / "latest").write_text("step_1")
    assert latest_checkpoint(tmp_path).name == "step_1"
    (tmp_path / "latest").write_text("step_7")  # points at something gone: newest complete one
    assert latest_checkpoint(tmp_path).name == "step_2"


def test_partial_saves_are_removed_and_complete_ones_kept(tmp_path):
    from rlhforge.backend.checkpoint import remove_partial_saves

    _fake(tmp_path, 2)
    (tmp_path / "latest").write_text("step_2")
    (tmp_path / "step_3.tmp").mkdir()  # a save killed half-way
    (tmp_path / "step_3.tmp" / "torch_state.pt").write_bytes(b"\0" * 10)
    (tmp_path / ".latest.tmp999").write_text("")  # a marker write killed half-way
    (tmp_path / "notes.tmp").write_text("not ours")
    assert remove_partial_saves(tmp_path) == [".latest.tmp999", "step_3.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.tmp", "step_2"]
    assert latest_checkpoint(tmp_path).name == "step_2"
    assert remove_partial_saves(tmp_path / "missing") == []


def test_failed_checkpoint_write_raises_naming_the_folder_and_keeps_latest(tmp_path):
    """An OS error in the middle of a save (here: the step folder's path runs through a regular file,
    ENOTDIR, for the rank-0 mkdir) is a CheckpointWriteError naming the folder and the errno."""
    import pytest

    from rlhforge.backend.checkpoint import CheckpointWriteError, save_checkpoint

    class Strategy:
        rank, world_size, is_rank0 = 0, 1, True

        def barrier(self):
            pass

        def save_state(self, directory):
            raise AssertionError("not reached: the folder could not be made")

    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "ckpts"
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(Strategy(), root, 3, {"global_step": 3})
    assert f"could not write checkpoint {root / 'step_3.tmp'}" in str(err.value)
    assert "[ENOTDIR]" in str(err.value) and "no earlier checkpoint exists" in str(err.value)


def test_rotation_never_removes_the_checkpoint_just_written(tmp_path):
    """Issue 47, item 2: a folder already holding higher steps of an earlier run (step_123-125) and a new run's
    save of step_2 with --ckpt.max_num 3: the new checkpoint stays and ``latest`` names a complete folder
    (rotation kept the highest step numbers and deleted step_2 right after ``latest`` was set to it)."""
    from rlhforge.backend.checkpoint import save_checkpoint

    class Strategy:
        rank, world_size, is_rank0 = 0, 1, True

        def barrier(self):
            pass

        def save_state(self, directory):
            (directory / "model.pt").write_bytes(b"w")

    for s in (123, 124, 125):
        _fake(tmp_path, s)
    final = save_checkpoint(Strategy(), tmp_path, 2, {"global_step": 2}, max_num=3)
    assert final.name == "step_2" and (final / "model.pt").is_file()
    assert (tmp_path / "latest").read_text() == "step_2" and latest_checkpoint(tmp_path) == final
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 124, 125]  # max_num 3, the new one among them
    final = save_checkpoint(Strategy(), tmp_path, 3, {"global_step": 3}, max_num=1, max_mem_gb=1e-12)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3] and latest_checkpoint(tmp_path) == final  # over budget too
