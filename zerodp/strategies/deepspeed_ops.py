"""The C++ ops DeepSpeed compiles at a launch (a JIT build through torch.utils.cpp_extension): where they
are built, whether they can be, and saying so before the build.

`strategy.offload_optimizer` builds DeepSpeedCPUAdam's op (CPUAdamBuilder) on any accelerator, a minute
or more on a few cores. Without a C++ compiler that build ends the launch in a long traceback of ninja's;
`check` finds it at start-up.

On DeepSpeed's CPU accelerator its communication backend (deepspeed/comm/torch.py's TorchBackend) would
also build its shared-memory collectives (ShareMemCommBuilder, `deepspeed_shm_comm`) at the first
init_distributed, 25-70 s, for `inference_all_reduce` alone (module_inject's tensor-parallel inference),
which training never calls: `skip_unused_ops` tells DeepSpeed that op is not to be built, so a zero launch on
the CPU needs no compiler and waits for no build.

torch keeps the builds in ~/.cache/torch_extensions unless TORCH_EXTENSIONS_DIR says otherwise, one folder
for every environment of the user: two environments (their include paths differ) rebuild each other's
op at every launch, and wait on each other's lock. `use_environment_dir` keeps them per environment,
under its prefix, unless the user set the variable.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from zerodp.errors import UserError

EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"


def extensions_root(environ=os.environ) -> Path:
    """The folder torch builds extensions in (torch.utils.cpp_extension._get_build_directory): the
    user's TORCH_EXTENSIONS_DIR, else this environment's, <sys.prefix>/torch_extensions/<python>_<torch
    build> (a venv's or conda environment's prefix, which its owner can write), else, for a system
    Python, torch's per-user default with the same sub-folder."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if environ.get(EXTENSIONS_VAR):
        return Path(environ[EXTENSIONS_VAR])
    # torch's own layout: one folder per Python version and torch build
    kind = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
            f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    build = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{kind}"
    if os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "torch_extensions" / build
    return Path(get_default_build_root()) / build


def use_environment_dir() -> Path:
    """Set TORCH_EXTENSIONS_DIR to this environment's folder unless the user set it (before DeepSpeed
    builds anything: torch reads it at each build); return the folder builds go to."""
    root = extensions_root()
    os.environ.setdefault(EXTENSIONS_VAR, str(root))
    return Path(os.environ[EXTENSIONS_VAR])


def choose_accelerator() -> None:
    """DS_ACCELERATOR=cpu where torch sees no CUDA device and the user chose none (before DeepSpeed is
    imported: it picks its accelerator once): the CPU is where zerodp then trains, and DeepSpeed, left
    to detect it, falls back to the same with a warning that suggests something is wrong."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


SHM_COMM = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory collectives on its CPU accelerator: built for inference only (`skip_unused_ops`)."""


def skip_unused_ops() -> None:
    """Tell DeepSpeed not to build `deepspeed_shm_comm` (before its first init_distributed, which builds it
    on the CPU accelerator unless DeepSpeed's table of compatible ops says no): its TorchBackend uses the op
    for `inference_all_reduce` only, every collective of training goes through torch.distributed. The table
    (`deepspeed.ops.__compatible_ops__`) is made once per process and kept, edits included."""
    choose_accelerator()
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return  # no such op elsewhere: the table is not even made
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM] = False


def jit_ops(offload_optimizer: bool) -> list[str]:
    """The names of the ops a ZeRO launch here makes DeepSpeed build at run time: those it needs
    (`deepspeed_shm_comm` never: `skip_unused_ops`) that its accelerator has and DeepSpeed was not installed
    with (DS_BUILD_OPS=1 builds them at install)."""
    choose_accelerator()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    accel = get_accelerator()
    wanted = ["CPUAdamBuilder"] if offload_optimizer else []
    names = []
    for cls in wanted:
        builder = accel.create_op_builder(cls)
        if builder is None or type(builder).__name__ == "NotImplementedBuilder":
            continue
        if installed_ops.get(builder.name, False) and accelerator_name == accel._name:
            continue  # prebuilt: loaded as it is
        names.append(builder.name)
    return names


def unbuilt(names: list[str], root: Path) -> list[str]:
    """Those of `names` with no library in `root` yet: the ones a launch compiles (a library there is
    loaded, ninja finding it up to date)."""
    return [n for n in names if not (root / n / f"{n}.so").exists()]


