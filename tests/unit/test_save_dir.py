"""What a --save directory holds, read from each checkpoint's completion record (common.pt) and series."""

import torch

from mimo.core.checkpoint.save_dir import prune, remove_unfinished, survey


def checkpoint(root, iteration, series="a", complete=True):
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    if complete:
        torch.save({"series": series, "iteration": iteration}, folder / "common.pt")
    return folder


def track(root, iteration):
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def test_survey_tells_complete_from_cut_short_and_series_apart(tmp_path):
    for it, series in ((10, "a"), (20, "a"), (2, "b"), (4, "b")):
        checkpoint(tmp_path, it, series)
    checkpoint(tmp_path, 6, "b", complete=False)
    track(tmp_path, 4)
    found = survey(tmp_path)
    assert found.complete == {2: "b", 4: "b", 10: "a", 20: "a"} and [p.name for p in found.unfinished] == ["iter_0000006"]
    assert found.tracker_series == "b" and found.resumes == 4  # another series' newer checkpoints are not resumed
    assert found.others("b", fresh=False) == [10, 20] and found.others("b", fresh=True) == [2, 4, 10, 20]


def test_the_tracker_moves_up_over_its_own_series_only(tmp_path):
    for it, series in ((2, "b"), (4, "b"), (6, "b"), (10, "a")):
        checkpoint(tmp_path, it, series)
    checkpoint(tmp_path, 8, "b", complete=False)
    track(tmp_path, 4)  # iteration 6 was complete when a kill came before the tracker moved
    lines = remove_unfinished(tmp_path)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    assert not (tmp_path / "iter_0000008").exists() and (tmp_path / "iter_0000010" / "common.pt").is_file()
    assert lines[0].startswith(f"removed 1 unfinished checkpoint in {tmp_path} (iter_0000008: ")
    assert lines[1] == (f"{tmp_path}: the tracker named iteration 4, but iter_0000006 is complete (a save stopped "
                        f"before the tracker moved): the tracker now names iteration 6")
    assert remove_unfinished(tmp_path) == []  # nothing left to do


def test_without_a_tracker_the_newest_complete_checkpoint_of_one_series_resumes(tmp_path):
    checkpoint(tmp_path, 2, "a")
    assert survey(tmp_path).resumes == 2
    remove_unfinished(tmp_path)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    checkpoint(tmp_path / "mixed", 2, "a")
    checkpoint(tmp_path / "mixed", 4, "b")
    assert survey(tmp_path / "mixed").resumes is None  # two runs, no tracker: which one is not ours to guess


def test_keep_last_prunes_only_its_own_series_up_to_the_saved_one(tmp_path):
    for it, series in ((2, "b"), (4, "b"), (6, "b"), (8, "a"), (10, "a"), (1, None)):
        checkpoint(tmp_path, it, series)
    assert prune(tmp_path, 1, "b", saved=6) == [2, 4]
    assert sorted(survey(tmp_path).complete) == [1, 6, 8, 10]
    assert prune(tmp_path, 1, None, saved=1) == []  # an older mimo's checkpoints are one series of their own


def test_a_live_runs_folder_is_refused_for_its_lock_before_what_it_holds(tmp_path):
    import pytest

    from mimo.core.checkpoint.save_lock import check_not_in_use, lock_save_directory, release_all
    from mimo.errors import UsageError

    check_not_in_use(tmp_path / "nowhere")  # nothing there: nothing written either
    assert not (tmp_path / "nowhere").exists()
    lock_save_directory(tmp_path)
    try:
        with pytest.raises(UsageError, match=rf"--save {tmp_path} is in use by another run \(pid \d+ on "):
            check_not_in_use(tmp_path)
    finally:
        release_all()
    check_not_in_use(tmp_path)
