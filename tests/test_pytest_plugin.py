"""Tests of the ``--gpus`` pytest plugin and of NVML discovery (``cudarecv.testing.nvml``).

Enabling ``pytester``: pytest forbids ``pytest_plugins`` only in *non-root
conftest.py* files (an error since pytest 8); in a test module it is still
honoured, and the plugin is registered while this module is collected, before
any of its fixtures are resolved.  So the line below enables ``pytester`` for
this module alone, with no conftest and no ``-p pytester`` on the command line.

The inner pytest runs happen in a temporary directory, so they load the plugin
explicitly with ``-p cudarecv.testing.pytest_plugin`` (it is opt-in: installing
cudarecv registers no entry point) and get the repository on ``sys.path``
(in-process runs) and on ``PYTHONPATH`` (subprocess runs).  Most runs are in-process, which is fast and
lets a test fake the NVML count; one runs in a subprocess to exercise exactly
what a user types.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cudarecv.testing import nvml as _nvml
from cudarecv.testing import pytest_plugin

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
PLUGIN = ("-p", "cudarecv.testing.pytest_plugin")
# In-process, the plugin module is already imported (by this module and by
# earlier runs), so pytest warns that it cannot assert-rewrite it; and the
# cache plugin would only write .pytest_cache into the temporary directory.
INPROCESS = (*PLUGIN, "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:cacheprovider")

TESTS = """
import pytest

def test_plain():
    pass

@pytest.mark.gpus(1)
def test_one_gpu():
    pass

@pytest.mark.gpus(2)
def test_two_gpus():
    pass
"""


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Run pytest in-process on ``pytester``'s directory with the plugin loaded."""
    pytester.syspathinsert(REPO)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def _run(*args: str) -> pytest.RunResult:
        return pytester.runpytest(*INPROCESS, *args)

    return _run


