"""The overnight cases a tester found (issue 38): each a run left alone that must finish or stop, say what is
wrong, and store only what was generated."""

from __future__ import annotations

from pathlib import Path

import pytest

from interlens import Conversation, ScriptedParticipant
from interlens.store import LedgerReader


def test_out_dir_with_a_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    conv = Conversation(participants=[ScriptedParticipant("a", ["hi"])]).turns(1)
    report = conv.rollout(n=2, out_dir="~/runs/x", progress=False)
    assert report.counts["done"] == 2
    assert (home / "runs" / "x" / "ledger.sqlite").is_file()
    assert not (cwd / "~").exists()
    with LedgerReader("~/runs/x") as reader:
        assert len(reader.job_ids()) == 2
