#!/usr/bin/env python3
"""Check that the pins of ProServe's engine extras resolve together, for the platforms
they are meant for, without installing (or downloading) them.

``pip install --dry-run '.[cuda]'`` would need the whole vLLM and torch wheels (GBs: the
index serves no separate metadata for them) and ``.[ascend]`` cannot even be attempted
off an Ascend host (vllm-ascend's newest release ships a source archive whose build
needs CANN). So this reads, for every package an extra pins with ``==``, the METADATA
of the release's wheel for the target platform straight out of the wheel on the index
(HTTP range requests: the zip's central directory, then the one member; pip's local
--find-links directories too), follows the exact pins those packages place on others
two levels down (vLLM pins torch, torch its CUDA libraries), and checks every
requirement among all of them, with its environment markers evaluated for that
platform. A pinned release with no wheel anywhere is a conflict; one with a source
archive only, or from another index (vllm-ascend's), is reported and not checked.
Ranges on packages nobody pins exactly are left to pip.

    python scripts/check_extras.py                    # every extra in pyproject.toml's table below
    python scripts/check_extras.py --extra ascend     # one

Exit 0 when every extra is consistent, 1 when one is not (each conflict printed), 2 when
the index cannot be read.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
import zlib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
INDEX = os.environ.get("PROSERVE_INDEX_URL", "https://pypi.org/simple").rstrip("/")
#: the platform each extra is for: (machine, python); Ascend hosts are mostly aarch64 (Kunpeng)
TARGETS = {"cpu": ("x86_64", "3.11"), "cuda": ("x86_64", "3.11"), "ascend": ("aarch64", "3.11")}
TIMEOUT = 60
#: how many levels of exact pins below the extra's own are followed
DEPTH = 2
#: releases an extra's install takes from another index than PyPI (docs/ascend.md, step 4):
#: not reachable from every machine, so reported and not checked
OTHER_INDEX = {"triton-ascend": "https://mirrors.huaweicloud.com/ascend/repos/pypi"}


class IndexError_(Exception):
    pass


def _get(url: str, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.read()
    except OSError as e:
        raise IndexError_(f"{url}: {e}") from None


def _files(name: str) -> list[dict]:
    body = _get(f"{INDEX}/{canonicalize_name(name)}/", {"Accept": "application/vnd.pypi.simple.v1+json"})
    return json.loads(body)["files"]


def find_links() -> list[Path]:
    """The local wheel directories pip is configured with (``--find-links``), where pip
    would look as well as the index."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found += value.strip().strip("'\"").split()
    return [Path(p) for p in dict.fromkeys(found) if Path(p).is_dir()]


def _local_files(name: str) -> list[dict]:
    out = []
    for d in find_links():
        for f in d.glob("*.whl"):
            try:
                if canonicalize_name(parse_wheel_filename(f.name)[0]) == canonicalize_name(name):
                    out.append({"filename": f.name, "url": f.as_uri(), "size": f.stat().st_size, "local": f})
            except ValueError:
                continue
    return out


def _wheel(name: str, version: str, machine: str, python: str) -> dict | None:
    """The release's wheel for ``machine`` and CPython ``python`` (an abi3 or pure wheel
    too), on the index or in pip's local wheel directories, preferring the newest
    manylinux tag; None if it has none (a source archive only)."""
    cp = "cp" + python.replace(".", "")
    minor = int(python.split(".")[1])

    def abi3_ok(interp: str) -> bool:      # cp38-abi3 runs on every CPython 3.8+
        return interp.startswith("cp3") and interp[3:].isdigit() and int(interp[3:]) <= minor
    best = None
    for f in _files(name) + _local_files(name):
        fn = f["filename"]
        if not fn.endswith(".whl") or f.get("yanked"):
            continue
        try:
            _, ver, _, tags = parse_wheel_filename(fn)
        except ValueError:
            continue
        if ver != Version(version):
            continue
        ok = any((t.platform == "any" or (t.platform.startswith("manylinux") and t.platform.endswith(machine)))
                 and (t.interpreter in (cp, "py3") or (t.abi == "abi3" and abi3_ok(t.interpreter)))
                 for t in tags)
        if ok and (best is None or fn > best["filename"]):
            best = f
    return best


