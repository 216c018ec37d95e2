"""`pip install .` ships every package of the source tree (pyproject.toml lists them by
hand: a new subpackage missing there would import here and fail in an installed copy)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_in_the_tree_is_installed():
    # (tomllib is Python 3.11+; the list is simple enough to read as text)
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text,
                                                     re.S | re.M).group(1)))
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".")
             for top in ("microtensor", "models") for p in (ROOT / top).rglob("__init__.py")}
    assert found, "no packages found: wrong root?"
    assert found == listed, (f"missing from pyproject.toml: {sorted(found - listed)}; "
                             f"listed but absent: {sorted(listed - found)}")
