"""`leantune <command> --help` in well under a second.

The flags come from config classes that subclass transformers' TrainingArguments, and importing that takes about
5 s on a small CPU. So the first `--help` of a command renders it live and keeps the text in the user's cache
(`$LEANTUNE_CACHE_DIR`, else `$XDG_CACHE_HOME/leantune`, else `~/.cache/leantune`), under a key made of the
versions of leantune, transformers and Python and a fingerprint of leantune's own source files; every later
`--help` under the same key is read from there without importing torch. Nothing is kept in the repository, so a
new Python or transformers release, or an edited config field, only costs one live rendering.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from ..version import __version__

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    explicit = os.environ.get("LEANTUNE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "leantune"


def source_fingerprint() -> str:
    """Sizes and modification times of leantune's .py files: an edited field or help text changes it (~2 ms)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(PACKAGE_DIR)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def cache_key() -> dict:
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = None
    return {"leantune": __version__, "transformers": transformers_version,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}", "sources": source_fingerprint()}


def cache_file(key: dict | None = None) -> Path:
    key = cache_key() if key is None else key
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "help" / f"{name}.json"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def cached_help(command: str) -> str | None:
    return _read(cache_file()).get("help", {}).get(command)


def store_help(command: str, text: str) -> None:
    """Add one command's rendering to the cache; a cache that cannot be written is only a slower next --help."""
    key = cache_key()
    path = cache_file(key)
    cache = _read(path) or {"key": key, "help": {}}
    cache["help"][command] = text
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(cache, stream, sort_keys=True)
        os.replace(temporary, path)  # readers see the old file or the new one, never half of one
    except OSError:
        pass


def method_flag(argv: list[str]) -> str:
    """The value of `--method` in a command line (`leantune plan`), "sft" when absent."""
    for index, arg in enumerate(argv):
        if arg == "--method" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--method="):
            return arg.split("=", 1)[1]
    return "sft"


def help_entry(command: str, argv: list[str]) -> str:
    """The cache entry of a command line's help: `plan` lists the fields of the method it plans, one entry each."""
    method = method_flag(argv).lower().replace("_", "-")
    return command if command != "plan" or method == "sft" else f"plan --method {method}"
