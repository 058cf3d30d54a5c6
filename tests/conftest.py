"""Test set-up: 8 host CPU devices, quick compiles and one compilation cache per run (before
jax is imported), and one hypothesis profile."""

import os

# Most of the suite's time is XLA compiling small programs once: the CPU backend's LLVM passes
# at their lowest level compile about 30% faster here, and the programs' numbers are the same
# (no fast-math). Training and benchmarks keep XLA's defaults. Set in XLA_FLAGS to override.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite compiles the same programs again and again: in module after module (JAX's
# in-memory caches are dropped after each, below), on both xdist workers, and in the training
# processes tests start. One persistent compilation cache per test run, made here by the
# process that starts first (the xdist controller; its workers and every child inherit the
# variable) and removed by it at exit, turns the repeats into loads; a program whose compile
# took under 0.05 s is not stored. A JAX_COMPILATION_CACHE_DIR you set is used instead. The
# caches of killed runs (no exit handler ran) are removed by a later run once a day old.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import glob
    import shutil
    import tempfile
    import time

    for _old in glob.glob(os.path.join(tempfile.gettempdir(), "jaxrl-agent-tests-xla-*")):
        if time.time() - os.path.getmtime(_old) > 86400:
            shutil.rmtree(_old, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl-agent-tests-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", deadline=None, max_examples=25, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Qwen2 checkpoint folder with Qwen2.5-Instruct's chat template, made once
    per test session by ``examples/make_tiny_checkpoint.py``."""
    import sys
    from pathlib import Path

    pytest.importorskip("tokenizers")
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import make_tiny_checkpoint
    finally:
        sys.path.remove(examples)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_checkpoint.main(str(folder))
    return folder


@pytest.fixture(scope="module")
def one_turn_batch():
    """One trajectory of one turn and no extras, packed in the concatenated layout at the
    shapes of ``tests.strategies.PAD``."""
    from tests.families import packer
    from tests.strategies import PAD

    recs = [{"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [1]}]}]
    return packer(PAD)(recs, "concatenated")[0]


@pytest.fixture(scope="module")
def fast_compiles():
    """XLA's backend optimisations off (``jax_disable_most_optimizations``) for the module
    that asks, restored after it."""
    import jax

    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after every test module: the suite compiles thousands of
    shapes and settings, and keeping them all alive grows the process by gigabytes (a full
    run segfaulted inside an XLA compile late in the suite)."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
