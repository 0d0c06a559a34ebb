"""What MODEL resolves to when it names nothing on disk: a mistyped path is told as such, not as a hub id."""

from __future__ import annotations

import pytest

from corolla.errors import UnsupportedModel
from corolla.models.source import resolve_model


@pytest.mark.parametrize("spec", ["./modles/x", "models/x", "../models", "/no/such/model", "x.gguf"])
def test_a_missing_path_is_no_such_folder(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # `models/x`: its first part is a folder here, so it is a path
    with pytest.raises(UnsupportedModel, match=f"^no such folder or file: {spec} "):
        resolve_model(spec)


def test_an_owner_name_without_a_folder_is_tried_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        UnsupportedModel, match="'someone/no-such-model' is not a folder or file here, and the hub"
    ):
        resolve_model("someone/no-such-model")
