"""The C++ package the Python package ships (README "Using splitgrad from C++"): the CMake package
that splitgrad.cmake_prefix_path names, the public headers and libsplitgrad next to it. Building a
program against it is scripts/example_cpp.sh's job (CI runs it after installing)."""

import os
import re
from pathlib import Path

import splitgrad

REPO = Path(__file__).resolve().parents[2]


def test_cmake_prefix_path_holds_the_cmake_package():
    # find_package(splitgrad) with CMAKE_PREFIX_PATH=<p> looks in <p>/splitgrad*/, as for torch.
    package = Path(splitgrad.cmake_prefix_path) / "splitgrad"
    for name in ("splitgradConfig.cmake", "splitgradConfigVersion.cmake", "splitgradTargets.cmake"):
        assert (package / name).is_file(), f"{name} missing from {package}"
    version = (package / "splitgradConfigVersion.cmake").read_text()
    assert re.search(rf'PACKAGE_VERSION "{re.escape(splitgrad.__version__)}"', version)


def test_targets_point_inside_the_package():
    # The imported target is relocatable: its library and headers are found relative to the
    # config file, in this very package, and Torch is linked as a target, not a build-time path.
    targets = (Path(splitgrad.cmake_prefix_path) / "splitgrad" / "splitgradTargets.cmake").read_text()
    assert 'INTERFACE_LINK_LIBRARIES "torch' in targets
    assert "site-packages/torch" not in targets and str(REPO) not in targets
    root = Path(splitgrad.__file__).parent
    assert (root / "libsplitgrad.so").is_file()
    assert os.path.samefile(Path(splitgrad.cmake_prefix_path).parents[1], root)


def test_installed_headers_are_the_public_headers():
    installed = Path(splitgrad.__file__).parent / "include" / "splitgrad"
    source = REPO / "include" / "splitgrad"
    names = sorted(p.name for p in source.glob("*.h"))
    assert sorted(p.name for p in installed.glob("*.h")) == names
    for name in names:
        assert (installed / name).read_bytes() == (source / name).read_bytes(), f"{name} is stale"
