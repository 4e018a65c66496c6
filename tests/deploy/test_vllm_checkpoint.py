"""The side-by-side checkpoint's cache folder: reused while its stamp matches, rebuilt when stale,
and safe when two processes (two test workers, two benches) build it at once."""

from __future__ import annotations

import json
import shutil

from deploy.bench import vllm_checkpoint as vc


def _fake_write(path, **overrides):
    """Stands in for the model build (seconds of transformers work): one file naming the call."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.txt").write_text(json.dumps(overrides, sort_keys=True))
    return path


def test_reused_while_its_stamp_matches_rebuilt_when_stale(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        vc, "write_checkpoint", lambda p, **o: calls.append(p) or _fake_write(p, **o)
    )
    target = tmp_path / "ckpt"
    assert vc.ensure_checkpoint(target) == target
    assert vc.ensure_checkpoint(target) == target
    assert len(calls) == 1  # the second call found the stamp
    (target / vc.STAMP).write_text(json.dumps({"format": 0}))  # another build's folder
    assert vc.ensure_checkpoint(target) == target
    assert len(calls) == 2
    assert json.loads((target / vc.STAMP).read_text()) == vc._stamp({})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it


def test_a_folder_another_process_renamed_in_first_is_kept(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    winner = tmp_path / "winner"

    def build_while_another_wins(path, **overrides):
        # The other process finishes its build and renames it into place while ours runs.
        _fake_write(winner, other=True)
        (winner / vc.STAMP).write_text(json.dumps(vc._stamp({})))
        shutil.move(winner, target)
        return _fake_write(path, **overrides)

    monkeypatch.setattr(vc, "write_checkpoint", build_while_another_wins)
    assert vc.ensure_checkpoint(target) == target
    # The winner's folder is the one in place (ours was not renamed over it or removed it).
    assert json.loads((target / "model.txt").read_text()) == {"other": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
