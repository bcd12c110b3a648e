"""Developer sessions: tests, lint, typecheck, demo, bench.

Every session installs the pinned torch first (``torch==2.13.0``): an unpinned ``torch``
requirement would pull a multi-GB CUDA build into a fresh environment.
"""

from __future__ import annotations

import nox

TORCH = "torch==2.13.0"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# One intra-op thread per process: the test suite and benchmarks run several ranks
# on few cores, and a forked child that inherits a busy OpenMP pool can hang.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _install(session: nox.Session, extras: str, *, editable: bool = False) -> None:
    session.install(TORCH)
    session.install(*(["-e"] if editable else []), f".[{extras}]")


# TorchTitan's optimizer container and models without its training stack, so that the
# integration tests run for real (see docs/torchtitan.md); --no-deps keeps torch pinned.
# TorchTitan's model modules import triton; 3.7.1 is the release torch 2.13.0 pins (its CUDA
# wheels require it), and it installs and imports on a CPU-only machine. torchao is what
# TorchTitan's float8 converter wraps the weights with (tests/integrations/test_float8_weights.py).
TORCHTITAN = [
    "torchtitan==0.3.0",
    "tyro==1.0.17",
    "spmd_types==0.2.3",
    "docstring_parser==0.18.0",
    "typeguard==4.6.1",
    "triton==3.7.1",
    "torchao==0.18.0",
]


# What TorchTitan's job-config route adds (docs/torchtitan.md): the packages that
# ``import torchtitan.train`` and its config registries import. torchdata goes in with
# --no-deps (it requires torch); the others do not depend on torch.
TORCHTITAN_TRAINER = [
    "datasets==4.7.0",
    "tokenizers==0.23.3",
    "tensorboard==2.21.0",
    "pillow==13.0.0",
]


# Optimizers whose state dicts canzona.from_torch_state converts, besides torch's and
# TorchTitan's (tests/integrations/test_muon_package_state.py); pure Python, torch only.
STATE_SOURCES = ["muon-optimizer==0.1.0"]


def _suite(session: nox.Session) -> None:
    """The whole test suite with the pinned torch, TorchTitan and the state sources."""
    _install(session, "test")
    session.install("--no-deps", *TORCHTITAN, *STATE_SOURCES)
    session.run("pytest", "-q", *session.posargs, env=THREAD_ENV)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole test suite (multi-process gloo tests included)."""
    _suite(session)


# The newest torch release the suite is checked on. Its PyPI wheel is the CUDA build (about
# 3 GB with its NVIDIA libraries; it runs on CPU-only machines), and it brings the triton
# release it pins, so TorchTitan goes in without ours.
TORCH_NEXT = "torch==2.15.0"


@nox.session
def tests_next(session: nox.Session) -> None:
    """Run the whole test suite on the newest torch release checked (see TORCH_NEXT)."""
    session.install(TORCH_NEXT)
    session.install(".[test]")
    titan = [p for p in TORCHTITAN if not p.startswith("triton==")]
    session.install("--no-deps", *titan, *STATE_SOURCES)
    session.run("pytest", "-q", *session.posargs, env=THREAD_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Mypy over the package (strict on the plan and updates layers)."""
    _install(session, "test")
    session.install("mypy==2.4.1")
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: see README's Quick start."""
    _install(session, "test")
    session.run("canzona", "demo", *session.posargs, env=THREAD_ENV)


# Other Python releases the suite is checked on, with the pinned torch (CI runs 3.11). For
# these Pythons the PyPI wheel of torch 2.13.0 is the CUDA build (about 3 GB; it runs on
# CPU-only machines), and TORCHTITAN pins the triton release it requires. A release that is
# not on PATH as pythonX.Y is skipped, and nox says so.
OTHER_PYTHONS = ["3.12", "3.13"]


@nox.session(python=OTHER_PYTHONS)
def tests_python(session: nox.Session) -> None:
    """Run the whole test suite on another Python release (see OTHER_PYTHONS)."""
    _suite(session)


# The other distributed Muon implementations the step-latency benchmark runs side by side
# with canzona (benchmarks/_peers.py); --no-deps keeps torch pinned (muon-fsdp2 and heavyball
# compile with triton, installed with TORCHTITAN; opt-einsum is heavyball's only other import).
PEERS = ["muon-fsdp2==0.3.0", "muonium==0.2.0", "heavyball==3.2.1", "opt-einsum==3.4.0"]


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks in quick mode (``nox -s bench -- --full`` for the full grid).

    TorchTitan's DistMuon is a peer of the step-latency and overhead benchmarks; it and the
    other peers are installed with ``--no-deps`` (torch stays pinned). canzona is installed
    editable: the benchmarks run the checkout's ``src/``, the code their results name.
    """
    _install(session, "test,plot", editable=True)
    session.install("--no-deps", *TORCHTITAN, *PEERS)
    mode = "--full" if "--full" in session.posargs else "--quick"
    session.run("python", "benchmarks/run_all.py", mode, env=THREAD_ENV)


@nox.session
def torchtitan(session: nox.Session) -> None:
    """The TorchTitan tests with the job-config route's packages (its documented job config)."""
    _install(session, "test")
    session.install("--no-deps", *TORCHTITAN, "torchdata==0.11.0")
    session.install(*TORCHTITAN_TRAINER)
    session.run("pytest", "-q", "tests/integrations", *session.posargs, env=THREAD_ENV)