def skip_reasons(pytester: pytest.Pytester, *args: str) -> dict[str, str]:
    """Test name -> skip reason, from an in-process run's reports."""
    reprec = pytester.inline_run(*INPROCESS, *args)
    _, skipped, _ = reprec.listoutcomes()
    reasons = {}
    for report in skipped:
        assert isinstance(report.longrepr, tuple)
        reasons[report.nodeid.rpartition("::")[2]] = report.longrepr[2].removeprefix("Skipped: ")
    return reasons


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make the plugin believe NVML sees ``count`` GPUs."""
    monkeypatch.setattr(_nvml, "gpu_count", lambda: count)
    monkeypatch.setattr(_nvml, "topology", lambda: [])


# --------------------------------------------------------------------------
# the plugin


def test_marker_is_registered(pytester: pytest.Pytester, run: Callable[..., Any]) -> None:
    pytester.makepyfile(TESTS)
    result = run("--strict-markers")
    result.assert_outcomes(passed=1, skipped=2)
    assert pytest_plugin.MARKER_HELP in "\n".join(run("--markers").outlines)


def test_marked_tests_skip_with_reason_without_gpus(
    pytester: pytest.Pytester, run: Callable[..., Any]
) -> None:
    pytester.makepyfile(TESTS)
    result = run("-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED * needs 1 GPU; run with --gpus 1 (this run: --gpus 0)",
            "SKIPPED * needs 2 GPUs; run with --gpus 2 (this run: --gpus 0)",
        ]
    )
    assert skip_reasons(pytester) == {
        "test_one_gpu": "needs 1 GPU; run with --gpus 1 (this run: --gpus 0)",
        "test_two_gpus": "needs 2 GPUs; run with --gpus 2 (this run: --gpus 0)",
    }


def test_unmarked_tests_are_unaffected(pytester: pytest.Pytester, run: Callable[..., Any]) -> None:
    pytester.makepyfile("def test_a():\n    pass\n\ndef test_b():\n    assert 1\n")
    run().assert_outcomes(passed=2)


def test_report_header(pytester: pytest.Pytester, run: Callable[..., Any]) -> None:
    pytester.makepyfile(TESTS)
    result = run()
    result.stdout.fnmatch_lines(["cudarecv: --gpus 0, NVML sees 0 GPU(s)"])


def test_more_gpus_than_nvml_sees_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user runs it: a fresh process, the real NVML (none here)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, "--gpus", "1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--gpus 1 asks for 1 GPU but NVML sees 0 GPU(s) on this machine: "
            "pass --gpus 0 to skip the tests marked gpus(k) with k above it*"
        ]
    )


def test_installing_cudarecv_changes_no_other_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another project's pytest in this environment: no --gpus, no header line, its own gpus marker."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeini("[pytest]\nmarkers = gpus: this project's own marker\n")
    pytester.makepyfile("import pytest\n@pytest.mark.gpus\ndef test_theirs():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    assert not any(line.startswith("cudarecv:") for line in result.outlines), (
        result.outlines
    )  # no header line
    assert (
        pytester.runpytest_subprocess("--gpus", "1").ret == pytest.ExitCode.USAGE_ERROR
    )  # unknown option


def test_negative_gpus_is_a_usage_error(pytester: pytest.Pytester, run: Callable[..., Any]) -> None:
    pytester.makepyfile(TESTS)
    result = run("--gpus", "-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpus -1: the GPU count cannot be negative*"])


@pytest.mark.parametrize(
    ("marker", "shown"),
    [
        ('gpus("two")', "gpus('two')"),
        ("gpus(-1)", "gpus(-1)"),
        ("gpus(True)", "gpus(True)"),
        ("gpus(1.5)", "gpus(1.5)"),
        ("gpus(1, 2)", "gpus(1, 2)"),
        ("gpus(k=2)", "gpus(k=2)"),
        ("gpus", "gpus()"),
    ],
)
def test_bad_marker_argument_is_an_error(
    pytester: pytest.Pytester, run: Callable[..., Any], marker: str, shown: str
) -> None:
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x():\n    pass\n")
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*test_x: bad marker @pytest.mark.{shown}; expected one non-negative int*"]
    )


def test_enough_gpus_run_marked_tests(
    pytester: pytest.Pytester, run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(monkeypatch, 2)
    pytester.makepyfile(TESTS + "\n@pytest.mark.gpus(3)\ndef test_three():\n    pass\n")
    result = run("--gpus", "2")
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["cudarecv: --gpus 2, NVML sees 2 GPU(s)"])
    assert skip_reasons(pytester, "--gpus", "2") == {
        "test_three": "needs 3 GPUs; run with --gpus 3 (this run: --gpus 2)"
    }


def test_gpus_may_ask_for_fewer_than_present(
    pytester: pytest.Pytester, run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(monkeypatch, 2)
    pytester.makepyfile(TESTS)
    run("--gpus", "1").assert_outcomes(passed=2, skipped=1)


def test_closest_and_class_markers_take_the_largest(
    pytester: pytest.Pytester, run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(monkeypatch, 1)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpus(1)
        class TestBoth:
            def test_one(self):
                pass

            @pytest.mark.gpus(2)
            def test_two(self):
                pass
        """
    )
    run("--gpus", "1").assert_outcomes(passed=1, skipped=1)
    assert skip_reasons(pytester, "--gpus", "1") == {
        "test_two": "needs 2 GPUs; run with --gpus 2 (this run: --gpus 1)"
    }


