"""A regular (non-editable) install resolves the same serving defaults as the checkout.

The served map and its selector and budget travel with the package (rarecache/defaults.py), so
`pip install .` outside a checkout must hand off exactly as an editable install does. This builds a
wheel from a copy of the package, installs it into a fresh venv (torch and the other dependencies
reused from this interpreter through a .pth file, added after the install: nothing is downloaded),
and compares what `serve` and `generate` resolve there with what they resolve here. About 20 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RESOLVE = """
import json
from pathlib import Path

import rarecache
from rarecache.cli import build_parser
from rarecache.commands.common import fill_served_defaults
from rarecache.defaults import SERVED
from rarecache.packages import sha256_file

parser = build_parser()
out = {"package": str(Path(rarecache.__file__).resolve().parent)}
for name, words in (("serve", ["serve"]),
                    ("generate", ["generate", "--source", SERVED.source, "--target", SERVED.target, "hi"])):
    args = parser.parse_args(words)
    fill_served_defaults(args, args.source, args.target if name == "serve" else args.model)
    out[name] = {"map": str(Path(args.map).resolve()), "sha256": sha256_file(args.map), "selector": args.selector,
                 "rho": float(args.rho)}
print(json.dumps(out))
"""


def _resolve(python: str, cwd: Path, env: dict[str, str]) -> dict:
    done = subprocess.run([python, "-c", RESOLVE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_regular_install_resolves_the_serving_defaults_of_an_editable_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "rarecache", src / "rarecache", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(RARECACHE_HOME=str(tmp_path / "home"), PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [sys.executable, "-m", "pip", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(src)], check=True, env=env, cwd=tmp_path, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("rarecache-*.whl")
    venv.create(tmp_path / "venv", with_pip=False)
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", str(wheel)], check=True, env=env,
                   cwd=tmp_path, timeout=300)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=env).stdout.strip())
    (site / "reuse-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after rarecache's own

    installed = _resolve(python, tmp_path, env)
    editable = _resolve(sys.executable, ROOT, env)  # the checkout, as an editable install imports it
    assert Path(installed["package"]) == site / "rarecache"  # the installed copy, not the checkout
    assert Path(editable["package"]) == ROOT / "rarecache"
    for command in ("serve", "generate"):
        here, there = editable[command], installed[command]
        assert Path(there["map"]).is_file() and Path(there["map"]).is_relative_to(site / "rarecache")
        where = Path(there["map"]).relative_to(installed["package"])
        assert where == Path(here["map"]).relative_to(editable["package"])
        same = ("sha256", "selector", "rho")
        assert {k: there[k] for k in same} == {k: here[k] for k in same}
    assert installed["serve"] == installed["generate"]
