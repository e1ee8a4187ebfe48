"""Dockerfile.cuda's wheel choices agree with each other, checked from the file alone (no network, no
Docker engine): the CUDA base image, the PyTorch wheel index, cupy and NVRTC of every pair the file
documents (``# pair:`` comments; its ARG defaults are the first), the index one that exists for the
torch it installs, and the RUN lines following the build arguments instead of a fixed CUDA.

Each rule is also shown refusing a wrong pair or a wrong Dockerfile, so that none passes vacuously.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile.cuda"

# The PyTorch wheel indexes (https://download.pytorch.org/whl/<tag>) of each torch release; a tag
# names the CUDA it is built against (cu130: 13.0, cu126: 12.6). 2.13: pytorch/pytorch RELEASE.md, "Release Compatibility
# Matrix" row for 2.13 (pytorch/pytorch#187075): stable CUDA 12.6 and 13.0, experimental CUDA 13.2
# (built with 12.6.3 / 13.0.2 / 13.2.1); CUDA 12.8 left the build matrix in 2.12 (RFC
# pytorch/pytorch#178665), so there is no cu128 for 2.12 on. A torch release missing here is refused:
# add its row, with the source, when the Dockerfile moves to it.
TORCH_INDEXES = {"2.13": ("cu126", "cu130", "cu132")}

# nvidia/cuda tags on Docker Hub that the Dockerfile may start from: ones seen in use as FROM lines
# of public Dockerfiles (13.0.1 and 13.0.2 runtime with cuDNN on Ubuntu 24.04, 12.6.3 likewise, and
# 12.8.1, this file's former default). Another tag is refused until it is checked and added here.
KNOWN_IMAGES = {
    "13.0.2-cudnn-runtime-ubuntu24.04",
    "13.0.1-cudnn-runtime-ubuntu24.04",
    "12.8.1-cudnn-runtime-ubuntu24.04",
    "12.6.3-cudnn-runtime-ubuntu24.04",
}

# cupy's wheel for each CUDA major (PyPI: cupy-cuda12x, cupy-cuda13x, "a CuPy wheel for CUDA 13.x"),
# and NVRTC's: CUDA 13's wheels dropped the -cuNN suffix (PyPI: nvidia-cuda-nvrtc 13.0.48 on;
# cuda-toolkit 13.0.3.0, which torch 2.13's CUDA 13.0 build depends on, has its nvrtc extra as
# nvidia-cuda-nvrtc==13.0.88.*), CUDA 12's is nvidia-cuda-nvrtc-cu12.
CUPY_FOR_MAJOR = {12: "cupy-cuda12x", 13: "cupy-cuda13x"}
NVRTC_FOR_MAJOR = {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc"}

PAIR_KEYS = ("CUDA_IMAGE", "TORCH_CUDA", "CUDA_MAJOR", "CUPY", "NVRTC")


@dataclass
class Parsed:
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults, first declaration wins
    pairs: list[dict[str, str]] = field(default_factory=list)  # the "# pair:" comments, in order
    builds: list[dict[str, str]] = field(
        default_factory=list
    )  # --build-arg of each documented docker build
    instructions: list[tuple[str, str]] = field(
        default_factory=list
    )  # (INSTRUCTION, arguments), lines joined

    def runs(self) -> list[str]:
        return [rest for keyword, rest in self.instructions if keyword == "RUN"]


def _assignments(words: Iterable[str]) -> dict[str, str]:
    out = {}
    for word in words:
        key, sep, value = word.partition("=")
        if sep:
            out[key] = value
    return out


def parse(text: str) -> Parsed:
    """The ARG defaults, documented pairs, documented ``docker build`` lines and instructions of ``text``."""
    parsed = Parsed()
    comments: list[str] = []
    pending = ""  # an instruction continued with a trailing backslash
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            if not pending:  # a comment inside a continued instruction is dropped, as Docker does
                comments.append(line[1:].strip())
            continue
        if not line and not pending:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical, pending = pending + line, ""
        keyword, _, rest = logical.partition(" ")
        parsed.instructions.append((keyword.upper(), rest.strip()))
        if keyword.upper() == "ARG":
            for key, value in _assignments(shlex.split(rest)).items():
                parsed.args.setdefault(key, value)
    command = ""
    for comment in comments:
        match = re.match(r"pair:\s*(.*)", comment)
        if match:
            parsed.pairs.append(_assignments(shlex.split(match.group(1))))
            continue
        if command or comment.startswith("docker build"):
            command += comment.rstrip("\\") + " "
            if not comment.endswith("\\"):
                words = shlex.split(command)
                parsed.builds.append(
                    _assignments(
                        w for i, w in enumerate(words) if i and words[i - 1] == "--build-arg"
                    )
                )
                command = ""
    return parsed


def _cuda_of_tag(tag: str) -> str | None:
    """cu130 -> 13.0, cu126 -> 12.6 (the last digit is the minor)."""
    match = re.fullmatch(r"cu(\d+)(\d)", tag)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _name(requirement: str) -> str:
    try:
        return Requirement(requirement).name
    except InvalidRequirement:
        return requirement


def check_pair(pair: dict[str, str], torch_version: str) -> list[str]:
    """What is wrong with one (base image, torch index, CUDA major, cupy, NVRTC) choice; [] if nothing."""
    missing = [key for key in PAIR_KEYS if key not in pair]
    if missing:
        return [f"{pair}: no {', '.join(missing)}"]
    image, index = pair["CUDA_IMAGE"], pair["TORCH_CUDA"]
    problems = []
    if image not in KNOWN_IMAGES:
        problems.append(f"nvidia/cuda:{image} is not a tag known to exist ({sorted(KNOWN_IMAGES)})")
    match = re.fullmatch(r"(\d+)\.(\d+)\.\d+-.+", image)
    if not match:
        return problems + [f"{image}: no CUDA version at the start of the tag"]
    major, minor = int(match.group(1)), int(match.group(2))
    image_cuda = f"{major}.{minor}"
    if _cuda_of_tag(index) != image_cuda:
        problems.append(
            f"index {index} is torch for CUDA {_cuda_of_tag(index)}, the image {image} is CUDA {image_cuda}"
        )
    indexes = TORCH_INDEXES.get(torch_version)
    if indexes is None:
        problems.append(
            f"no known wheel indexes for torch {torch_version}: add them to TORCH_INDEXES, with the source"
        )
    elif index not in indexes:
        problems.append(
            f"torch {torch_version} has no {index} wheels (its indexes: {', '.join(indexes)})"
        )
    if pair["CUDA_MAJOR"] != str(major):
        problems.append(f"CUDA_MAJOR={pair['CUDA_MAJOR']} on a CUDA {image_cuda} image")
    for key, table in (("CUPY", CUPY_FOR_MAJOR), ("NVRTC", NVRTC_FOR_MAJOR)):
        try:
            requirement = Requirement(pair[key])
        except InvalidRequirement:
            problems.append(f"{key}={pair[key]!r} is not a requirement")
            continue
        if requirement.name != table.get(major):
            problems.append(
                f"{key}={requirement.name} is not the {key.lower()} of CUDA {major} ({table.get(major)})"
            )
        below = (
            f"{major}.{minor - 1}.999" if minor else f"{major - 1}.999.999"
        )  # the minor just before
        if key == "NVRTC" and not (
            requirement.specifier.contains(f"{image_cuda}.88")
            and not requirement.specifier.contains(f"{major}.{minor + 1}.0")
            and not requirement.specifier.contains(below)
        ):
            problems.append(
                f"NVRTC={pair[key]} is not pinned to the image's CUDA {image_cuda} (=={image_cuda}.*)"
            )
    return problems


def check_dockerfile(text: str, gpu_extra: list[str]) -> list[str]:
    """What is wrong with a whole Dockerfile.cuda; ``gpu_extra``: pyproject's gpu extra, as requirements."""
    parsed = parse(text)
    problems = []
    torch_version = parsed.args.get("TORCH_VERSION")
    if torch_version is None:
        problems.append("no ARG TORCH_VERSION")
    if not parsed.pairs:
        return problems + ["no '# pair:' comments"]
    defaults = {key: parsed.args.get(key) for key in PAIR_KEYS}
    if defaults != parsed.pairs[0]:
        problems.append(
            f"the ARG defaults {defaults} are not the first documented pair {parsed.pairs[0]}"
        )
    for pair in parsed.pairs:
        problems += check_pair(pair, torch_version or "?")
    for overrides in parsed.builds:
        built = {**defaults, **{k: v for k, v in overrides.items() if k in PAIR_KEYS}}
        if built not in parsed.pairs:
            problems.append(
                f"the documented docker build with {overrides} builds {built}, not a documented pair"
            )
    froms = [rest for keyword, rest in parsed.instructions if keyword == "FROM"]
    if froms != ["nvidia/cuda:${CUDA_IMAGE}"]:
        problems.append(f"FROM {froms}: not the one nvidia/cuda:${{CUDA_IMAGE}}")
    runs = parsed.runs()
    indexes = [
        m for run in runs for m in re.findall(r"download\.pytorch\.org/whl/([^\"'\s]+)", run)
    ]
    if indexes != ["${TORCH_CUDA}"]:
        problems.append(
            f"the torch index is {indexes}, not the one download.pytorch.org/whl/${{TORCH_CUDA}}"
        )
    if not any('"torch==${TORCH_VERSION}.*"' in run for run in runs):
        problems.append('torch is not installed as "torch==${TORCH_VERSION}.*"')
    asserted = [
        m
        for run in runs
        if "torch.version.cuda" in run
        for m in re.findall(r"startswith\('([^']*)'\)", run)
    ]
    if not asserted or any(major != "${CUDA_MAJOR}." for major in asserted):
        problems.append(
            f"torch.version.cuda is asserted to start with {asserted}, not with '${{CUDA_MAJOR}}.'"
        )
    installs = [run for run in runs if "pip install" in run]
    literal = sorted(
        {m for run in installs for m in re.findall(r"cupy-cuda\d+x|nvidia-cuda-nvrtc[\w-]*", run)}
    )
    if literal:
        problems.append(f"RUN names {literal} itself instead of the CUPY and NVRTC arguments")
    if not any('"${CUPY}' in run and '"${NVRTC}"' in run for run in runs):
        problems.append('no RUN installs "${CUPY}..." and "${NVRTC}"')
    freeze = [m for run in runs for m in re.findall(r"pip freeze > (\S+)", run)]
    if len(freeze) != 1:
        problems.append(
            f"the torch environment is not recorded once as a constraint file ({freeze})"
        )
    else:
        torch_run = next(i for i, run in enumerate(runs) if "pip freeze >" in run)
        for run in runs[torch_run + 1 :]:
            if "pip install" in run and f"-c {freeze[0]}" not in run:
                problems.append(
                    f"a pip install after torch's does not keep it (-c {freeze[0]}): {run[:80]}"
                )
    # the gpu extra names one cupy whatever the build arguments: installing it is right only where
    # every documented pair uses that cupy
    gpu_cupy = sorted(_name(r) for r in gpu_extra if _name(r).startswith("cupy"))
    for run in installs:
        for extras in re.findall(r"-e \"?\.\[([^\]]*)\]", run):
            wanted = sorted({_name(pair.get("CUPY", "")) for pair in parsed.pairs})
            if "gpu" in extras.split(",") and gpu_cupy != wanted:
                problems.append(
                    f"installs the gpu extra ({gpu_cupy}) where the pairs need {wanted}"
                )
    return problems


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _gpu_extra() -> list[str]:
    return _pyproject()["project"]["optional-dependencies"]["gpu"]