def test_cuda_visible_devices_caps_the_count(
    pytester: pytest.Pytester, run: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pytester.makepyfile(TESTS)
    result = run("--gpus", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*NVML sees 2 GPU(s), CUDA_VISIBLE_DEVICES allows 1 on this machine*at most 1*"]
    )


@pytest.mark.parametrize(
    ("value", "limit"),
    [(None, None), ("", 0), ("0", 1), ("0,1", 2), ("GPU-abc,1", 2), ("0,-1,2", 1), ("-1", 0)],
)
def test_cuda_visible_limit(
    monkeypatch: pytest.MonkeyPatch, value: str | None, limit: int | None
) -> None:
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert pytest_plugin.cuda_visible_limit() == limit


# --------------------------------------------------------------------------
# NVML discovery


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_real_nvml_agrees_with_the_machine() -> None:
    """No NVML library here, so 0 GPUs; on a GPU machine, NVML's own count."""
    if not _nvml_works():
        assert _nvml.gpu_count() == 0
        assert _nvml.topology() == []
        return
    import pynvml

    pynvml.nvmlInit()
    try:
        expected = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    assert _nvml.gpu_count() == expected
    assert [info.index for info in _nvml.topology()] == list(range(expected))


class NVMLError(Exception):
    pass


def _refuse(*_: object) -> Any:
    raise NVMLError("not supported")


def make_fake_nvml(**overrides: Any) -> types.SimpleNamespace:
    """Two GPUs joined by NVLink (2 links each); GPU1 cannot report its PCIe gen."""
    calls: list[str] = []
    fake = types.SimpleNamespace(
        calls=calls,
        NVML_NVLINK_MAX_LINKS=4,
        NVML_FEATURE_ENABLED=1,
        NVML_P2P_CAPS_INDEX_NVLINK=2,
        NVML_P2P_STATUS_OK=0,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: b"Fake H100" if h == "h0" else "Fake H100",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * 2**30),
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 5 if h == "h0" else _refuse(),
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 2 else (_refuse() if link == 3 else 0),
        nvmlDeviceGetP2PStatus=lambda a, b, index: 0,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 50,
    )
    for name, value in overrides.items():
        setattr(fake, name, value)
    return fake


def test_topology_with_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    infos = _nvml.topology()
    assert infos == [
        _nvml.GpuInfo(0, "Fake H100", "GPU-h0", 80 * 2**30, 5, 16, 2, {1: "NVLink"}),
        _nvml.GpuInfo(1, "Fake H100", "GPU-h1", 80 * 2**30, None, 16, 2, {0: "NVLink"}),
    ]
    assert fake.calls == ["init", "shutdown"]
    assert _nvml.gpu_count() == 2
    table = _nvml.format_topology(infos)
    header = ["name", "mem", "GiB", "PCIe", "NVLinks", "GPU0", "GPU1"]
    assert table.splitlines()[0].split() == header
    assert "gen5 x16" in table and "gen- x16" in table and "80.0" in table
    assert table.splitlines()[1].split()[-2:] == ["X", "NVLink"]


def test_topology_pcie_peers_and_failed_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake_nvml(
        nvmlDeviceGetCount=lambda: 3,
        nvmlDeviceGetHandleByIndex=lambda i: _refuse() if i == 2 else f"h{i}",
        nvmlDeviceGetP2PStatus=lambda a, b, index: 4,  # NVML_P2P_STATUS_NOT_SUPPORTED
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 20,
        nvmlDeviceGetNvLinkState=_refuse,
        nvmlDeviceGetName=_refuse,
        nvmlDeviceGetMemoryInfo=_refuse,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    infos = _nvml.topology()
    assert [info.peers for info in infos] == [
        {1: "PXB", 2: "?"},
        {0: "PXB", 2: "?"},
        {0: "?", 1: "?"},
    ]
    assert infos[0].name is None and infos[0].memory_bytes is None and infos[0].nvlinks_active == 0
    assert infos[2] == _nvml.GpuInfo(2, None, None, None, None, None, 0, {0: "?", 1: "?"})
    assert "GPU2" in _nvml.format_topology(infos)


def test_shutdown_even_when_a_query_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(_nvml, "_info", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _nvml.topology()
    assert fake.calls == ["init", "shutdown"]


@pytest.mark.parametrize("broken", ["init", "missing", "count"])
def test_no_nvml_means_no_gpus(monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    fake = make_fake_nvml()
    if broken == "init":
        fake.nvmlInit = _refuse
    if broken == "count":
        fake.nvmlDeviceGetCount = _refuse
    monkeypatch.setitem(sys.modules, "pynvml", None if broken == "missing" else fake)
    assert _nvml.gpu_count() == 0
    assert _nvml.topology() == []
    assert _nvml.format_topology([]) == "NVML sees no GPUs"
    if broken == "count":
        assert fake.calls.count("shutdown") == 2
    else:
        assert "shutdown" not in fake.calls
