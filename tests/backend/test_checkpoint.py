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