TEXT = DOCKERFILE.read_text()
PARSED = parse(TEXT)
GOOD = PARSED.pairs[0] if PARSED.pairs else {}


def test_the_dockerfile_is_consistent():
    assert check_dockerfile(TEXT, _gpu_extra()) == []


def test_it_documents_a_cuda_13_default_and_a_cuda_12_fallback():
    assert [pair["CUDA_MAJOR"] for pair in PARSED.pairs] == ["13", "12"]
    assert PARSED.args["TORCH_VERSION"] == "2.13"
    assert PARSED.args["TORCH_CUDA"] == "cu130" and PARSED.args["CUPY"] == "cupy-cuda13x"
    # the documented builds: the plain one (defaults) and the CUDA 12.6 one, which check_dockerfile checks
    assert [build.get("TORCH_CUDA") for build in PARSED.builds] == [None, "cu126"]


@pytest.mark.parametrize("pair", PARSED.pairs, ids=lambda p: p.get("TORCH_CUDA", "?"))
def test_each_documented_pair_is_consistent(pair):
    assert check_pair(pair, PARSED.args["TORCH_VERSION"]) == []


def test_the_torch_version_satisfies_pyproject():
    torch = next(
        Requirement(r)
        for r in _pyproject()["project"]["dependencies"]
        if Requirement(r).name == "torch"
    )
    assert torch.specifier.contains(PARSED.args["TORCH_VERSION"] + ".0")