def compiler(environ=os.environ) -> str | None:
    """The C++ compiler torch's build runs (CXX, else c++), or None when it is not found."""
    cxx = environ.get("CXX") or "c++"
    words = shlex.split(cxx)
    return shutil.which(words[0], path=environ.get("PATH")) if words else None


STALE_LOCK_S = 600
"""A build lock older than this (ten times a build of cpu_adam on a few cores) is taken for one that a stopped
launch left behind; a younger one for another launch's build or load in progress, waited for."""


def locks(names: list[str], root: Path) -> list[Path]:
    """The lock files in `root` of those of `names` that have one: torch's build of an op (built or not:
    every load goes through it, for a second or so when the op is built) holds `<root>/<op>/lock`, and every
    other process that loads the op polls until the file is gone, with no timeout and no word
    (torch.utils.file_baton.FileBaton)."""
    return [root / n / "lock" for n in names if (root / n / "lock").exists()]


def _age(path: Path) -> float | None:
    """Seconds since `path` was made (its mtime: torch makes the lock empty and never writes it); None when
    it is gone."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def wait_for_locks(what: str, names: list[str], root: Path) -> None:
    """Wait while another launch builds or loads one of `names` (its lock younger than STALE_LOCK_S), saying
    so once (from rank 0); UserError for a lock older than that: DeepSpeed would wait for it without end."""
    said = False
    while held := locks(names, root):
        age = _age(held[0])
        if age is None:
            continue
        if age > STALE_LOCK_S:
            raise UserError(f"{what}: DeepSpeed's build of its C++ op {held[0].parent.name} is locked by {held[0]} "
                            f"(made {_duration(age)} ago), and every rank would wait for it without end: a launch "
                            f"stopped while it built the op leaves that file behind; unless another launch is "
                            f"building it now, delete the file (rm {held[0]}) and launch again")
        if not said and age > 5 and os.environ.get("RANK", "0") == "0":
            print(f"zerodp: waiting for another launch's build of DeepSpeed's op {held[0].parent.name} (its lock "
                  f"{held[0]}, made {_duration(age)} ago; one older than {_duration(STALE_LOCK_S)} is taken for "
                  f"a stopped launch's)", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.5)


def check(strategy: str, offload_optimizer: bool) -> None:
    """UserError when this launch would make DeepSpeed compile an op and there is no C++ compiler (or
    no ninja, which torch's build runs) to do it, or when DeepSpeed would wait without end for a build's
    lock file. Called before any rank of the launch loads an op (the start-up checks), so a lock then is
    another launch's: one building or loading the op now (waited for, `wait_for_locks`), or one stopped
    while it built the op (killed at a time limit, say: the first offload launch compiles cpu_adam for a
    minute or more on a few cores), whose file nothing will ever remove."""
    what = f"strategy.name={strategy}" + (" with strategy.offload_optimizer=true" if offload_optimizer else "")
    names, root = jit_ops(offload_optimizer), extensions_root()
    wait_for_locks(what, names, root)
    missing = unbuilt(names, root)
    if not missing:
        return
    ops = ", ".join(missing)
    if compiler() is None:
        cxx = os.environ.get("CXX")
        found = f"CXX={cxx} is not found" if cxx else "no c++ on PATH"
        raise UserError(f"{what}: DeepSpeed compiles its C++ op {ops} at the first launch and there is no C++ "
                        f"compiler ({found}); install one (apt-get install g++, or conda install -c conda-forge "
                        f"gxx) or set CXX to it, or use strategy.name=ddp or fsdp, which compile nothing")
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise UserError(f"{what}: DeepSpeed compiles its C++ op {ops} at the first launch with ninja, which is not "
                        f"installed; pip install ninja")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.0f} h"


def build_line(offload_optimizer: bool) -> str | None:
    """The line to say before DeepSpeed compiles (None when nothing is to be compiled): what, where,
    that it is once per environment."""
    root = Path(os.environ.get(EXTENSIONS_VAR) or extensions_root())
    missing = unbuilt(jit_ops(offload_optimizer), root)
    if not missing:
        return None
    return (f"DeepSpeed compiles its C++ op {', '.join(missing)} (once for this environment; a minute or "
            f"so) into {root}")
