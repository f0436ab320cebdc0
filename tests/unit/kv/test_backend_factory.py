"""The backend factory: names, and `auto` falling back loudly (logged and counted)."""

import logging

import pytest
from dualpath.kv import backend as be
from prometheus_client import REGISTRY


def test_auto_falls_back_to_preadv_logged_and_counted(monkeypatch, caplog):
    def broken() -> None:
        raise be.NixlUnavailable("no POSIX plugin (test)")

    monkeypatch.setattr(be, "NixlBackend", broken)

    def fallbacks():
        labels = {"reason": "nixl_unavailable"}
        return REGISTRY.get_sample_value("dualpath_kv_backend_fallback_total", labels) or 0.0

    before = fallbacks()
    with caplog.at_level(logging.WARNING, logger="dualpath.kv.backend"):
        chosen = be.make_backend("auto")
    assert chosen.name == "preadv"
    assert fallbacks() == before + 1
    assert "NIXL unavailable" in caplog.text


def test_explicit_nixl_does_not_fall_back(monkeypatch):
    def broken() -> None:
        raise be.NixlUnavailable("no POSIX plugin (test)")

    monkeypatch.setattr(be, "NixlBackend", broken)
    with pytest.raises(be.NixlUnavailable):
        be.make_backend("nixl")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="auto, nixl, preadv"):
        be.make_backend("s3")