@pytest.mark.parametrize(
    ("change", "torch_version", "refusal"),
    [
        # cu128: no torch 2.13 wheels, though the image, cupy and NVRTC agree with it
        (
            {
                "CUDA_IMAGE": "12.8.1-cudnn-runtime-ubuntu24.04",
                "TORCH_CUDA": "cu128",
                "CUDA_MAJOR": "12",
                "CUPY": "cupy-cuda12x",
                "NVRTC": "nvidia-cuda-nvrtc-cu12==12.8.*",
            },
            "2.13",
            "has no cu128 wheels",
        ),
        ({"TORCH_CUDA": "cu126"}, "2.13", "index cu126 is torch for CUDA 12.6"),
        ({"TORCH_CUDA": "cu132"}, "2.13", "index cu132 is torch for CUDA 13.2"),
        ({"CUDA_MAJOR": "12"}, "2.13", "CUDA_MAJOR=12 on a CUDA 13.0 image"),
        ({"CUPY": "cupy-cuda12x"}, "2.13", "CUPY=cupy-cuda12x is not the cupy of CUDA 13"),
        (
            {"NVRTC": "nvidia-cuda-nvrtc-cu12==13.0.*"},
            "2.13",
            "NVRTC=nvidia-cuda-nvrtc-cu12 is not the nvrtc of CUDA 13",
        ),
        ({"NVRTC": "nvidia-cuda-nvrtc"}, "2.13", "not pinned to the image's CUDA 13.0"),
        ({"NVRTC": "nvidia-cuda-nvrtc==13.2.*"}, "2.13", "not pinned to the image's CUDA 13.0"),
        ({"NVRTC": "nvidia-cuda-nvrtc==12.9.*"}, "2.13", "not pinned to the image's CUDA 13.0"),
        ({"CUDA_IMAGE": "13.0.2-cudnn-runtime-ubuntu2404"}, "2.13", "is not a tag known to exist"),
        ({"CUDA_IMAGE": "latest"}, "2.13", "no CUDA version at the start of the tag"),
        ({"CUPY": None}, "2.13", "no CUPY"),
        ({}, "2.15", "no known wheel indexes for torch 2.15"),
    ],
)
def test_a_wrong_pair_is_refused(change, torch_version, refusal):
    pair = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    problems = check_pair(pair, torch_version)
    assert any(refusal in problem for problem in problems), problems


