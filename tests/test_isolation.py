"""The suite writes only into its own temporary directories: every phi4 path, and the staging
directory for model copies in RAM, which ``PHI4_HOME`` does not move (it is the user's, shared by
every install)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_phi4

USERS_STAGING = Path(f"/dev/shm/phi4-{os.getuid()}")


def test_every_path_phi4_writes_is_inside_the_tests_own_directories(phi4_home: Path):
    # Before: tests set PHI4_HOME but not PHI4_RAMDISK, so each daemon a test started staged its
    # model in the user's /dev/shm/phi4-<uid>, and a user's `phi4 cache clear` found them.
    from phi4cli.core.paths import get_paths
    from phi4cli.daemon.ramdisk import ramdisk_dir

    paths = get_paths()
    for directory in (
        paths.config_dir,
        paths.data_dir,
        paths.state_dir,
        paths.cache_dir,
        paths.runtime_dir,
    ):
        assert directory.is_relative_to(phi4_home), directory
    staging = ramdisk_dir()
    assert staging is not None and staging != USERS_STAGING
    assert staging.is_dir() and not any(staging.iterdir()), "made for this test, empty"
    assert staging.stat().st_uid == os.getuid() and staging.stat().st_mode & 0o777 == 0o700


@pytest.mark.daemon
def test_a_daemon_a_test_starts_stages_its_model_in_the_tests_own_directory(tiny_model: Path):
    from phi4cli.daemon.ramdisk import ramdisk_dir, staged_name

    staging = ramdisk_dir()
    assert staging is not None
    warmed = run_phi4("warm", "-m", str(tiny_model), "--json")  # ramdisk "auto", as users have it
    assert warmed.returncode == 0, warmed.stderr
    assert run_phi4("stop").returncode == 0
    name = staged_name(tiny_model)
    assert not (USERS_STAGING / name).exists(), "a copy in the user's staging directory"
    if json.loads(warmed.stdout)["staged"]:  # (a machine with tmpfs: staged, in the test's own)
        assert (staging / name).is_file()


@pytest.fixture(scope="module")
def module_environment() -> dict[str, str]:
    """The environment a module's fixture starts phi4 in: the suite's, set up before any
    test's own."""
    return dict(os.environ)


def test_what_a_modules_fixture_starts_writes_in_the_suites_own_directories(
    module_environment: dict[str, str],
):
    # Before: a module's server or daemon (started before the first test's PHI4_RAMDISK was
    # set) staged its model in the user's directory.
    staging = Path(module_environment["PHI4_RAMDISK"])
    home = Path(module_environment["PHI4_HOME"])
    suite = module_environment["PHI4_TEST_SUITE"]
    assert staging.name.startswith(f"p4-stage-{suite}-") and staging.is_dir()
    assert home.name.startswith(f"p4-suite-{suite}-") and home.is_dir()
