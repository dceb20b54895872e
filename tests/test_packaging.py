"""The wheel's contents as pyproject.toml declares them: every package of the tree and every data
file the code reads. (CI's wheel stage installs the built wheel and runs it; this test names the
missing entry in a second.)"""

import fnmatch
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def tree_packages() -> set[str]:
    """Dotted names of the folders holding an __init__.py, as they install."""
    names = set()
    for package, folder in setuptools_table()["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            names.add(".".join((package, *relative.parts)))
    return names


def test_every_package_is_listed():
    listed = set(setuptools_table()["packages"])
    assert tree_packages() - listed == set()
    assert listed - tree_packages() == set()


def test_every_data_file_is_package_data():
    table = setuptools_table()
    patterns = table["package-data"]
    missing = []
    for package in table["packages"]:
        folder = ROOT / table["package-dir"].get(package, package.replace(".", "/"))
        for path in folder.rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc"):
                continue
            relative = path.relative_to(folder)
            # a file inside a subpackage belongs to that package's entry
            if any((folder / part).joinpath("__init__.py").is_file() for part in relative.parents if part != pathlib.Path(".")):
                continue
            if not any(fnmatch.fnmatch(str(relative), glob) for glob in patterns.get(package, [])):
                missing.append(f"{package}: {relative}")
    assert missing == []