def test_the_cuda_12_pair_on_a_cuda_13_image_is_refused_on_every_count():
    """The other documented pair's wheels on the default image: each mismatch is named."""
    mixed = {**PARSED.pairs[1], "CUDA_IMAGE": GOOD["CUDA_IMAGE"]}
    problems = check_pair(mixed, "2.13")
    for refusal in (
        "index cu126 is torch for CUDA 12.6",
        "CUDA_MAJOR=12",
        "CUPY=cupy-cuda12x",
        "NVRTC=nvidia-cuda-nvrtc-cu12 is not the nvrtc",
        "not pinned to the image's CUDA 13.0",
    ):
        assert any(refusal in problem for problem in problems), (refusal, problems)


# (old, new, refusal): a change to the real Dockerfile and the problem it must raise
WRONG_DOCKERFILES = [
    (
        "startswith('${CUDA_MAJOR}.'), torch.version.cuda",
        "startswith('12.'), torch.version.cuda",
        "torch.version.cuda is asserted to start with",
    ),
    (
        "v.startswith('${CUDA_MAJOR}.')",
        "v.startswith('13.')",
        "torch.version.cuda is asserted to start with",
    ),
    ("ARG CUDA_MAJOR=13", "ARG CUDA_MAJOR=12", "are not the first documented pair"),
    ("ARG TORCH_CUDA=cu130", "ARG TORCH_CUDA=cu128", "are not the first documented pair"),
    ("TORCH_CUDA=cu130 CUDA_MAJOR=13", "TORCH_CUDA=cu128 CUDA_MAJOR=13", "has no cu128 wheels"),
    ("ARG TORCH_VERSION=2.13", "ARG TORCH_VERSION=2.14", "no known wheel indexes for torch 2.14"),
    ("whl/${TORCH_CUDA}", "whl/cu130", "the torch index is ['cu130']"),
    ('"torch==${TORCH_VERSION}.*"', '"torch>=2.13"', "torch is not installed as"),
    ('"${CUPY}>=13"', '"cupy-cuda12x>=13"', "RUN names ['cupy-cuda12x'] itself"),
    (
        '"${CUPY}>=13" "${NVRTC}"',
        '"${CUPY}>=13" "nvidia-cuda-nvrtc==13.0.*"',
        "RUN names ['nvidia-cuda-nvrtc'] itself",
    ),
    ('-c /opt/torch-constraint.txt -e ".[test]"', '-e ".[test]"', "does not keep it"),
    ('-e ".[test]"', '-e ".[gpu,test]"', "installs the gpu extra"),
    (
        "--build-arg CUDA_MAJOR=12 --build-arg CUPY=cupy-cuda12x",
        "--build-arg CUPY=cupy-cuda12x",
        "not a documented pair",
    ),
    (
        "FROM nvidia/cuda:${CUDA_IMAGE}",
        "FROM nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04",
        "FROM [",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "refusal"), WRONG_DOCKERFILES, ids=[r for _, _, r in WRONG_DOCKERFILES]
)
def test_a_wrong_dockerfile_is_refused(old, new, refusal):
    assert TEXT.count(old) == 1, f"{old!r} is no longer in Dockerfile.cuda once: update this case"
    gpu_extra = [
        "cupy-cuda12x",
        "nvidia-ml-py",
        "nvidia-cuda-nvrtc-cu12",
    ]  # pyproject's, fixed here
    problems = check_dockerfile(TEXT.replace(old, new), gpu_extra)
    assert any(refusal in problem for problem in problems), problems


