"""On-policy distillation's side of ``rlhforge rl`` (docs/algorithms.md, "On-policy distillation"): the
start-up check that teacher and student share one tokenizer, and the teacher's in-process group (Ray runs
place it like the reference: :func:`rlhforge.distributed.launch.build_ray_groups`)."""

from __future__ import annotations

from rlhforge.config.parsing import ConfigError

__all__ = ["check_teacher_tokenizer", "build_teacher"]


def check_teacher_tokenizer(cfg, tokenizer) -> None:
    """The teacher scores the student's token ids, so both must map tokens to the same ids: the teacher's
    tokenizer is loaded and its token-to-id map (special tokens included) compared with the student's. A
    difference is a :class:`ConfigError` (exit 2) naming both paths and a token that differs."""
    from rlhforge.models.loading import load_tokenizer

    if not cfg.uses_teacher:
        return
    student_path, teacher_path = cfg.actor.model_name_or_path, cfg.teacher.model_name_or_path
    try:
        teacher_tok = load_tokenizer(teacher_path, use_fast=not cfg.data.disable_fast_tokenizer)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"--teacher.model_name_or_path {teacher_path}: {err}") from None
    student_tok = getattr(tokenizer, "tokenizer", tokenizer)  # a VLM's processor holds its tokenizer
    ours, theirs = student_tok.get_vocab(), teacher_tok.get_vocab()
    if ours == theirs:
        return
    only_s = sorted(set(ours) - set(theirs))
    only_t = sorted(set(theirs) - set(ours))
    moved = sorted(t for t in set(ours) & set(theirs) if ours[t] != theirs[t])
    if moved:
        example = f"{moved[0]!r} is id {ours[moved[0]]} for the student and {theirs[moved[0]]} for the teacher"
    elif only_s:
        example = f"{only_s[0]!r} (id {ours[only_s[0]]}) is only in the student's"
    else:
        example = f"{only_t[0]!r} (id {theirs[only_t[0]]}) is only in the teacher's"
    raise ConfigError(
        f"--teacher.model_name_or_path {teacher_path} and --actor.model_name_or_path {student_path} do not share a "
        f"tokenizer ({len(ours)} vs {len(theirs)} tokens; {len(moved)} with other ids, {len(only_s)} only in the "
        f"student's, {len(only_t)} only in the teacher's; e.g. {example}): on-policy distillation scores the "
        "student's token ids with the teacher, so both need the same token-to-id map")


def build_teacher(cfg, tokenizer, device):
    """The teacher's in-process group (None without on-policy distillation)."""
    if not cfg.uses_teacher:
        return None
    from rlhforge.distributed.groups import InProcessGroup
    from rlhforge.workers.teacher import TeacherWorker

    return InProcessGroup(TeacherWorker(cfg, tokenizer, device), "teacher")