def _range(url: str, start: int, end: int | None = None) -> bytes:
    spec = f"bytes={start}-" if end is None else f"bytes={start}-{end}"
    return _get(url, {"Range": spec})


def wheel_metadata(url: str, size: int) -> str:
    """The ``*.dist-info/METADATA`` text of the wheel at ``url`` (``size`` bytes), read with
    range requests: the end of the zip (its central directory), then that one member."""
    tail = _range(url, max(0, size - 65536))
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise IndexError_(f"{url}: no zip directory in its last 64 KiB")
    cd_size, cd_off = struct.unpack("<II", tail[eocd + 12:eocd + 20])
    base = size - len(tail)
    if cd_off == 0xFFFFFFFF:                                  # zip64
        loc = tail.rfind(b"PK\x06\x07")
        (z64,) = struct.unpack("<Q", tail[loc + 8:loc + 16])
        rec = tail[z64 - base:] if z64 >= base else _range(url, z64, z64 + 56)
        cd_size, cd_off = struct.unpack("<QQ", rec[40:56])
    cd = tail[cd_off - base:cd_off - base + cd_size] if cd_off >= base else _range(url, cd_off, cd_off + cd_size - 1)
    pos = 0
    while pos + 46 <= len(cd) and cd[pos:pos + 4] == b"PK\x01\x02":
        method, = struct.unpack("<H", cd[pos + 10:pos + 12])
        csize, usize, nlen, elen, clen = struct.unpack("<IIHHH", cd[pos + 20:pos + 34])
        off, = struct.unpack("<I", cd[pos + 42:pos + 46])
        fname = cd[pos + 46:pos + 46 + nlen].decode()
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        if not (fname.endswith(".dist-info/METADATA") and fname.count("/") == 1):
            continue
        if 0xFFFFFFFF in (csize, off):                         # zip64 sizes/offset in the extra field
            i = 0
            while i + 4 <= len(extra):
                hid, hlen = struct.unpack("<HH", extra[i:i + 4])
                if hid == 1:
                    vals = list(struct.unpack(f"<{hlen // 8}Q", extra[i + 4:i + 4 + hlen // 8 * 8]))
                    if usize == 0xFFFFFFFF:
                        usize = vals.pop(0)
                    if csize == 0xFFFFFFFF:
                        csize = vals.pop(0)
                    if off == 0xFFFFFFFF:
                        off = vals.pop(0)
                i += 4 + hlen
        head = _range(url, off, off + 30 + 1024 + csize)
        n, e = struct.unpack("<HH", head[26:30])
        data = head[30 + n + e:30 + n + e + csize]
        raw = zlib.decompress(data, -15) if method == 8 else data
        return raw.decode("utf-8", "replace")
    raise IndexError_(f"{url}: no .dist-info/METADATA member")


def _metadata(whl: dict) -> str:
    local = whl.get("local")
    if local is not None:
        with zipfile.ZipFile(local) as z:
            member = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            return z.read(member).decode("utf-8", "replace")
    return wheel_metadata(whl["url"], whl["size"])


def requires(metadata: str) -> list[Requirement]:
    out = []
    for line in metadata.splitlines():
        if not line.strip():
            break                                               # the body (description) follows
        if line.startswith("Requires-Dist:"):
            out.append(Requirement(line.split(":", 1)[1].strip()))
    return out


def environment(machine: str, python: str) -> dict:
    return {"platform_machine": machine, "platform_system": "Linux", "sys_platform": "linux",
            "os_name": "posix", "python_version": python, "python_full_version": python + ".0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def pins(extra: str) -> dict[str, Version]:
    """The packages ``extra`` pins to one version (``==``), from pyproject.toml."""
    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    out = {}
    for text in reqs:
        r = Requirement(text)
        exact = [s for s in r.specifier if s.operator == "=="]
        if len(exact) == 1 and "*" not in exact[0].version:
            out[canonicalize_name(r.name)] = Version(exact[0].version)
    return out


def _exact(r: Requirement) -> Version | None:
    """The one version ``r`` allows, if it pins one (``==X``, no wildcard)."""
    exact = [sp for sp in r.specifier if sp.operator in ("==", "===")]
    if len(exact) != 1 or "*" in exact[0].version:
        return None
    return Version(exact[0].version)


def check(extra: str, log=print, depth: int = DEPTH) -> list[str]:
    """Conflicts among ``extra``'s pins on its target platform (empty: consistent). The
    exact pins the pinned packages place on others are followed ``depth`` levels down
    (e.g. vLLM pins torch, torch pins its CUDA libraries), each such release must have a
    wheel for the platform, and every requirement among all of them must hold."""
    machine, python = TARGETS[extra]
    env = environment(machine, python)
    pinned = dict(pins(extra))
    level = {name: 0 for name in pinned}
    conflicts = []
    reqs: dict[str, list[Requirement]] = {}
    todo = sorted(pinned)
    while todo:
        name = todo.pop(0)
        version = pinned[name]
        whl = _wheel(name, str(version), machine, python)
        if whl is None and name in OTHER_INDEX:
            log(f"  {name}=={version}: from {OTHER_INDEX[name]} (not checked here)")
            continue
        if whl is None and any(f["filename"].endswith((".tar.gz", ".zip")) and f"-{version}." in f["filename"]
                               for f in _files(name)):
            log(f"  {name}=={version}: a source archive only (pip builds it; its requirements not checked)")
            continue
        if whl is None:
            hint = (" (a PyTorch build with a local label: it is on PyTorch's own index, e.g. "
                    "https://download.pytorch.org/whl/cpu, which pip must be given)") if version.local else ""
            conflicts.append(f"{name}=={version} has no wheel for {machine}, CPython {python} on the index "
                             f"or in pip's --find-links{hint}")
            continue
        log(f"  {name}=={version}: {whl['filename']}")
        reqs[name] = [r for r in requires(_metadata(whl))
                      if r.marker is None or Marker(str(r.marker)).evaluate(env)]
        for r in reqs[name]:
            other, v = canonicalize_name(r.name), _exact(r)
            if v is not None and other not in pinned and level[name] < depth:
                pinned[other], level[other] = v, level[name] + 1
                todo.append(other)
    for name, rs in sorted(reqs.items()):
        for r in rs:
            other = canonicalize_name(r.name)
            if other in pinned and not r.specifier.contains(pinned[other], prereleases=True):
                how = "pins" if level[other] == 0 else f"has {other}=={pinned[other]} (pinned by a dependency)"
                conflicts.append(f"{name}=={pinned[name]} requires {r} (marker: {r.marker or 'none'}); "
                                 f"[{extra}] {how if level[other] else 'pins ' + other + '==' + str(pinned[other])}")
    if len(pinned) < 2:
        log(f"  (one release and no exact pin below it: nothing to check it against)")
    return conflicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extra", choices=sorted(TARGETS), action="append",
                    help="the extra to check (repeatable; default: all)")
    args = ap.parse_args(argv)
    bad = False
    for extra in args.extra or sorted(TARGETS):
        machine, python = TARGETS[extra]
        print(f"[{extra}] on {machine}, CPython {python}: {', '.join(f'{n}=={v}' for n, v in sorted(pins(extra).items()))}")
        try:
            conflicts = check(extra)
        except IndexError_ as e:
            print(f"error: cannot read the index: {e}", file=sys.stderr)
            return 2
        for c in conflicts:
            print(f"  CONFLICT: {c}")
        print(f"  {'consistent' if not conflicts else f'{len(conflicts)} conflict(s)'}")
        bad |= bool(conflicts)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