def _guard() -> str:
    """The RUN that stops the build when the arguments disagree with the image's CUDA_VERSION."""
    return next(run for run in PARSED.runs() if "want TORCH_CUDA" in run)


def _run_guard(pair: dict[str, str]) -> subprocess.CompletedProcess:
    sh = shutil.which("dash") or shutil.which("sh")  # /bin/sh of the Ubuntu images is dash
    if sh is None:
        pytest.skip("no POSIX shell")
    cuda_version = pair["CUDA_IMAGE"].split("-")[
        0
    ]  # what the nvidia/cuda image sets as CUDA_VERSION
    env = {
        **os.environ,
        **{k: v for k, v in pair.items() if k != "CUDA_IMAGE"},
        "CUDA_VERSION": cuda_version,
    }
    return subprocess.run([sh, "-c", _guard()], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("pair", PARSED.pairs, ids=lambda p: p.get("TORCH_CUDA", "?"))
def test_the_build_guard_lets_each_pair_through(pair):
    out = _run_guard(pair)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"TORCH_CUDA": "cu126"}, "TORCH_CUDA=cu126"),
        ({"CUDA_MAJOR": "12"}, "CUDA_MAJOR=12"),
        ({"CUPY": "cupy-cuda12x"}, "CUPY=cupy-cuda12x"),
        ({"NVRTC": "nvidia-cuda-nvrtc-cu12==12.6.*"}, "NVRTC=nvidia-cuda-nvrtc-cu12"),
        ({"NVRTC": "nvidia-cuda-nvrtc==13.5.*"}, "NVRTC=nvidia-cuda-nvrtc==13.5.*"),
        (
            {"CUDA_IMAGE": "12.6.3-cudnn-runtime-ubuntu24.04"},
            "TORCH_CUDA=cu130",
        ),  # only the image switched
    ],
)
def test_the_build_guard_stops_a_mixed_build(change, named):
    out = _run_guard({**GOOD, **change})
    assert out.returncode != 0 and named in out.stderr, (out.returncode, out.stderr)
