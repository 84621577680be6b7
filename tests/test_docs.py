"""docs/architecture.md names every module in one line, so the map stays true as code moves."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_architecture_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "splash").rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") or p.parent.name == "model"
    )
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md lacks a line for: {', '.join(missing)}"


def test_readme_quick_start_is_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = [ln.strip() for ln in quick.splitlines() if ln.strip().startswith("make ")]
    assert commands == ["make demo", "make test"]
